//! What a data set is on disk: a directory with its shards and, written last, `meta.json`
//! (without it the directory is not a data set), which records how the data set was made.

use crate::util::atomic;
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::Path;

/// The layout of a data set this version writes and reads (`Meta::format`).
pub(crate) const META_FORMAT: u32 = 1;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Meta {
    pub(crate) format: u32,
    pub(crate) tokenizer: String,
    pub(crate) vocab_size: usize,
    /// Token separating documents, if the tokenizer has one.
    pub(crate) eot_token: Option<u32>,
    pub(crate) train: Vec<String>,
    pub(crate) val: Vec<String>,
    pub(crate) train_tokens: u64,
    pub(crate) val_tokens: u64,
    /// Present for the synthetic corpus: how it was generated.
    pub(crate) synth: Option<SynthSpec>,
    /// Present when the data set holds probe documents (`data probes`): the settings they
    /// were written with, which evaluation's probes default to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) probes: Option<ProbeDocs>,
    /// Present for a data set prepared from text (`data prepare`): what it was read from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) corpus: Option<CorpusRecord>,
    /// SHA-256 of the shards' bytes (train then val, each token shard followed by its
    /// dependency shard where there is one), recorded by `write_meta`: with the rest of this
    /// file, what identifies the data set's contents (`identity`). Absent from data sets
    /// written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) shards_sha256: Option<String>,
}

impl Meta {
    /// What evaluation needs of a data set that has only a `tokenizer.json` beside a model
    /// (multiple choice reads no shards): no splits, no tokens.
    pub(crate) fn of_tokenizer(vocab_size: usize) -> Meta {
        Meta {
            format: META_FORMAT,
            tokenizer: "tokenizer.json".into(),
            vocab_size,
            eot_token: None,
            train: vec![],
            val: vec![],
            train_tokens: 0,
            val_tokens: 0,
            synth: None,
            probes: None,
            corpus: None,
            shards_sha256: None,
        }
    }
}

/// What a data set prepared from text records of its corpus (in `meta.json`), so two
/// machines can tell whether they built the same one.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct CorpusRecord {
    /// The Python package read, with its version (`torch 2.11.0`).
    pub(crate) python_package: Option<String>,
    pub(crate) glob: Vec<String>,
    pub(crate) text_field: String,
    /// Files read (skipped ones not counted).
    pub(crate) files: u64,
    pub(crate) documents: u64,
    /// UTF-8 bytes of the documents' text.
    pub(crate) text_bytes: u64,
    pub(crate) skipped_files: u64,
    pub(crate) skipped_records: u64,
    /// SHA-256 of the token stream in reading order (each token a little-endian u32): the
    /// corpus's content hash.
    pub(crate) tokens_sha256: String,
    /// The pinned archives a sources file (`data prepare --sources`) names, each checked
    /// against its SHA-256 before anything was read.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) packages: Vec<Package>,
    /// A sources file's parts, in reading order, each with its own held-out split; empty when
    /// the whole corpus is one part (its val split the stream's last share).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) sources: Vec<SourceRecord>,
}

/// An archive a corpus is read from: where it is published and what it must hash to.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct Package {
    /// Its file name below the sources file's `root`.
    pub(crate) file: String,
    pub(crate) url: String,
    pub(crate) sha256: String,
}

/// One part of a corpus, held out on its own: the last `val_fraction` of its tokens are its
/// validation shards (`val`), so every part is evaluated on text the training never saw.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct SourceRecord {
    pub(crate) name: String,
    pub(crate) input: Vec<String>,
    pub(crate) glob: Vec<String>,
    pub(crate) files: u64,
    pub(crate) documents: u64,
    pub(crate) text_bytes: u64,
    pub(crate) train_tokens: u64,
    pub(crate) val_tokens: u64,
    /// Its validation shards, a consecutive run of the data set's `val` list.
    pub(crate) val: Vec<String>,
}

/// What a data set's probe documents were written with, beyond their seed: evaluation's
/// probes take these unless `eval.digits`, `eval.needles` or `eval.queries` say otherwise.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub(crate) struct ProbeDocs {
    pub(crate) digits: usize,
    pub(crate) needles: usize,
    pub(crate) queries: usize,
}

/// How the synthetic corpus is generated. Token ids: 0 = DEF, 1 = ASK, then `n_keys` keys,
/// then `n_values` values, then filler. One type for every place that takes it: the flags of
/// `data synth`, a grid's `[synth]` section (unset fields at their defaults) and a data set's
/// `meta.json`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, clap::Args)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct SynthSpec {
    /// Seed of the filler language and of both splits.
    #[arg(long, default_value_t = SynthSpec::default().seed)]
    pub(crate) seed: u64,
    /// Vocabulary: 2 markers (DEF, ASK), keys, values, and filler for the rest.
    #[arg(long, default_value_t = SynthSpec::default().vocab_size)]
    pub(crate) vocab_size: usize,
    /// Distinct keys; a key is reused with a new value once its query has been asked.
    #[arg(long, default_value_t = SynthSpec::default().n_keys)]
    pub(crate) n_keys: usize,
    /// Distinct values.
    #[arg(long, default_value_t = SynthSpec::default().n_values)]
    pub(crate) n_values: usize,
    /// Successors per token in the filler bigram model (its entropy is at most log(branch)).
    #[arg(long, default_value_t = SynthSpec::default().branch)]
    pub(crate) branch: usize,
    /// Probability that a filler position starts a definition.
    #[arg(long, default_value_t = SynthSpec::default().event_rate)]
    pub(crate) event_rate: f64,
    /// Power-law exponent of the query-to-definition distance, P(D) ∝ D^-alpha.
    #[arg(long, default_value_t = SynthSpec::default().alpha)]
    pub(crate) alpha: f64,
    /// Shortest query-to-definition distance.
    #[arg(long, default_value_t = SynthSpec::default().min_distance)]
    pub(crate) min_distance: usize,
    /// Longest query-to-definition distance (normally the training sequence length).
    #[arg(long, default_value_t = SynthSpec::default().max_distance)]
    pub(crate) max_distance: usize,
    /// Tokens in the training split.
    #[arg(long, default_value_t = SynthSpec::default().train_tokens)]
    pub(crate) train_tokens: usize,
    /// Tokens in the validation split.
    #[arg(long, default_value_t = SynthSpec::default().val_tokens)]
    pub(crate) val_tokens: usize,
}

impl Default for SynthSpec {
    fn default() -> Self {
        SynthSpec {
            seed: 1,
            vocab_size: 256,
            n_keys: 24,
            n_values: 32,
            branch: 4,
            event_rate: 0.05,
            alpha: 1.2,
            min_distance: 2,
            max_distance: 256,
            train_tokens: 2_000_000,
            val_tokens: 100_000,
        }
    }
}

impl SynthSpec {
    pub(crate) fn validate(&self) -> Result<()> {
        // Each split is one shard, whose header counts its values in an int32: checked before
        // a token is generated.
        for (flag, n) in [
            ("--train-tokens", self.train_tokens),
            ("--val-tokens", self.val_tokens),
        ] {
            ensure!(
                n <= i32::MAX as usize,
                "synth {flag} {n} is more than one shard holds ({}); lower it",
                i32::MAX
            );
        }
        for (name, v) in [("event rate", self.event_rate), ("alpha", self.alpha)] {
            ensure!(v.is_finite(), "synth {name} {v} is not a finite number");
        }
        ensure!(
            self.n_keys >= 1 && self.n_values >= 2,
            "synth needs at least 1 key and 2 values"
        );
        let filler = self.vocab_size as i64 - 2 - self.n_keys as i64 - self.n_values as i64;
        ensure!(filler >= 2, "synth vocab {} leaves {filler} filler tokens after 2 markers, {} keys and {} values; need at least 2", self.vocab_size, self.n_keys, self.n_values);
        ensure!(
            self.branch >= 1 && self.branch as i64 <= filler,
            "synth branch {} must be in 1 ..= {filler} (filler tokens)",
            self.branch
        );
        ensure!(
            (0.0..=0.5).contains(&self.event_rate),
            "synth event rate {} must be in 0 ..= 0.5",
            self.event_rate
        );
        ensure!(
            self.alpha >= 0.0 && self.alpha <= 10.0,
            "synth alpha {} must be in 0 ..= 10",
            self.alpha
        );
        ensure!(
            self.min_distance >= 2,
            "synth min distance {} must be at least 2 (1 is the filler's own order)",
            self.min_distance
        );
        ensure!(
            self.max_distance >= self.min_distance,
            "synth max distance {} is below min distance {}",
            self.max_distance,
            self.min_distance
        );
        ensure!(
            self.train_tokens >= 2 && self.val_tokens >= 2,
            "synth needs at least 2 train and 2 val tokens"
        );
        Ok(())
    }
}

/// Refuses to write into a directory that already holds a data set.
pub(crate) fn prepare_out_dir(out: &Path) -> Result<()> {
    if out.join("meta.json").exists() {
        bail!(
            "{} already holds a data set (meta.json); choose another --out or remove it first",
            out.display()
        );
    }
    atomic::ensure_writable_dir(out)?;
    // A writer killed before it finished left its temporary shards.
    atomic::remove_stale_temporaries(out)
}

/// SHA-256 of the shards `meta` lists in `dir` (train then val, each token shard followed by
/// its dependency shard where there is one).
fn shards_hash(dir: &Path, meta: &Meta) -> Result<String> {
    let mut hash = Sha256::new();
    for name in meta.train.iter().chain(&meta.val) {
        let mut files = vec![name.clone()];
        if meta.synth.is_some() {
            files.push(name.replace(".bin", ".deps.bin"));
        }
        for f in files {
            let path = dir.join(&f);
            let mut file = std::fs::File::open(&path)
                .with_context(|| format!("cannot read shard {}", path.display()))?;
            std::io::copy(&mut file, &mut hash)
                .with_context(|| format!("cannot read shard {}", path.display()))?;
        }
    }
    Ok(format!("{:x}", hash.finalize()))
}

/// Writes `meta.json`, the data set's last file, with the hash of the shards it lists (which
/// must be written already); returns what it wrote.
pub(crate) fn write_meta(out: &Path, meta: &Meta) -> Result<Meta> {
    let meta = Meta {
        shards_sha256: Some(shards_hash(out, meta)?),
        ..meta.clone()
    };
    atomic::write_bytes(
        &out.join("meta.json"),
        serde_json::to_string_pretty(&meta)?.as_bytes(),
    )?;
    Ok(meta)
}

/// Refuses a data set whose shards are not those its `meta.json` records (a shard replaced
/// or changed after it was written); one written before the hash was recorded passes.
pub(crate) fn check_shards(dir: &Path) -> Result<()> {
    let meta = read_meta(dir)?;
    let Some(recorded) = &meta.shards_sha256 else {
        return Ok(());
    };
    let now = shards_hash(dir, &meta)?;
    ensure!(
        *recorded == now,
        "the shards of the data set at {} are not those its meta.json records (SHA-256 {now}, \
         recorded {recorded}): a shard was replaced or changed after the data set was written; \
         restore them or prepare the data set again",
        dir.display()
    );
    Ok(())
}

/// What identifies the data set at `dir`: the SHA-256 of its `meta.json`, which records how it
/// was made and the hash of its shards. A run records it, and a resumed run refuses another.
pub(crate) fn identity(dir: &Path) -> Result<String> {
    let p = dir.join("meta.json");
    let bytes = std::fs::read(&p).with_context(|| format!("cannot read {}", p.display()))?;
    Ok(format!("{:x}", Sha256::digest(&bytes)))
}

pub fn read_meta(dir: &Path) -> Result<Meta> {
    let p = dir.join("meta.json");
    let text = std::fs::read_to_string(&p).with_context(|| {
        format!("{} is not a prepared data set (no readable meta.json); run `attnsweep data prepare` or `data synth`", dir.display())
    })?;
    let meta: Meta =
        serde_json::from_str(&text).with_context(|| format!("{} is malformed", p.display()))?;
    ensure!(
        meta.format == META_FORMAT,
        "{} is a data set of format {}, which this version does not read (it reads format \
         {META_FORMAT}); prepare the data set again with this version",
        p.display(),
        meta.format
    );
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A data set of a format this version does not know is refused, naming the format; one
    /// whose shards changed after meta.json was written is refused too.
    #[test]
    fn an_unknown_format_is_refused() {
        let dir = crate::util::scratch_dir("meta-format");
        let meta = Meta {
            format: META_FORMAT,
            tokenizer: "byte".into(),
            vocab_size: 257,
            eot_token: Some(256),
            train: vec!["train_000000.bin".into()],
            val: vec!["val_000000.bin".into()],
            train_tokens: 10,
            val_tokens: 10,
            synth: None,
            probes: None,
            corpus: None,
            shards_sha256: None,
        };
        std::fs::write(dir.join("train_000000.bin"), b"t").unwrap();
        std::fs::write(dir.join("val_000000.bin"), b"v").unwrap();
        let written = write_meta(&dir, &meta).unwrap();
        assert_eq!(read_meta(&dir).unwrap(), written);
        assert!(written.shards_sha256.is_some());
        check_shards(&dir).unwrap();
        // A shard changed under a kept meta.json.
        std::fs::write(dir.join("val_000000.bin"), b"w").unwrap();
        let e = format!("{:#}", check_shards(&dir).unwrap_err());
        assert!(e.contains("are not those its meta.json records"), "{e}");
        write_meta(&dir, &Meta { format: 7, ..meta }).unwrap();
        let e = format!("{:#}", read_meta(&dir).unwrap_err());
        assert!(e.contains("format 7") && e.contains("meta.json"), "{e}");
    }
}
