//! Binary shards (llm.c's layout): a header of 256 little-endian int32 (`[0]` magic, `[1]`
//! version, `[2]` number of values), then the values. Token shards use magic 20240520 with
//! version 1 for uint16 and version 2 for uint32 tokens; the synthetic corpus stores each
//! position's dependency distance in a parallel uint32 shard with magic 20261122. `Split`
//! samples training windows from a split's memory-mapped shards.

use super::meta::Meta;
use crate::util::atomic;
use crate::util::rng::Rng;
use anyhow::{bail, ensure, Context, Result};
use memmap2::Mmap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use tch::Tensor;

pub const TOKENS_MAGIC: i32 = 20240520;
pub(crate) const DEPS_MAGIC: i32 = 20261122;
const HEADER_INTS: usize = 256;
const HEADER_BYTES: usize = HEADER_INTS * 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Width {
    U16,
    U32,
}

impl Width {
    fn bytes(self) -> usize {
        match self {
            Width::U16 => 2,
            Width::U32 => 4,
        }
    }
    pub(crate) fn for_vocab(vocab: usize) -> Width {
        if vocab <= 1 << 16 {
            Width::U16
        } else {
            Width::U32
        }
    }
}

fn version_of(width: Width) -> i32 {
    match width {
        Width::U16 => 1,
        Width::U32 => 2,
    }
}

/// Writes one shard atomically.
pub fn write_shard(path: &Path, magic: i32, width: Width, values: &[u32]) -> Result<()> {
    write_shard_from(path, magic, width, values.len(), values.iter().copied())
}

/// Writes one shard of the `len` values `values` yields, atomically.
pub(crate) fn write_shard_from(
    path: &Path,
    magic: i32,
    width: Width,
    len: usize,
    values: impl Iterator<Item = u32>,
) -> Result<()> {
    ensure!(
        len <= i32::MAX as usize,
        "shard {} would hold more than 2^31 values",
        path.display()
    );
    atomic::write_with(path, |tmp| {
        let mut w = BufWriter::new(std::fs::File::create(tmp)?);
        let mut header = [0i32; HEADER_INTS];
        header[0] = magic;
        header[1] = version_of(width);
        header[2] = len as i32;
        for h in header {
            w.write_all(&h.to_le_bytes())?;
        }
        let mut written = 0usize;
        for v in values.take(len) {
            match width {
                Width::U16 => {
                    ensure!(
                        v <= u16::MAX as u32,
                        "value {v} does not fit a uint16 shard"
                    );
                    w.write_all(&(v as u16).to_le_bytes())?
                }
                Width::U32 => w.write_all(&v.to_le_bytes())?,
            }
            written += 1;
        }
        ensure!(
            written == len,
            "a shard of {len} values was given {written}"
        );
        w.flush()?;
        Ok(())
    })
}

/// A memory-mapped shard, its header checked against the file's real length.
pub struct Shard {
    map: Mmap,
    width: Width,
    len: usize,
}

impl Shard {
    pub fn open(path: &Path, magic: i32) -> Result<Shard> {
        let file = std::fs::File::open(path)
            .with_context(|| format!("cannot open shard {}", path.display()))?;
        // Safety: shards are written once (atomically) and never modified in place.
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("cannot map shard {}", path.display()))?;
        ensure!(
            map.len() >= HEADER_BYTES,
            "shard {} is truncated: {} bytes, shorter than its {HEADER_BYTES}-byte header",
            path.display(),
            map.len()
        );
        let int = |i: usize| i32::from_le_bytes(map[4 * i..4 * i + 4].try_into().unwrap());
        ensure!(
            int(0) == magic,
            "{} is not a shard of this kind: magic {} (expected {magic})",
            path.display(),
            int(0)
        );
        let width = match int(1) {
            1 => Width::U16,
            2 => Width::U32,
            v => bail!(
                "shard {} has unsupported version {v} (1 = uint16, 2 = uint32)",
                path.display()
            ),
        };
        ensure!(
            int(2) >= 0,
            "shard {} has a negative length in its header",
            path.display()
        );
        let len = int(2) as usize;
        let want = HEADER_BYTES + len * width.bytes();
        ensure!(
            map.len() == want,
            "shard {} is truncated or corrupt: its header says {len} values ({want} bytes) but the file has {} bytes",
            path.display(),
            map.len()
        );
        Ok(Shard { map, width, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn get(&self, i: usize) -> u32 {
        let o = HEADER_BYTES + i * self.width.bytes();
        match self.width {
            Width::U16 => u16::from_le_bytes([self.map[o], self.map[o + 1]]) as u32,
            Width::U32 => u32::from_le_bytes(self.map[o..o + 4].try_into().unwrap()),
        }
    }

    fn extend_into(&self, start: usize, n: usize, out: &mut Vec<i64>) {
        out.extend((start..start + n).map(|i| self.get(i) as i64));
    }
}

/// Streams values into consecutive shards `<prefix>_000.bin`, `<prefix>_001.bin`, ...
pub(crate) struct ShardWriter {
    dir: PathBuf,
    prefix: String,
    magic: i32,
    width: Width,
    shard_len: usize,
    buf: Vec<u32>,
    names: Vec<String>,
    total: u64,
}

impl ShardWriter {
    pub(crate) fn new(
        dir: &Path,
        prefix: &str,
        magic: i32,
        width: Width,
        shard_len: usize,
    ) -> Self {
        ShardWriter {
            dir: dir.to_path_buf(),
            prefix: prefix.into(),
            magic,
            width,
            shard_len,
            buf: Vec::new(),
            names: Vec::new(),
            total: 0,
        }
    }

    pub(crate) fn push(&mut self, v: u32) -> Result<()> {
        self.buf.push(v);
        self.total += 1;
        if self.buf.len() == self.shard_len {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let name = format!("{}_{:03}.bin", self.prefix, self.names.len());
        write_shard(&self.dir.join(&name), self.magic, self.width, &self.buf)?;
        self.names.push(name);
        self.buf.clear();
        Ok(())
    }

    pub(crate) fn finish(mut self) -> Result<(Vec<String>, u64)> {
        self.flush()?;
        Ok((self.names, self.total))
    }
}

/// The dependency shard that accompanies token shard `name`.
pub(super) fn deps_name(name: &str) -> String {
    name.replace(".bin", ".deps.bin")
}

// ---------------------------------------------------------------------------------------
// Loading.

/// The shards of one split, with their dependency shards when the data set has them, and
/// its parts: the validation split of a corpus prepared from a sources file has one per
/// source (its name and how many of the shards, in order, are its), any other split one.
pub(crate) struct Split {
    shards: Vec<Shard>,
    deps: Option<Vec<Shard>>,
    parts: Vec<(String, usize)>,
}

/// One batch: inputs and targets `[B, L]` (int64), and, for the synthetic corpus, the
/// dependency distance of each prediction `[B, L]` plus each row's offset into its stream.
pub(crate) struct Batch {
    pub(crate) x: Tensor,
    pub(crate) y: Tensor,
    pub(crate) deps: Option<Vec<u32>>,
}

impl Split {
    pub(crate) fn open(dir: &Path, meta: &Meta, split: &str) -> Result<Split> {
        let names = match split {
            "train" => &meta.train,
            "val" => &meta.val,
            _ => bail!("unknown split {split}"),
        };
        ensure!(
            !names.is_empty(),
            "data set {} has no {split} shards",
            dir.display()
        );
        let shards = names
            .iter()
            .map(|n| Shard::open(&dir.join(n), TOKENS_MAGIC))
            .collect::<Result<Vec<_>>>()?;
        let want = match split {
            "train" => meta.train_tokens,
            _ => meta.val_tokens,
        };
        let have: u64 = shards.iter().map(|s| s.len() as u64).sum();
        ensure!(
            have == want,
            "data set {}: meta.json gives the {split} split {want} tokens but its shards hold \
             {have}; the shards and meta.json do not belong together (a shard rewritten, with \
             another token width or cut short?): prepare the data set again",
            dir.display()
        );
        for (s, n) in shards.iter().zip(names) {
            if let Some((i, t)) = (0..s.len())
                .map(|i| (i, s.get(i)))
                .find(|(_, t)| *t as usize >= meta.vocab_size)
            {
                bail!(
                    "shard {n}: token {t} at index {i} is outside the vocabulary of {} tokens",
                    meta.vocab_size
                );
            }
        }
        let deps = if let Some(spec) = &meta.synth {
            let d = names
                .iter()
                .map(|n| Shard::open(&dir.join(deps_name(n)), DEPS_MAGIC))
                .collect::<Result<Vec<_>>>()?;
            for ((t, d), n) in shards.iter().zip(&d).zip(names) {
                ensure!(
                    t.len() == d.len(),
                    "dependency shard of {n} has {} entries for {} tokens",
                    d.len(),
                    t.len()
                );
                // A distance is at most the corpus's longest (0 marks none): max_distance, and
                // the three tokens each of the other keys' queries and one event may delay a
                // query that falls due behind them.
                let longest = spec.max_distance + 3 * (spec.n_keys + 1);
                if let Some((i, v)) = (0..d.len())
                    .map(|i| (i, d.get(i)))
                    .find(|(_, v)| *v as usize > longest)
                {
                    bail!(
                        "dependency shard of {n}: distance {v} at index {i} is beyond the longest \
                         this corpus can hold ({longest}: max_distance = {} and the delay of \
                         its {} keys' queries); the shard is corrupt: generate the data set again \
                         (attnsweep data synth)",
                        spec.max_distance,
                        spec.n_keys
                    );
                }
            }
            Some(d)
        } else {
            None
        };
        let sources = match (split, &meta.corpus) {
            ("val", Some(c)) => c.sources.as_slice(),
            _ => &[],
        };
        let parts: Vec<(String, usize)> = match sources.is_empty() {
            true => vec![(split.to_string(), shards.len())],
            false => sources
                .iter()
                .map(|s| (s.name.clone(), s.val.len()))
                .collect(),
        };
        let listed: Vec<&String> = sources.iter().flat_map(|s| &s.val).collect();
        ensure!(
            sources.is_empty() || listed == names.iter().collect::<Vec<_>>(),
            "data set {}: meta.json's sources list other validation shards than its val list; \
             prepare the data set again",
            dir.display()
        );
        Ok(Split {
            shards,
            deps,
            parts,
        })
    }

    /// The names of the split's parts, in order (one: the split's own name, unless it is a
    /// validation split held out per source).
    pub(crate) fn part_names(&self) -> Vec<&str> {
        self.parts.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// Tokens of the split's largest shard: a sequence never crosses shards, so the longest
    /// it can give (inputs and the next token) is this many.
    pub(crate) fn largest_shard(&self) -> usize {
        self.shards.iter().map(|s| s.len()).max().unwrap_or(0)
    }

    /// Every token of the split, shards in order.
    pub(crate) fn all_tokens(&self) -> Vec<u32> {
        self.shards
            .iter()
            .flat_map(|s| (0..s.len()).map(move |i| s.get(i)))
            .collect()
    }

    fn rows_to_batch(&self, rows: &[(usize, usize)], seq_len: usize, device: tch::Device) -> Batch {
        let mut buf = Vec::with_capacity(rows.len() * (seq_len + 1));
        for &(s, start) in rows {
            self.shards[s].extend_into(start, seq_len + 1, &mut buf);
        }
        let t = Tensor::from_slice(&buf)
            .view([rows.len() as i64, seq_len as i64 + 1])
            .to_device(device);
        let deps = self.deps.as_ref().map(|d| {
            rows.iter()
                .flat_map(|&(s, start)| (start..start + seq_len).map(move |i| d[s].get(i)))
                .collect()
        });
        Batch {
            x: t.narrow(1, 0, seq_len as i64),
            y: t.narrow(1, 1, seq_len as i64),
            deps,
        }
    }

    /// A batch of windows drawn uniformly over all valid start positions of all shards.
    pub(crate) fn sample(
        &self,
        rng: &mut Rng,
        batch: usize,
        seq_len: usize,
        device: tch::Device,
    ) -> Result<Batch> {
        let rows = self.draw(rng, batch, seq_len)?;
        Ok(self.rows_to_batch(&rows, seq_len, device))
    }

    /// Draws past the batch `sample` would give, reading nothing: `rng` moves on as it would.
    /// A data-parallel rank passes over the other ranks' micro-batches so.
    pub(crate) fn skip(&self, rng: &mut Rng, batch: usize, seq_len: usize) -> Result<()> {
        self.draw(rng, batch, seq_len).map(|_| ())
    }

    /// The (shard, start) of each window of a batch.
    fn draw(&self, rng: &mut Rng, batch: usize, seq_len: usize) -> Result<Vec<(usize, usize)>> {
        let starts: Vec<u64> = self
            .shards
            .iter()
            .map(|s| s.len().saturating_sub(seq_len) as u64)
            .collect();
        let total: u64 = starts.iter().sum();
        ensure!(total > 0, "no shard holds more than seq_len = {seq_len} tokens; use shorter sequences or more data");
        Ok((0..batch)
            .map(|_| {
                let mut r = rng.below(total);
                let s = starts.iter().position(|&n| {
                    if r < n {
                        true
                    } else {
                        r -= n;
                        false
                    }
                });
                let s = s.expect("r < total");
                (s, r as usize)
            })
            .collect())
    }

    /// Consecutive non-overlapping windows in order, grouped into batches, each with the index
    /// of its part (a batch never mixes parts). `max_batches` (0 = all) bounds the sequences
    /// to `max_batches x batch`, shared evenly between the parts (each part's first, at least
    /// one a part), so every part is evaluated however few batches are asked for: with fewer
    /// batches than parts, each part's batch is smaller than `batch`.
    pub(crate) fn sequential(
        &self,
        batch: usize,
        seq_len: usize,
        max_batches: usize,
        device: tch::Device,
    ) -> Vec<(usize, Batch)> {
        let per_part = match max_batches {
            0 => usize::MAX,
            m => (m * batch / self.parts.len()).max(1),
        };
        let mut out = Vec::new();
        let mut first = 0;
        for (p, &(_, n)) in self.parts.iter().enumerate() {
            let rows: Vec<(usize, usize)> = (first..first + n)
                .flat_map(|s| {
                    let len = self.shards[s].len();
                    (0..len.saturating_sub(1) / seq_len).map(move |i| (s, i * seq_len))
                })
                .take(per_part)
                .collect();
            out.extend(
                rows.chunks(batch)
                    .map(|c| (p, self.rows_to_batch(c, seq_len, device))),
            );
            first += n;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::meta::SynthSpec;
    use crate::data::synth::synth;
    use crate::util;

    fn tmp(name: &str) -> PathBuf {
        util::scratch_dir(&format!("data-{name}"))
    }

    #[test]
    fn shard_round_trip_both_widths_and_truncation() {
        let d = tmp("shard");
        for (width, vals) in [
            (Width::U16, vec![0u32, 1, 65535, 7]),
            (Width::U32, vec![0u32, 70000, u32::MAX]),
        ] {
            let p = d.join("s.bin");
            write_shard(&p, TOKENS_MAGIC, width, &vals).unwrap();
            let bytes = std::fs::read(&p).unwrap();
            assert_eq!(bytes.len(), HEADER_BYTES + vals.len() * width.bytes());
            let s = Shard::open(&p, TOKENS_MAGIC).unwrap();
            assert_eq!((0..s.len()).map(|i| s.get(i)).collect::<Vec<_>>(), vals);
            assert!(format!("{:#}", Shard::open(&p, DEPS_MAGIC).err().unwrap()).contains("magic"));
            std::fs::write(&p, &bytes[..bytes.len() - 1]).unwrap();
            assert!(
                format!("{:#}", Shard::open(&p, TOKENS_MAGIC).err().unwrap()).contains("truncated")
            );
            std::fs::write(&p, &bytes[..100]).unwrap();
            assert!(
                format!("{:#}", Shard::open(&p, TOKENS_MAGIC).err().unwrap()).contains("truncated")
            );
        }
        assert!(write_shard(&d.join("x.bin"), TOKENS_MAGIC, Width::U16, &[70000]).is_err());
        assert!(!d.join("x.bin").exists());
    }

    /// A dependency shard is range-checked as a token shard is: a distance beyond the
    /// corpus's longest is refused, naming the shard.
    #[test]
    fn dependencies_beyond_the_corpus_are_refused() {
        let d = tmp("deps-range");
        let spec = SynthSpec {
            train_tokens: 5000,
            val_tokens: 1000,
            max_distance: 32,
            ..Default::default()
        };
        let meta = synth(&spec, &d.join("ds")).unwrap();
        Split::open(&d.join("ds"), &meta, "train").unwrap();
        let name = deps_name(&meta.train[0]);
        write_shard(
            &d.join("ds").join(&name),
            DEPS_MAGIC,
            Width::U32,
            &[1_000_000; 5000],
        )
        .unwrap();
        let e = format!(
            "{:#}",
            Split::open(&d.join("ds"), &meta, "train").err().unwrap()
        );
        assert!(e.contains(&name) || e.contains(&meta.train[0]), "{e}");
        assert!(e.contains("max_distance = 32"), "{e}");
        // Every distance the generator writes passes: a query may fall due behind others.
        for seed in 1..4 {
            let spec = SynthSpec {
                seed,
                event_rate: 0.3,
                ..spec.clone()
            };
            let out = d.join(format!("busy{seed}"));
            let meta = synth(&spec, &out).unwrap();
            Split::open(&out, &meta, "train").unwrap();
        }
    }

    #[test]
    fn sampling_is_deterministic_for_a_seed() {
        let d = tmp("sample");
        let spec = SynthSpec {
            train_tokens: 5000,
            val_tokens: 600,
            ..Default::default()
        };
        let meta = synth(&spec, &d.join("ds")).unwrap();
        let split = Split::open(&d.join("ds"), &meta, "train").unwrap();
        let draw = |seed| {
            let mut r = Rng::new(seed);
            let b = split.sample(&mut r, 4, 32, tch::Device::Cpu).unwrap();
            Vec::<i64>::try_from(b.x.flatten(0, 1)).unwrap()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
        let val = Split::open(&d.join("ds"), &meta, "val").unwrap();
        let batches: Vec<Batch> = val
            .sequential(4, 100, 0, tch::Device::Cpu)
            .into_iter()
            .map(|(_, b)| b)
            .collect();
        assert_eq!(batches.iter().map(|b| b.x.size()[0]).sum::<i64>(), 5);
        assert!(batches[0]
            .x
            .get(0)
            .narrow(0, 1, 99)
            .equal(&batches[0].y.get(0).narrow(0, 0, 99)));
        assert_eq!(batches[0].deps.as_ref().unwrap().len(), 4 * 100);
    }

    /// `max_batches` bounds the sequences and shares them between every part: two batches of
    /// four over three parts are two sequences a part, each part in its own batch; a multiple
    /// of the parts gives each part its whole batches, as before.
    #[test]
    fn a_few_batches_reach_every_part() {
        let d = tmp("parts");
        let spec = SynthSpec {
            train_tokens: 5000,
            val_tokens: 2000,
            ..Default::default()
        };
        let meta = synth(&spec, &d.join("ds")).unwrap();
        let shards: Vec<Shard> = (0..3)
            .flat_map(|_| Split::open(&d.join("ds"), &meta, "val").unwrap().shards)
            .collect();
        let split = Split {
            shards,
            deps: None,
            parts: vec![("a".into(), 1), ("b".into(), 1), ("c".into(), 1)],
        };
        let drawn = |max_batches| -> Vec<(usize, i64)> {
            split
                .sequential(4, 100, max_batches, tch::Device::Cpu)
                .into_iter()
                .map(|(p, b)| (p, b.x.size()[0]))
                .collect()
        };
        assert_eq!(drawn(2), [(0, 2), (1, 2), (2, 2)]);
        assert_eq!(drawn(6), [(0, 4), (0, 4), (1, 4), (1, 4), (2, 4), (2, 4)]);
        assert_eq!(drawn(0).len(), 3 * 5);
    }
}
