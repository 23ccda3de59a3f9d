//! Text corpora in: the documents of files and directories (plain text, JSON Lines, Parquet;
//! each optionally gzip-, zstd- or xz-compressed), tokenised in parallel into a data set.
//!
//! Order is deterministic: inputs in the order given, each directory's files sorted by path
//! (hidden entries skipped), a file's records in file order. A plain text file is one
//! document; a JSON Lines line or a Parquet row is one document (its `--text-field`). Every
//! document ends with the tokenizer's end-of-document token when it has one. The last
//! `val_fraction` of the token stream is the validation split (the last documents in that
//! order, the last one possibly cut), as nanoGPT's `data[int(n*0.9):]`.
//!
//! Memory stays bounded by batches of documents (tokenised at once, in order, with rayon)
//! and one file's text (a text file, a decompressed Parquet file); a corpus of any size
//! streams through. A file that is binary (holds a NUL byte) or not UTF-8 is skipped with
//! its reason, as is a JSON Lines record that is not JSON or has no text in the field.

use super::meta::{prepare_out_dir, CorpusRecord, Meta};
use super::shards::{write_shard_from, Shard, ShardWriter, Width, TOKENS_MAGIC};
use super::tokenizer::{finish_text_dataset, TextTokenizer};
use crate::util::flags::finite_flag;
use crate::util::progress::{Progress, DEFAULT_STATUS_EVERY};
use anyhow::{bail, ensure, Context, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What `data prepare` reads and how; also a grid's `[corpus]` section, prepared at
/// `base.data.dir` when no data set is there (unset fields at their defaults).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, clap::Args)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct PrepareSpec {
    /// Files and directories to read; directories recursively, in sorted order, hidden
    /// entries skipped. Formats by name: .jsonl/.ndjson/.json (JSON Lines), .parquet, anything
    /// else plain text; a further .gz, .zst or .xz is decompressed.
    #[arg(long, short, num_args = 1..)]
    pub(crate) input: Vec<PathBuf>,
    /// Also read the installed sources of this Python package (its directory, as
    /// $ATTNSWEEP_PYTHON or python3 finds it), e.g. `torch`; meta.json records its version.
    #[arg(long)]
    pub(crate) python_package: Option<String>,
    /// Read only the files of a directory whose path below it matches one of these patterns
    /// (`*` crosses directories: `*.py` finds every Python file); files named directly are
    /// always read.
    #[arg(long, value_delimiter = ',')]
    pub(crate) glob: Vec<String>,
    /// Field (JSON Lines) or column (Parquet) holding each record's text.
    #[arg(long, default_value_t = PrepareSpec::default().text_field)]
    pub(crate) text_field: String,
    /// Fraction of the token stream (its end) held out as the validation split.
    #[arg(long, value_parser = finite_flag, default_value_t = PrepareSpec::default().val_fraction)]
    pub(crate) val_fraction: f64,
    /// Tokens per shard file.
    #[arg(long, default_value_t = PrepareSpec::default().shard_tokens)]
    pub(crate) shard_tokens: usize,
    /// A Hugging Face tokenizer.json (e.g. from a converted model); byte-level when omitted.
    #[arg(long)]
    pub(crate) tokenizer: Option<PathBuf>,
}

impl Default for PrepareSpec {
    fn default() -> Self {
        PrepareSpec {
            input: Vec::new(),
            python_package: None,
            glob: Vec::new(),
            text_field: "text".into(),
            val_fraction: 0.05,
            shard_tokens: 100_000_000,
            tokenizer: None,
        }
    }
}

impl PrepareSpec {
    /// Settings checked before anything is read.
    pub(crate) fn validate(&self) -> Result<()> {
        ensure!(
            self.val_fraction > 0.0 && self.val_fraction < 1.0,
            "val fraction must be in (0, 1), got {}",
            self.val_fraction
        );
        ensure!(self.shard_tokens >= 1, "shard tokens must be at least 1");
        ensure!(!self.text_field.is_empty(), "the text field is empty");
        ensure!(
            !self.input.is_empty() || self.python_package.is_some(),
            "no input given: name files or directories (--input, `input`), or a Python package (--python-package, `python_package`)"
        );
        for g in &self.glob {
            glob::Pattern::new(g).with_context(|| format!("glob {g:?} is not a pattern"))?;
        }
        Ok(())
    }
}

/// A file's format, from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Text,
    JsonLines,
    Parquet,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Compression {
    None,
    Gzip,
    Zstd,
    Xz,
}

/// Format and compression of `path`: a last `.gz`/`.zst`/`.xz`, then the format's suffix.
fn kind_of(path: &Path) -> (Format, Compression) {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let (stem, compression) = [
        (".gz", Compression::Gzip),
        (".zst", Compression::Zstd),
        (".xz", Compression::Xz),
    ]
    .into_iter()
    .find_map(|(ext, c)| name.strip_suffix(ext).map(|s| (s.to_string(), c)))
    .unwrap_or((name.clone(), Compression::None));
    let format = if [".jsonl", ".ndjson", ".json"]
        .iter()
        .any(|e| stem.ends_with(e))
    {
        Format::JsonLines
    } else if stem.ends_with(".parquet") {
        Format::Parquet
    } else {
        Format::Text
    };
    (format, compression)
}

/// The directory of an installed Python package and its version, from `$ATTNSWEEP_PYTHON`
/// (else `python3`), without importing it.
fn python_package(name: &str) -> Result<(PathBuf, String)> {
    let py = std::env::var("ATTNSWEEP_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = "import importlib.util, importlib.metadata, sys\n\
                  s = importlib.util.find_spec(sys.argv[1])\n\
                  if s is None or not s.submodule_search_locations: sys.exit('not an installed package')\n\
                  try: v = importlib.metadata.version(sys.argv[1])\n\
                  except Exception: v = 'unknown'\n\
                  print(list(s.submodule_search_locations)[0]); print(v)";
    let out = std::process::Command::new(&py)
        .args(["-c", script, name])
        .output()
        .with_context(|| {
            format!("cannot run {py} to find package {name:?} (set ATTNSWEEP_PYTHON)")
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines();
    match (out.status.success(), lines.next(), lines.next()) {
        (true, Some(dir), Some(version)) => Ok((PathBuf::from(dir), version.to_string())),
        _ => bail!(
            "{py} finds no installed Python package {name:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
    }
}

/// The files to read: each input file as given; each input directory's files below it,
/// sorted by path, hidden entries skipped, those matching one of `globs` (all when none).
fn list_files(inputs: &[PathBuf], globs: &[String]) -> Result<Vec<PathBuf>> {
    let patterns: Vec<glob::Pattern> = globs
        .iter()
        .map(|g| glob::Pattern::new(g).with_context(|| format!("glob {g:?} is not a pattern")))
        .collect::<Result<_>>()?;
    let mut files = Vec::new();
    for input in inputs {
        let md = std::fs::metadata(input)
            .with_context(|| format!("cannot read input {}", input.display()))?;
        if !md.is_dir() {
            files.push(input.clone());
            continue;
        }
        let mut found = Vec::new();
        let walk = walkdir::WalkDir::new(input)
            .sort_by_file_name()
            .into_iter()
            .filter_entry(|e| e.depth() == 0 || !e.file_name().to_string_lossy().starts_with('.'));
        for entry in walk {
            let entry = entry
                .with_context(|| format!("cannot walk input directory {}", input.display()))?;
            // A link to a file counts as that file; links to directories are not followed.
            if !entry.path().is_file() {
                continue;
            }
            let below = entry.path().strip_prefix(input).unwrap_or(entry.path());
            if patterns.is_empty() || patterns.iter().any(|p| p.matches_path(below)) {
                found.push(entry.into_path());
            }
        }
        found.sort();
        files.extend(found);
    }
    Ok(files)
}

/// A reader that counts the bytes read through it (compressed bytes, for progress).
struct Counted<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// `path` decompressed as its name says; Err(reason) when it cannot be opened.
fn open(
    path: &Path,
    compression: Compression,
    count: &Arc<AtomicU64>,
) -> std::result::Result<Box<dyn Read>, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("cannot open ({e})"))?;
    let raw = BufReader::new(Counted {
        inner: file,
        count: count.clone(),
    });
    Ok(match compression {
        Compression::None => Box::new(raw),
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(raw)),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::with_buffer(raw)
                .map_err(|e| format!("cannot start zstd ({e})"))?,
        ),
        Compression::Xz => Box::new(liblzma::bufread::XzDecoder::new_multi_decoder(raw)),
    })
}

/// Why a text is not a document: a NUL byte (binary) or invalid UTF-8, with the offset.
fn as_text(bytes: Vec<u8>) -> std::result::Result<String, String> {
    if let Some(at) = bytes.iter().position(|&b| b == 0) {
        return Err(format!("binary (NUL byte at offset {at})"));
    }
    String::from_utf8(bytes).map_err(|e| {
        format!(
            "not UTF-8 (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })
}

/// Documents of one file, handed to `emit` in order; Ok(Err(reason)) when the file is
/// skipped. Records skipped inside a file are counted in `skipped` (with the first reasons
/// kept in `reasons`).
fn read_file(
    path: &Path,
    text_field: &str,
    count: &Arc<AtomicU64>,
    skipped: &mut Skipped,
    emit: &mut dyn FnMut(String) -> Result<()>,
) -> Result<std::result::Result<(), String>> {
    let (format, compression) = kind_of(path);
    let read_all = |r: &mut dyn Read| -> std::result::Result<Vec<u8>, String> {
        let mut bytes = Vec::new();
        r.read_to_end(&mut bytes)
            .map_err(|e| format!("cannot read or decompress: {e}"))?;
        Ok(bytes)
    };
    let mut reader = match open(path, compression, count) {
        Ok(r) => r,
        Err(reason) => return Ok(Err(reason)),
    };
    match format {
        Format::Text => match read_all(&mut reader).and_then(as_text) {
            Ok(text) => emit(text)?,
            Err(reason) => return Ok(Err(reason)),
        },
        Format::JsonLines => {
            let mut lines = BufReader::new(reader);
            let mut line = Vec::new();
            for number in 1.. {
                line.clear();
                match lines.read_until(b'\n', &mut line) {
                    Ok(0) => break,
                    Ok(_) => {}
                    // What came before stays; the rest of the file is one skipped record.
                    Err(e) if number > 1 => {
                        skipped.record(format!(
                            "{}:{number}: cannot read or decompress the rest ({e})",
                            path.display()
                        ));
                        break;
                    }
                    Err(e) => return Ok(Err(format!("cannot read or decompress: {e}"))),
                }
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                match record_text(&line, text_field) {
                    Ok(text) => emit(text)?,
                    Err(reason) => skipped.record(format!("{}:{number}: {reason}", path.display())),
                }
            }
        }
        Format::Parquet => {
            let bytes = match read_all(&mut reader) {
                Ok(b) => b,
                Err(reason) => return Ok(Err(reason)),
            };
            let mut stopped = |row, reason| {
                skipped.record(format!("{}: rows from {row}: {reason}", path.display()))
            };
            let read = parquet_documents(&bytes, text_field, PARQUET_ROWS, emit, &mut stopped)?;
            if let Ok(nulls) = read.as_ref().map(|&n| n).map_err(|_| ()) {
                if nulls > 0 {
                    skipped.record_many(
                        nulls,
                        format!(
                            "{}: {nulls} rows with a null {text_field:?}",
                            path.display()
                        ),
                    );
                }
            }
            return Ok(read.map(|_| ()));
        }
    }
    Ok(Ok(()))
}

/// The text of one JSON Lines record.
fn record_text(line: &[u8], field: &str) -> std::result::Result<String, String> {
    let value: serde_json::Value =
        serde_json::from_slice(line).map_err(|e| format!("not a JSON record ({e})"))?;
    match value.get(field) {
        Some(serde_json::Value::String(s)) if s.contains('\0') => {
            Err(format!("field {field:?} holds a NUL character"))
        }
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(format!("field {field:?} is not a string")),
        None => Err(match value.as_object() {
            Some(o) => {
                let keys: Vec<&String> = o.keys().take(8).collect();
                format!("no field {field:?} (its fields: {keys:?})")
            }
            None => format!("no field {field:?} (the record is not a JSON object)"),
        }),
    }
}

/// Rows of a Parquet file read at once: bounds memory on files of many row groups.
const PARQUET_ROWS: usize = 65_536;

/// The `field` column's strings of a Parquet file, handed to `emit` in row order, read
/// `rows_per_read` at a time; the rows whose field is null (no document) are counted and their
/// number returned. Ok(Err(reason)) when the file cannot be a source of text (not Parquet, no
/// such column, not strings). A later batch that cannot be read ends the file there, reported
/// through `stopped(first row, reason)`.
fn parquet_documents(
    bytes: &[u8],
    field: &str,
    rows_per_read: usize,
    emit: &mut dyn FnMut(String) -> Result<()>,
    stopped: &mut dyn FnMut(usize, String),
) -> Result<std::result::Result<u64, String>> {
    let mut nulls = 0u64;
    use polars::prelude::{ParquetReader, SerReader};
    let reader = || ParquetReader::new(std::io::Cursor::new(bytes));
    let rows = match reader().num_rows() {
        Ok(n) => n,
        Err(e) => return Ok(Err(format!("not a Parquet file ({e})"))),
    };
    for offset in (0..rows).step_by(rows_per_read) {
        let frame = match reader()
            .with_columns(Some(vec![field.to_string()]))
            .with_slice(Some((offset, rows_per_read)))
            .finish()
        {
            Ok(f) => f,
            Err(e) if offset > 0 => {
                stopped(offset, format!("cannot read ({e})"));
                break;
            }
            Err(e) => return Ok(Err(format!("cannot read column {field:?} ({e})"))),
        };
        let column = frame
            .column(field)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .as_materialized_series();
        let Ok(strings) = column.str() else {
            return Ok(Err(format!(
                "column {field:?} holds {} values, not strings",
                column.dtype()
            )));
        };
        // A null row is no document.
        for text in strings.into_iter() {
            match text {
                Some(text) => emit(text.to_string())?,
                None => nulls += 1,
            }
        }
    }
    Ok(Ok(nulls))
}

/// Why a corpus gave no document: files skipped, records skipped (each with its first reason),
/// or files without a record; and, where the text's field or column was not found, the flag
/// that names it.
fn nothing_read(
    files: usize,
    skipped_files: &[(PathBuf, String)],
    skipped: &Skipped,
    field: &str,
) -> String {
    let mut parts = Vec::new();
    if let Some((p, why)) = skipped_files.first() {
        parts.push(format!(
            "{} of the {files} files were skipped (e.g. {}: {why})",
            skipped_files.len(),
            p.display()
        ));
    }
    if let Some(why) = skipped.reasons.first() {
        parts.push(format!(
            "{} records were skipped (e.g. {why})",
            skipped.count
        ));
    }
    if parts.is_empty() {
        parts.push(format!("the {files} files hold no record"));
    }
    let reasons = skipped_files.iter().map(|f| &f.1).chain(&skipped.reasons);
    let field_missing = reasons
        .clone()
        .any(|r| r.contains("no field") || r.contains("column") || r.contains("null"));
    let hint = match field_missing {
        true => format!(
            "; --text-field names the field (JSON Lines) or column (Parquet) that holds the \
             text, now {field:?}"
        ),
        false => String::new(),
    };
    format!("no document was read: {}{hint}", parts.join("; "))
}

/// Records skipped inside files: how many, and the first reasons.
#[derive(Default)]
struct Skipped {
    count: u64,
    reasons: Vec<String>,
}

/// Reasons kept for the summary.
const REASONS_SHOWN: usize = 10;

impl Skipped {
    fn record(&mut self, reason: String) {
        self.record_many(1, reason)
    }

    /// `n` records skipped for one reason.
    fn record_many(&mut self, n: u64, reason: String) {
        self.count += n;
        if self.reasons.len() < REASONS_SHOWN {
            self.reasons.push(reason);
        }
    }
}

/// What a prepared corpus holds, and what was left out.
pub(crate) struct Summary {
    pub(crate) meta: Meta,
    pub(crate) record: CorpusRecord,
    pub(crate) skipped_files: Vec<(PathBuf, String)>,
    pub(crate) skipped_records: u64,
    pub(crate) record_reasons: Vec<String>,
    pub(crate) seconds: f64,
}

impl Summary {
    /// Lines for the user: counts, rate, and why files and records were skipped.
    pub(crate) fn report(&self, out: &Path) -> String {
        let c = &self.record;
        let mut s = format!(
            "prepared {} documents from {} files ({:.1} MB of text) into {} train and {} val tokens at {} in {:.1} s ({:.1} MB/s)\n",
            c.documents,
            c.files,
            c.text_bytes as f64 / 1e6,
            self.meta.train_tokens,
            self.meta.val_tokens,
            out.display(),
            self.seconds,
            c.text_bytes as f64 / 1e6 / self.seconds.max(1e-9)
        );
        if !self.skipped_files.is_empty() {
            s += &format!("skipped {} files:\n", self.skipped_files.len());
            for (p, why) in self.skipped_files.iter().take(REASONS_SHOWN) {
                s += &format!("  {}: {why}\n", p.display());
            }
            if self.skipped_files.len() > REASONS_SHOWN {
                s += &format!(
                    "  ... and {} more\n",
                    self.skipped_files.len() - REASONS_SHOWN
                );
            }
        }
        if self.skipped_records > 0 {
            s += &format!("skipped {} records:\n", self.skipped_records);
            for why in &self.record_reasons {
                s += &format!("  {why}\n");
            }
            if self.skipped_records > self.record_reasons.len() as u64 {
                s += &format!(
                    "  ... and {} more\n",
                    self.skipped_records - self.record_reasons.len() as u64
                );
            }
        }
        s += &format!("tokens sha256 {}", c.tokens_sha256);
        s
    }
}

/// Text bytes tokenised at once (in parallel, across documents).
const BATCH_BYTES: usize = 16 << 20;

/// Tokenises `spec`'s corpus into a data set at `out` (see the module's description).
pub(crate) fn prepare(spec: &PrepareSpec, out: &Path, quiet: bool) -> Result<Summary> {
    spec.validate()?;
    let tok = match &spec.tokenizer {
        Some(p) => TextTokenizer::hf(p)?,
        None => TextTokenizer::Bytes,
    };
    let mut inputs = spec.input.clone();
    let package = match &spec.python_package {
        Some(name) => {
            let (dir, version) = python_package(name)?;
            inputs.push(dir);
            Some(format!("{name} {version}"))
        }
        None => None,
    };
    let files = list_files(&inputs, &spec.glob)?;
    ensure!(
        !files.is_empty(),
        "the inputs hold no file{}",
        if spec.glob.is_empty() {
            String::new()
        } else {
            format!(" matching {}", spec.glob.join(", "))
        }
    );
    prepare_out_dir(out)?;

    let start = Instant::now();
    let total_bytes: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
        .sum();
    let mut progress = Progress::new(
        total_bytes.div_ceil(1 << 20),
        "MiB read",
        quiet,
        Duration::from_secs(DEFAULT_STATUS_EVERY),
    );
    let read_bytes = Arc::new(AtomicU64::new(0));
    let mut stream = TokenStream::new(out, &tok, spec.shard_tokens);
    let mut batch: Vec<String> = Vec::new();
    let mut batch_bytes = 0usize;
    let (mut skipped_files, mut skipped) = (Vec::new(), Skipped::default());
    let mut files_read = 0u64;
    for file in &files {
        let mut emit = |text: String| -> Result<()> {
            batch_bytes += text.len();
            batch.push(text);
            if batch_bytes >= BATCH_BYTES {
                stream.push_batch(std::mem::take(&mut batch))?;
                batch_bytes = 0;
                let done = read_bytes.load(Ordering::Relaxed);
                progress.update(done >> 20, &stream.rate(start));
            }
            Ok(())
        };
        match read_file(file, &spec.text_field, &read_bytes, &mut skipped, &mut emit)? {
            Ok(()) => files_read += 1,
            Err(reason) => skipped_files.push((file.clone(), reason)),
        }
    }
    stream.push_batch(batch)?;
    progress.update(total_bytes.div_ceil(1 << 20), &stream.rate(start));
    progress.finish();
    ensure!(
        stream.documents > 0,
        "{}",
        nothing_read(files.len(), &skipped_files, &skipped, &spec.text_field)
    );
    let record = CorpusRecord {
        python_package: package,
        glob: spec.glob.clone(),
        text_field: spec.text_field.clone(),
        files: files_read,
        documents: stream.documents,
        text_bytes: stream.text_bytes,
        skipped_files: skipped_files.len() as u64,
        skipped_records: skipped.count,
        tokens_sha256: String::new(),
    };
    let (meta, record) = stream.finish(spec.val_fraction, record)?;
    Ok(Summary {
        meta,
        record,
        skipped_files,
        skipped_records: skipped.count,
        record_reasons: skipped.reasons,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The token stream of a corpus, written as it comes into `train` shards and split at the
/// end.
struct TokenStream<'a> {
    out: PathBuf,
    tok: &'a TextTokenizer,
    writer: ShardWriter,
    shard_tokens: usize,
    width: Width,
    hash: Sha256,
    tokens: u64,
    documents: u64,
    text_bytes: u64,
}

impl<'a> TokenStream<'a> {
    fn new(out: &Path, tok: &'a TextTokenizer, shard_tokens: usize) -> TokenStream<'a> {
        let width = Width::for_vocab(tok.vocab_size());
        TokenStream {
            out: out.to_path_buf(),
            tok,
            writer: ShardWriter::new(out, "train", TOKENS_MAGIC, width, shard_tokens),
            shard_tokens,
            width,
            hash: Sha256::new(),
            tokens: 0,
            documents: 0,
            text_bytes: 0,
        }
    }

    /// Tokenises `docs` in parallel and appends them in order, each followed by the end of
    /// document token when the tokenizer has one.
    fn push_batch(&mut self, docs: Vec<String>) -> Result<()> {
        let tok = self.tok;
        let encoded: Vec<Vec<u32>> = docs
            .par_iter()
            .map(|d| tok.encode(d))
            .collect::<Result<_>>()?;
        let eot = tok.eot();
        let mut bytes = Vec::new();
        for (doc, ids) in docs.iter().zip(encoded) {
            self.documents += 1;
            self.text_bytes += doc.len() as u64;
            bytes.clear();
            for t in ids.into_iter().chain(eot) {
                bytes.extend(t.to_le_bytes());
                self.writer.push(t)?;
                self.tokens += 1;
            }
            self.hash.update(&bytes);
        }
        Ok(())
    }

    /// `MB/s, tokens/s` so far.
    fn rate(&self, start: Instant) -> String {
        let s = start.elapsed().as_secs_f64().max(1e-9);
        format!(
            "{:.1} MB/s of text, {:.2}M tokens/s, {} documents",
            self.text_bytes as f64 / 1e6 / s,
            self.tokens as f64 / 1e6 / s,
            self.documents
        )
    }

    /// Moves the last `val_fraction` of the tokens to the `val` shards and writes `meta.json`.
    fn finish(self, val_fraction: f64, mut record: CorpusRecord) -> Result<(Meta, CorpusRecord)> {
        let total = self.tokens;
        let n_val = ((total as f64 * val_fraction).ceil() as u64).max(1);
        ensure!(
            total > n_val,
            "the corpus holds only {total} tokens: too few to split into train and val"
        );
        let (names, _) = self.writer.finish()?;
        let n_train = total - n_val;
        // The train shards cover tokens [k * shard_tokens, ...): the one holding the split
        // keeps its head; its tail and every later shard become val.
        let keep = (n_train as usize).div_ceil(self.shard_tokens);
        let mut val = ShardWriter::new(
            &self.out,
            "val",
            TOKENS_MAGIC,
            self.width,
            self.shard_tokens,
        );
        for (k, name) in names.iter().enumerate().skip(keep - 1) {
            let path = self.out.join(name);
            let shard = Shard::open(&path, TOKENS_MAGIC)?;
            let from = (n_train as usize)
                .saturating_sub(k * self.shard_tokens)
                .min(shard.len());
            for i in from..shard.len() {
                val.push(shard.get(i))?;
            }
            if from == 0 {
                drop(shard);
                std::fs::remove_file(&path)
                    .with_context(|| format!("cannot remove {}", path.display()))?;
            } else if from < shard.len() {
                // The shard holding the split keeps its head (rewritten whole: shards are
                // never modified in place).
                let head = (0..from).map(|i| shard.get(i));
                write_shard_from(&path, TOKENS_MAGIC, self.width, from, head)?;
            }
        }
        let train_names: Vec<String> = names.into_iter().take(keep).collect();
        let (val_names, val_tokens) = val.finish()?;
        record.tokens_sha256 = format!("{:x}", self.hash.finalize());
        let meta = finish_text_dataset(
            &self.out,
            self.tok,
            (train_names, n_train),
            (val_names, val_tokens),
            None,
            Some(record.clone()),
        )?;
        Ok((meta, record))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data;

    use std::io::Write;

    fn tmp(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("attnsweep-corpus-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn write(path: &Path, bytes: &[u8]) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }

    /// A Parquet file of one string column `text` (None: null), two rows per row group.
    fn parquet(rows: &[Option<&str>]) -> Vec<u8> {
        use polars::prelude::*;
        let mut df = DataFrame::new_infer_height(vec![Column::new("text".into(), rows)]).unwrap();
        let mut bytes = Vec::new();
        ParquetWriter::new(&mut bytes)
            .with_row_group_size(Some(2))
            .finish(&mut df)
            .unwrap();
        bytes
    }

    /// A directory of every format and compression, two unreadable files and a hidden one;
    /// returns the documents it holds, in the order they are read.
    fn mixed_corpus(dir: &Path) -> Vec<&'static str> {
        write(&dir.join("a.txt"), b"alpha\n");
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(b"{\"text\": \"bravo\"}\n\n{\"text\": 5}\n{\"body\": \"x\"}\nnot json\n")
            .unwrap();
        write(&dir.join("b.jsonl.gz"), &gz.finish().unwrap());
        write(
            &dir.join("c.parquet"),
            &parquet(&[Some("charlie"), None, Some("delta")]),
        );
        let mut xz = liblzma::write::XzEncoder::new(Vec::new(), 6);
        xz.write_all("echo \u{e9}".as_bytes()).unwrap();
        write(&dir.join("d/e.txt.xz"), &xz.finish().unwrap());
        let zst = zstd::encode_all(&b"{\"text\": \"foxtrot\", \"id\": 1}\n"[..], 3).unwrap();
        write(&dir.join("d/f.jsonl.zst"), &zst);
        write(&dir.join("g.bin"), b"\x7fELF\x00\x01");
        write(&dir.join("h.txt"), b"ok \xff\xfe");
        write(&dir.join(".hidden/i.txt"), b"hidden");
        vec![
            "alpha\n",
            "bravo",
            "charlie",
            "delta",
            "echo \u{e9}",
            "foxtrot",
        ]
    }

    fn tokens(out: &Path, meta: &Meta) -> Vec<u32> {
        ["train", "val"]
            .iter()
            .flat_map(|split| data::Split::open(out, meta, split).unwrap().all_tokens())
            .collect()
    }

    #[test]
    fn every_format_is_read_in_order_and_unreadable_files_are_skipped_with_a_reason() {
        let d = tmp("mixed");
        let docs = mixed_corpus(&d.join("in"));
        let spec = PrepareSpec {
            input: vec![d.join("in")],
            val_fraction: 0.3,
            shard_tokens: 7,
            ..Default::default()
        };
        let out = d.join("ds");
        let s = prepare(&spec, &out, true).unwrap();
        let want: Vec<u32> = docs
            .iter()
            .flat_map(|doc| doc.bytes().map(u32::from).chain([data::BYTE_EOT]))
            .collect();
        assert_eq!(tokens(&out, &s.meta), want);
        let total = want.len() as u64;
        assert_eq!(s.meta.val_tokens, (total as f64 * 0.3).ceil() as u64);
        assert_eq!(s.meta.train_tokens + s.meta.val_tokens, total);
        // Every shard but each split's last is full.
        for names in [&s.meta.train, &s.meta.val] {
            let lens: Vec<usize> = names
                .iter()
                .map(|n| data::Shard::open(&out.join(n), TOKENS_MAGIC).unwrap().len())
                .collect();
            assert!(lens[..lens.len() - 1].iter().all(|&l| l == 7), "{lens:?}");
        }
        assert_eq!((s.record.files, s.record.documents), (5, 6));
        let skipped: Vec<(String, &str)> = s
            .skipped_files
            .iter()
            .map(|(p, why)| {
                (
                    p.file_name().unwrap().to_string_lossy().into(),
                    why.as_str(),
                )
            })
            .collect();
        assert_eq!(
            skipped,
            [
                ("g.bin".to_string(), "binary (NUL byte at offset 4)"),
                ("h.txt".to_string(), "not UTF-8 (invalid byte at offset 3)"),
            ]
        );
        // Three records of b.jsonl.gz, and c.parquet's null row.
        assert_eq!(s.record.skipped_records, 4);
        assert!(s.record_reasons[0].ends_with("b.jsonl.gz:3: field \"text\" is not a string"));
        assert!(
            s.record_reasons[2]
                .ends_with("b.jsonl.gz:5: not a JSON record (expected ident at line 1 column 2)"),
            "{:?}",
            s.record_reasons
        );
        let report = s.report(&out);
        assert!(
            report.contains("skipped 2 files") && report.contains("skipped 4 records"),
            "{report}"
        );
        assert!(
            s.record_reasons
                .iter()
                .any(|r| r.ends_with("c.parquet: 1 rows with a null \"text\"")),
            "{:?}",
            s.record_reasons
        );
        // The record in meta.json is the one reported, and reads back.
        assert_eq!(
            data::read_meta(&out).unwrap().corpus,
            Some(s.record.clone())
        );

        // The same corpus prepared again has the same hash; a changed one does not.
        let again = prepare(&spec, &d.join("ds2"), true).unwrap();
        assert_eq!(again.record.tokens_sha256, s.record.tokens_sha256);
        write(&d.join("in/a.txt"), b"alpha!\n");
        let changed = prepare(&spec, &d.join("ds3"), true).unwrap();
        assert_ne!(changed.record.tokens_sha256, s.record.tokens_sha256);

        // A data set is never written over.
        let before = std::fs::read(out.join("meta.json")).unwrap();
        let err = format!("{:#}", prepare(&spec, &out, true).err().unwrap());
        assert!(err.contains("already holds"), "{err}");
        assert_eq!(std::fs::read(out.join("meta.json")).unwrap(), before);
    }

    #[test]
    fn globs_filter_directories_but_not_files_named_directly() {
        let d = tmp("glob");
        mixed_corpus(&d.join("in"));
        let spec = PrepareSpec {
            input: vec![d.join("in"), d.join("in/d/f.jsonl.zst")],
            glob: vec!["*.txt*".into()],
            ..Default::default()
        };
        let s = prepare(&spec, &d.join("ds"), true).unwrap();
        // a.txt, d/e.txt.xz, h.txt (skipped), then the file named directly.
        assert_eq!((s.record.documents, s.skipped_files.len()), (3, 1));
        let bad = PrepareSpec {
            glob: vec!["[".into()],
            ..spec.clone()
        };
        assert!(
            format!("{:#}", prepare(&bad, &d.join("x"), true).err().unwrap())
                .contains("is not a pattern")
        );
        let none = PrepareSpec {
            glob: vec!["*.rs".into()],
            input: vec![d.join("in")],
            ..spec
        };
        let err = format!("{:#}", prepare(&none, &d.join("y"), true).err().unwrap());
        assert!(err.contains("hold no file matching *.rs"), "{err}");
        assert!(
            !d.join("y").exists(),
            "nothing written for a failed listing"
        );
    }

    #[test]
    fn parquet_is_read_in_slices_and_refused_with_a_reason() {
        let bytes = parquet(&[Some("a"), Some("b"), None, Some("c"), Some("d")]);
        let mut got = Vec::new();
        let r = parquet_documents(&bytes, "text", 2, &mut |t| Ok(got.push(t)), &mut |_, _| {
            panic!("no slice fails")
        });
        // The null row is counted, not read.
        assert_eq!(r.unwrap(), Ok(1));
        assert_eq!(got, ["a", "b", "c", "d"]);
        let no_column = parquet_documents(&bytes, "body", 2, &mut |_| Ok(()), &mut |_, _| {});
        assert!(no_column
            .unwrap()
            .unwrap_err()
            .contains("cannot read column \"body\""));
        let not_parquet = parquet_documents(b"text", "text", 2, &mut |_| Ok(()), &mut |_, _| {});
        assert!(not_parquet
            .unwrap()
            .unwrap_err()
            .starts_with("not a Parquet file"));
    }

    #[test]
    fn formats_and_compression_follow_the_name() {
        let k = |n: &str| kind_of(Path::new(n));
        assert_eq!(k("a/b.txt"), (Format::Text, Compression::None));
        assert_eq!(k("x.py.gz"), (Format::Text, Compression::Gzip));
        assert_eq!(k("d.JSONL.zst"), (Format::JsonLines, Compression::Zstd));
        assert_eq!(k("d.ndjson"), (Format::JsonLines, Compression::None));
        assert_eq!(k("d.parquet.xz"), (Format::Parquet, Compression::Xz));
        assert_eq!(k("README"), (Format::Text, Compression::None));
    }

    #[test]
    fn binary_and_invalid_text_say_where() {
        assert_eq!(as_text(b"ok".to_vec()), Ok("ok".into()));
        assert_eq!(
            as_text(b"ab\0c".to_vec()),
            Err("binary (NUL byte at offset 2)".into())
        );
        assert_eq!(
            as_text(b"abc\xff".to_vec()),
            Err("not UTF-8 (invalid byte at offset 3)".into())
        );
    }

    #[test]
    fn records_need_a_string_field() {
        assert_eq!(record_text(br#"{"text": "hi"}"#, "text"), Ok("hi".into()));
        assert!(record_text(br#"{"text": 3}"#, "text")
            .unwrap_err()
            .contains("not a string"));
        assert!(record_text(br#"{"body": "x"}"#, "text")
            .unwrap_err()
            .contains("no field"));
        assert!(record_text(b"{oops", "text")
            .unwrap_err()
            .contains("not a JSON record"));
    }
}
