//! Token data: binary shards on disk, the byte-level tokenizer, the synthetic long-tail
//! dependency corpus, and the loader that samples training windows from memory-mapped shards.
//!
//! Shard layout (llm.c's): a header of 256 little-endian int32 (`[0]` magic, `[1]` version,
//! `[2]` number of values), then the values. Token shards use magic 20240520 with version 1
//! for uint16 and version 2 for uint32 tokens. The synthetic corpus stores each position's
//! dependency distance in a parallel uint32 shard with magic 20261122. A data set is a
//! directory with `meta.json` (written last: without it the directory is not a data set)
//! and its shards.

use crate::atomic;
use crate::rng::Rng;
use anyhow::{bail, ensure, Context, Result};
use memmap2::Mmap;
use serde::{Deserialize, Serialize};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use tch::Tensor;

pub const TOKENS_MAGIC: i32 = 20240520;
pub const DEPS_MAGIC: i32 = 20261122;
const HEADER_INTS: usize = 256;
const HEADER_BYTES: usize = HEADER_INTS * 4;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Meta {
    pub format: u32,
    pub tokenizer: String,
    pub vocab_size: usize,
    /// Token separating documents, if the tokenizer has one.
    pub eot_token: Option<u32>,
    pub train: Vec<String>,
    pub val: Vec<String>,
    pub train_tokens: u64,
    pub val_tokens: u64,
    /// Present for the synthetic corpus: how it was generated.
    pub synth: Option<SynthSpec>,
    /// Present when the data set holds probe documents (`data probes`): the settings they
    /// were written with, which evaluation's probes default to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probes: Option<ProbeDocs>,
    /// Present for a data set prepared from text (`data prepare`): what it was read from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub corpus: Option<crate::corpus::CorpusRecord>,
}

/// What a data set's probe documents were written with, beyond their seed: evaluation's
/// probes take these unless `eval.digits`, `eval.needles` or `eval.queries` say otherwise.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ProbeDocs {
    pub digits: usize,
    pub needles: usize,
    pub queries: usize,
}

/// Values one shard may hold: uint16 or uint32.
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
fn deps_name(name: &str) -> String {
    name.replace(".bin", ".deps.bin")
}

/// Refuses to write into a directory that already holds a data set.
pub(crate) fn prepare_out_dir(out: &Path) -> Result<()> {
    if out.join("meta.json").exists() {
        bail!(
            "{} already holds a data set (meta.json); choose another --out or remove it first",
            out.display()
        );
    }
    atomic::ensure_writable_dir(out)
}

fn write_meta(out: &Path, meta: &Meta) -> Result<()> {
    atomic::write_bytes(
        &out.join("meta.json"),
        serde_json::to_string_pretty(meta)?.as_bytes(),
    )
}

pub fn read_meta(dir: &Path) -> Result<Meta> {
    let p = dir.join("meta.json");
    let text = std::fs::read_to_string(&p).with_context(|| {
        format!("{} is not a prepared data set (no readable meta.json); run `attnsweep data prepare` or `data synth`", dir.display())
    })?;
    serde_json::from_str(&text).with_context(|| format!("{} is malformed", p.display()))
}

/// Byte-level tokenizer: token = byte value, 256 = end of document.
pub const BYTE_EOT: u32 = 256;

/// How text becomes tokens: bytes, or a Hugging Face `tokenizer.json`.
pub enum TextTokenizer {
    Bytes,
    Hf {
        tokenizer: Box<tokenizers::Tokenizer>,
        path: PathBuf,
    },
}

/// The tokenizer a data set was prepared with.
pub fn tokenizer_of(dir: &Path, meta: &Meta) -> Result<TextTokenizer> {
    match meta.tokenizer.as_str() {
        "byte" => Ok(TextTokenizer::Bytes),
        "tokenizer.json" => TextTokenizer::hf(&dir.join("tokenizer.json")),
        other => bail!(
            "data set {} was not prepared from text (tokenizer {other:?}); probes and multiple-choice tasks need a byte-level or tokenizer.json data set",
            dir.display()
        ),
    }
}

/// End-of-document tokens of common tokenizers, in the order they are looked for.
const EOT_NAMES: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];

impl TextTokenizer {
    pub fn hf(path: &Path) -> Result<TextTokenizer> {
        let tokenizer = tokenizers::Tokenizer::from_file(path).map_err(|e| {
            anyhow::anyhow!("{} is not a readable tokenizer.json: {e}", path.display())
        })?;
        Ok(TextTokenizer::Hf {
            tokenizer: Box::new(tokenizer),
            path: path.to_path_buf(),
        })
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            TextTokenizer::Bytes => 257,
            TextTokenizer::Hf { tokenizer, .. } => tokenizer.get_vocab_size(true),
        }
    }

    pub fn eot(&self) -> Option<u32> {
        match self {
            TextTokenizer::Bytes => Some(BYTE_EOT),
            TextTokenizer::Hf { tokenizer, .. } => {
                EOT_NAMES.iter().find_map(|n| tokenizer.token_to_id(n))
            }
        }
    }

    /// The token the tokenizer puts before a text when asked for its special tokens (Llama's
    /// `<s>`, `<|begin_of_text|>`), found by encoding with and without them; None for
    /// byte-level and for tokenizers that add none (Qwen, GPT-2).
    pub fn bos(&self) -> Option<u32> {
        let TextTokenizer::Hf { tokenizer, .. } = self else {
            return None;
        };
        let with = tokenizer.encode("a", true).ok()?;
        let without = tokenizer.encode("a", false).ok()?;
        let (with, without) = (with.get_ids(), without.get_ids());
        (with.len() > without.len() && with[1..].starts_with(without)).then(|| with[0])
    }

    /// Tokens of `text` with the tokenizer's special tokens added as its post-processor
    /// says (a BOS first, for most), as Hugging Face's `tokenizer(text)` gives them.
    pub fn encode_with_special(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            TextTokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            TextTokenizer::Hf { tokenizer, path } => Ok(tokenizer
                .encode(text, true)
                .map_err(|e| anyhow::anyhow!("tokenizing with {}: {e}", path.display()))?
                .get_ids()
                .to_vec()),
        }
    }

    /// Text of `ids`; a byte-level end of document ends it.
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            TextTokenizer::Bytes => {
                let bytes: Vec<u8> = ids
                    .iter()
                    .take_while(|&&t| t < 256)
                    .map(|&t| t as u8)
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            TextTokenizer::Hf { tokenizer, .. } => tokenizer.decode(ids, false).unwrap_or_default(),
        }
    }

    /// Tokens of `text`, without special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            TextTokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            TextTokenizer::Hf { tokenizer, path } => Ok(tokenizer
                .encode(text, false)
                .map_err(|e| anyhow::anyhow!("tokenizing with {}: {e}", path.display()))?
                .get_ids()
                .to_vec()),
        }
    }
}

/// Writes a text data set's tokenizer record and, last, its `meta.json`, given the shard
/// names and token counts of each split.
pub(crate) fn finish_text_dataset(
    out: &Path,
    tok: &TextTokenizer,
    (train, train_tokens): (Vec<String>, u64),
    (val, val_tokens): (Vec<String>, u64),
    probes: Option<ProbeDocs>,
    corpus: Option<crate::corpus::CorpusRecord>,
) -> Result<Meta> {
    let tokenizer = match tok {
        TextTokenizer::Bytes => "byte".to_string(),
        TextTokenizer::Hf { path, .. } => {
            // The data set keeps its tokenizer, so it describes itself.
            atomic::write_bytes(&out.join("tokenizer.json"), &std::fs::read(path)?)?;
            "tokenizer.json".to_string()
        }
    };
    let meta = Meta {
        format: 1,
        tokenizer,
        vocab_size: tok.vocab_size(),
        eot_token: tok.eot(),
        train,
        val,
        train_tokens,
        val_tokens,
        synth: None,
        probes,
        corpus,
    };
    write_meta(out, &meta)?;
    Ok(meta)
}

// ---------------------------------------------------------------------------------------
// Synthetic long-tail dependency corpus.

/// How the synthetic corpus is generated. Token ids: 0 = DEF, 1 = ASK, then `n_keys` keys,
/// then `n_values` values, then filler. One type for every place that takes it: the flags of
/// `data synth`, a grid's `[synth]` section (unset fields at their defaults) and a data set's
/// `meta.json`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, clap::Args)]
#[serde(deny_unknown_fields, default)]
pub struct SynthSpec {
    /// Seed of the filler language and of both splits.
    #[arg(long, default_value_t = SynthSpec::default().seed)]
    pub seed: u64,
    /// Vocabulary: 2 markers (DEF, ASK), keys, values, and filler for the rest.
    #[arg(long, default_value_t = SynthSpec::default().vocab_size)]
    pub vocab_size: usize,
    /// Distinct keys; a key is reused with a new value once its query has been asked.
    #[arg(long, default_value_t = SynthSpec::default().n_keys)]
    pub n_keys: usize,
    /// Distinct values.
    #[arg(long, default_value_t = SynthSpec::default().n_values)]
    pub n_values: usize,
    /// Successors per token in the filler bigram model (its entropy is at most log(branch)).
    #[arg(long, default_value_t = SynthSpec::default().branch)]
    pub branch: usize,
    /// Probability that a filler position starts a definition.
    #[arg(long, default_value_t = SynthSpec::default().event_rate)]
    pub event_rate: f64,
    /// Power-law exponent of the query-to-definition distance, P(D) ∝ D^-alpha.
    #[arg(long, default_value_t = SynthSpec::default().alpha)]
    pub alpha: f64,
    /// Shortest query-to-definition distance.
    #[arg(long, default_value_t = SynthSpec::default().min_distance)]
    pub min_distance: usize,
    /// Longest query-to-definition distance (normally the training sequence length).
    #[arg(long, default_value_t = SynthSpec::default().max_distance)]
    pub max_distance: usize,
    /// Tokens in the training split.
    #[arg(long, default_value_t = SynthSpec::default().train_tokens)]
    pub train_tokens: usize,
    /// Tokens in the validation split.
    #[arg(long, default_value_t = SynthSpec::default().val_tokens)]
    pub val_tokens: usize,
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

pub const DEF: u32 = 0;
pub const ASK: u32 = 1;

/// Dependency distance marking a position whose next token cannot be predicted from context
/// (the start of an event, a freshly drawn key or value).
pub const DEP_NONE: u32 = 0;

impl SynthSpec {
    pub fn validate(&self) -> Result<()> {
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

    fn first_value(&self) -> u32 {
        2 + self.n_keys as u32
    }
    fn first_filler(&self) -> u32 {
        self.first_value() + self.n_values as u32
    }

    /// Draws D from the truncated power law on [min_distance, max_distance] by inverting
    /// its continuous CDF and flooring.
    fn draw_distance(&self, rng: &mut Rng) -> usize {
        let (a, b, u) = (
            self.min_distance as f64,
            (self.max_distance + 1) as f64,
            rng.uniform(),
        );
        let x = if (self.alpha - 1.0).abs() < 1e-12 {
            a * (b / a).powf(u)
        } else {
            let e = 1.0 - self.alpha;
            (a.powf(e) + u * (b.powf(e) - a.powf(e))).powf(1.0 / e)
        };
        (x.floor() as usize).clamp(self.min_distance, self.max_distance)
    }
}

/// One generated stream: `deps[i]` is the dependency distance of the prediction made at
/// position i (of token i+1): 1 for filler (bigram), the distance back to the defining value
/// for the key of a query, `DEP_NONE` where the next token is unpredictable.
pub struct SynthStream {
    pub tokens: Vec<u32>,
    pub deps: Vec<u32>,
}

/// Generates `n` tokens. The filler bigram table depends only on `spec.seed`, so train and
/// val (different `stream_seed`) share one language.
pub fn synth_stream(spec: &SynthSpec, stream_seed: u64, n: usize) -> SynthStream {
    let mut table_rng = Rng::new(spec.seed);
    let n_filler = spec.vocab_size as u32 - spec.first_filler();
    let successors: Vec<Vec<u32>> = (0..spec.vocab_size)
        .map(|_| {
            (0..spec.branch)
                .map(|_| spec.first_filler() + table_rng.below(n_filler as u64) as u32)
                .collect()
        })
        .collect();
    let zipf: Vec<f64> = (0..spec.branch).map(|r| 1.0 / (r + 1) as f64).collect();

    let mut rng = Rng::new(stream_seed);
    let mut tokens: Vec<u32> = Vec::with_capacity(n);
    let mut deps: Vec<u32> = Vec::with_capacity(n);
    // Records the dependency of the prediction of `tok` (made at the previous position).
    let push = |tokens: &mut Vec<u32>, deps: &mut Vec<u32>, tok: u32, dep: u32| {
        if !tokens.is_empty() {
            deps.push(dep);
        }
        tokens.push(tok);
    };
    // (position of the ASK marker, key, value, position of the defining value)
    let mut pending: Vec<(usize, u32, u32, usize)> = Vec::new();
    let mut key_busy = vec![false; spec.n_keys];
    push(
        &mut tokens,
        &mut deps,
        spec.first_filler() + rng.below(n_filler as u64) as u32,
        DEP_NONE,
    );
    while tokens.len() < n {
        let pos = tokens.len();
        let due = pending
            .iter()
            .enumerate()
            .filter(|(_, p)| p.0 <= pos)
            .min_by_key(|(_, p)| p.0)
            .map(|(i, _)| i);
        if let Some(i) = due {
            if pos + 3 > n {
                break;
            }
            let (_, key, value, value_pos) = pending.swap_remove(i);
            push(&mut tokens, &mut deps, ASK, DEP_NONE);
            push(&mut tokens, &mut deps, 2 + key, DEP_NONE);
            let key_pos = tokens.len() - 1;
            push(&mut tokens, &mut deps, value, (key_pos - value_pos) as u32);
            key_busy[key as usize] = false;
            continue;
        }
        let free: Vec<u32> = (0..spec.n_keys as u32)
            .filter(|&k| !key_busy[k as usize])
            .collect();
        if !free.is_empty() && pos + 3 <= n && rng.uniform() < spec.event_rate {
            let key = free[rng.below(free.len() as u64) as usize];
            let value = spec.first_value() + rng.below(spec.n_values as u64) as u32;
            push(&mut tokens, &mut deps, DEF, DEP_NONE);
            push(&mut tokens, &mut deps, 2 + key, DEP_NONE);
            push(&mut tokens, &mut deps, value, DEP_NONE);
            let value_pos = tokens.len() - 1;
            // The query's key sits D after the value, so its ASK marker sits at D - 1.
            let d = spec.draw_distance(&mut rng);
            pending.push((value_pos + d - 1, key, value, value_pos));
            key_busy[key as usize] = true;
            continue;
        }
        let prev = *tokens.last().unwrap() as usize;
        let next = successors[prev][rng.weighted(&zipf)];
        push(&mut tokens, &mut deps, next, 1);
    }
    // Pad with filler if an event did not fit at the very end.
    while tokens.len() < n {
        let prev = *tokens.last().unwrap() as usize;
        push(
            &mut tokens,
            &mut deps,
            successors[prev][rng.weighted(&zipf)],
            1,
        );
    }
    deps.push(DEP_NONE);
    SynthStream { tokens, deps }
}

/// Writes the synthetic corpus (tokens and dependency shards) as a data set.
pub fn synth(spec: &SynthSpec, out: &Path) -> Result<Meta> {
    spec.validate()?;
    prepare_out_dir(out)?;
    let width = Width::for_vocab(spec.vocab_size);
    let mut names = Vec::new();
    for (split, n, salt) in [
        ("train", spec.train_tokens, 1u64),
        ("val", spec.val_tokens, 2u64),
    ] {
        let s = synth_stream(
            spec,
            spec.seed.wrapping_mul(0x9E37_79B9).wrapping_add(salt),
            n,
        );
        let name = format!("{split}_000.bin");
        write_shard(&out.join(&name), TOKENS_MAGIC, width, &s.tokens)?;
        write_shard(&out.join(deps_name(&name)), DEPS_MAGIC, Width::U32, &s.deps)?;
        names.push(name);
    }
    let meta = Meta {
        format: 1,
        tokenizer: "synth".into(),
        vocab_size: spec.vocab_size,
        eot_token: None,
        train: vec![names[0].clone()],
        val: vec![names[1].clone()],
        train_tokens: spec.train_tokens as u64,
        val_tokens: spec.val_tokens as u64,
        synth: Some(spec.clone()),
        probes: None,
        corpus: None,
    };
    write_meta(out, &meta)?;
    Ok(meta)
}

// ---------------------------------------------------------------------------------------
// Loading.

/// The shards of one split, with their dependency shards when the data set has them.
pub struct Split {
    shards: Vec<Shard>,
    deps: Option<Vec<Shard>>,
}

/// One batch: inputs and targets `[B, L]` (int64), and, for the synthetic corpus, the
/// dependency distance of each prediction `[B, L]` plus each row's offset into its stream.
pub struct Batch {
    pub x: Tensor,
    pub y: Tensor,
    pub deps: Option<Vec<u32>>,
}

impl Split {
    pub fn open(dir: &Path, meta: &Meta, split: &str) -> Result<Split> {
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
        let deps = if meta.synth.is_some() {
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
            }
            Some(d)
        } else {
            None
        };
        Ok(Split { shards, deps })
    }

    pub fn tokens(&self) -> usize {
        self.shards.iter().map(|s| s.len()).sum()
    }

    /// Tokens of the split's largest shard: a sequence never crosses shards, so the longest
    /// it can give (inputs and the next token) is this many.
    pub fn largest_shard(&self) -> usize {
        self.shards.iter().map(|s| s.len()).max().unwrap_or(0)
    }

    /// Every token of the split, shards in order.
    pub fn all_tokens(&self) -> Vec<u32> {
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
    pub fn sample(
        &self,
        rng: &mut Rng,
        batch: usize,
        seq_len: usize,
        device: tch::Device,
    ) -> Result<Batch> {
        let starts: Vec<u64> = self
            .shards
            .iter()
            .map(|s| s.len().saturating_sub(seq_len) as u64)
            .collect();
        let total: u64 = starts.iter().sum();
        ensure!(total > 0, "no shard holds more than seq_len = {seq_len} tokens; use shorter sequences or more data");
        let rows: Vec<(usize, usize)> = (0..batch)
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
            .collect();
        Ok(self.rows_to_batch(&rows, seq_len, device))
    }

    /// Consecutive non-overlapping windows in order, grouped into batches; at most
    /// `max_batches` batches (0 = all).
    pub fn sequential(
        &self,
        batch: usize,
        seq_len: usize,
        max_batches: usize,
        device: tch::Device,
    ) -> Vec<Batch> {
        let rows: Vec<(usize, usize)> = self
            .shards
            .iter()
            .enumerate()
            .flat_map(|(s, sh)| {
                (0..sh.len().saturating_sub(1) / seq_len).map(move |i| (s, i * seq_len))
            })
            .collect();
        let mut out: Vec<Batch> = rows
            .chunks(batch)
            .map(|c| self.rows_to_batch(c, seq_len, device))
            .collect();
        if max_batches > 0 {
            out.truncate(max_batches);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        crate::scratch_dir(&format!("data-{name}"))
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

    #[test]
    fn synth_is_deterministic_and_deps_point_at_the_answer() {
        let spec = SynthSpec {
            train_tokens: 20_000,
            val_tokens: 1000,
            ..Default::default()
        };
        let a = synth_stream(&spec, 5, 20_000);
        let b = synth_stream(&spec, 5, 20_000);
        assert_eq!(a.tokens, b.tokens);
        assert_eq!(a.deps, b.deps);
        assert_ne!(a.tokens, synth_stream(&spec, 6, 20_000).tokens);
        assert_eq!(a.tokens.len(), 20_000);
        assert_eq!(a.deps.len(), 20_000);
        let mut recalls = 0;
        for i in 0..a.tokens.len() - 1 {
            let d = a.deps[i] as usize;
            if d >= 2 {
                // Position i holds the queried key; i-d holds the defining value, preceded by
                // the same key and DEF; the token to predict is that value.
                recalls += 1;
                assert_eq!(a.tokens[i - 1], ASK);
                assert_eq!(a.tokens[i - d], a.tokens[i + 1]);
                assert_eq!(a.tokens[i - d - 1], a.tokens[i]);
                assert_eq!(a.tokens[i - d - 2], DEF);
                assert!(d >= spec.min_distance);
            }
        }
        assert!(recalls > 200, "only {recalls} recall events");
        // Long tail: fewer dependencies reach beyond larger windows.
        let beyond = |w: usize| a.deps.iter().filter(|&&d| d as usize >= w).count();
        assert!(beyond(4) > beyond(16) && beyond(16) > beyond(64) && beyond(64) > 0);
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
        let batches = val.sequential(4, 100, 0, tch::Device::Cpu);
        assert_eq!(batches.iter().map(|b| b.x.size()[0]).sum::<i64>(), 5);
        assert!(batches[0]
            .x
            .get(0)
            .narrow(0, 1, 99)
            .equal(&batches[0].y.get(0).narrow(0, 0, 99)));
        assert_eq!(batches[0].deps.as_ref().unwrap().len(), 4 * 100);
    }
}
