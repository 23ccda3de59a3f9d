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
//! A sources file (`--sources`, TOML) names pinned archives (`[[package]]`: file, url,
//! sha256, checked before anything is read, and unpacked whole: the marker
//! `.<file>.unpacked` that `corpora/fetch.py` writes once unpacking ends must be there) and
//! the corpus's parts (`[[source]]`: name, input, glob). Inputs are paths below the root, and
//! every file they name, links followed, must lie inside it; each file belongs to one part
//! only. Each part is held out on its own: its last `val_fraction` becomes its own
//! validation shards (`val-<name>_000.bin`), so evaluation reports a loss per part and no
//! part's validation text is ever trained on. A part that yields no document is refused,
//! naming its files' reasons.
//!
//! Memory stays bounded by batches of documents (tokenised at once, in order, with rayon)
//! and the limits of `formats::LIMITS`: a plain text document is read and tokenised 16 MiB
//! at a time (cut where byte-level BPE pre-tokenizers split anyway), a JSON Lines record of
//! more than 256 MiB is skipped with its line, a compressed Parquet file is decompressed into
//! memory up to 256 MiB (an uncompressed one is mapped); a corpus of any size streams
//! through. A file that is binary (holds a NUL byte) or not UTF-8 is skipped with its reason,
//! as is a JSON Lines record that is not JSON or has no text in the field.

use super::formats::{read_file, Skipped, LIMITS, REASONS_SHOWN};
use super::meta::{prepare_out_dir, CorpusRecord, Meta, Package, SourceRecord};
use super::shards::{Shard, ShardWriter, Width, TOKENS_MAGIC};
use super::tokenizer::{finish_text_dataset, TextTokenizer};
use crate::util::flags::finite_flag;
use crate::util::progress::{Progress, DEFAULT_STATUS_EVERY};
use anyhow::{bail, ensure, Context, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
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
    /// A sources file (TOML): pinned archives and the corpus's parts, each with its own
    /// held-out split (see corpora/ for one); replaces --input, --python-package and --glob.
    #[arg(long)]
    pub(crate) sources: Option<PathBuf>,
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
            sources: None,
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
        match &self.sources {
            Some(file) => ensure!(
                self.input.is_empty() && self.python_package.is_none() && self.glob.is_empty(),
                "the sources file {} names the inputs and their globs: drop --input, \
                 --python-package and --glob (`input`, `python_package`, `glob`)",
                file.display()
            ),
            None => ensure!(
                !self.input.is_empty() || self.python_package.is_some(),
                "no input given: name files or directories (--input, `input`), a Python \
                 package (--python-package, `python_package`) or a sources file (--sources, \
                 `sources`)"
            ),
        }
        for g in &self.glob {
            glob::Pattern::new(g).with_context(|| format!("glob {g:?} is not a pattern"))?;
        }
        Ok(())
    }
}

/// A sources file: where its archives are unpacked, the archives, and the corpus's parts.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SourcesFile {
    /// Directory holding the archives and, unpacked, the sources' inputs; relative to the
    /// sources file.
    root: PathBuf,
    #[serde(default)]
    package: Vec<Package>,
    source: Vec<SourceSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SourceSpec {
    name: String,
    /// Files and directories below `root`.
    input: Vec<PathBuf>,
    #[serde(default)]
    glob: Vec<String>,
}

/// One part of a corpus, held out on its own. `name` is None for a corpus given by flags,
/// which is one part whose validation shards keep the plain `val_` names.
struct Part {
    name: Option<String>,
    inputs: Vec<PathBuf>,
    glob: Vec<String>,
}

/// The marker `corpora/fetch.py` leaves beside an archive once it is unpacked whole.
fn unpacked_marker(root: &Path, archive: &str) -> PathBuf {
    root.join(format!(".{archive}.unpacked"))
}

/// The parts and packages of the sources file `path` and its root, each archive checked
/// against its SHA-256 (a missing or changed archive is refused: the corpus would not be the
/// pinned one) and unpacked whole, each input a path below the root.
fn read_sources(path: &Path) -> Result<(Vec<Part>, Vec<Package>, PathBuf)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the sources file {}", path.display()))?;
    let file: SourcesFile =
        toml::from_str(&text).with_context(|| format!("sources file {}", path.display()))?;
    let root = path.parent().unwrap_or(Path::new(".")).join(&file.root);
    ensure!(
        !file.source.is_empty(),
        "sources file {} names no [[source]]",
        path.display()
    );
    for p in &file.package {
        let archive = root.join(&p.file);
        let mut f = std::fs::File::open(&archive).with_context(|| {
            format!(
                "package {} of {} is not at {} (fetch it from {}; `make corpus` does)",
                p.file,
                path.display(),
                archive.display(),
                p.url
            )
        })?;
        let mut hash = Sha256::new();
        std::io::copy(&mut f, &mut hash)
            .with_context(|| format!("cannot read {}", archive.display()))?;
        let got = format!("{:x}", hash.finalize());
        ensure!(
            got == p.sha256.to_ascii_lowercase(),
            "{} has sha256 {got}, not the pinned {}: it is not the archive this corpus is \
             made of; remove it and fetch it again from {}",
            archive.display(),
            p.sha256,
            p.url
        );
        ensure!(
            unpacked_marker(&root, &p.file).is_file(),
            "package {} of {} is not unpacked whole under {}: its marker {} (written once the \
             archive is unpacked) is missing, so unpacking was interrupted or never done; \
             unpack it again (`make corpus` does)",
            p.file,
            path.display(),
            root.display(),
            unpacked_marker(&root, &p.file).display()
        );
    }
    let mut seen = std::collections::BTreeSet::new();
    let parts = file
        .source
        .into_iter()
        .map(|s| {
            ensure!(
                !s.name.is_empty()
                    && s.name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
                "source name {:?} in {}: use letters, digits, - and _ (it names files)",
                s.name,
                path.display()
            );
            ensure!(
                seen.insert(s.name.clone()),
                "source {:?} is named twice in {}",
                s.name,
                path.display()
            );
            ensure!(
                !s.input.is_empty(),
                "source {:?} in {} has no input",
                s.name,
                path.display()
            );
            for i in &s.input {
                let below = i.components().all(|c| {
                    matches!(
                        c,
                        std::path::Component::Normal(_) | std::path::Component::CurDir
                    )
                });
                ensure!(
                    below,
                    "input {} of source {:?} in {} is not a path below the root {}: a source \
                     reads only what lies there, beside its pinned archives",
                    i.display(),
                    s.name,
                    path.display(),
                    root.display()
                );
            }
            Ok(Part {
                name: Some(s.name),
                inputs: s.input.iter().map(|i| root.join(i)).collect(),
                glob: s.glob,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((parts, file.package, root))
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

/// What `part` is called in messages.
fn part_name(part: &Part) -> String {
    match &part.name {
        Some(n) => format!("source {n:?}"),
        None => "the corpus".into(),
    }
}

/// The files of each part (`list_files`), each read by exactly one part and, for a sources
/// file, lying inside its `root` once links are followed: a file two parts read would put one
/// part's held-out text into the other's training text, and one outside the root is not what
/// the pinned archives hold.
fn list_parts(parts: &[Part], root: Option<&Path>) -> Result<Vec<Vec<PathBuf>>> {
    let canonical = |p: &Path| {
        std::fs::canonicalize(p).with_context(|| format!("cannot resolve {}", p.display()))
    };
    let root = root.map(canonical).transpose()?;
    let mut owner: std::collections::HashMap<PathBuf, String> = Default::default();
    let mut all = Vec::new();
    for part in parts {
        let files = list_files(&part.inputs, &part.glob)?;
        ensure!(
            !files.is_empty(),
            "{} hold no file{}",
            match &part.name {
                Some(n) => format!("the inputs of source {n:?}"),
                None => "the inputs".into(),
            },
            if part.glob.is_empty() {
                String::new()
            } else {
                format!(" matching {}", part.glob.join(", "))
            }
        );
        let mut kept = Vec::with_capacity(files.len());
        for f in files {
            let real = canonical(&f)?;
            if let Some(root) = &root {
                ensure!(
                    real.starts_with(root),
                    "{} of {} is {} once links are followed, outside the root {}: a source \
                     reads only what lies below its root",
                    f.display(),
                    part_name(part),
                    real.display(),
                    root.display()
                );
            }
            match owner.get(&real) {
                // An input directory and a file inside it, both named: read once.
                Some(o) if *o == part_name(part) => continue,
                Some(o) => bail!(
                    "{} is read by both {o} and {}: each file may belong to one source only, \
                     or one's held-out text would be trained on as the other's",
                    f.display(),
                    part_name(part)
                ),
                None => {
                    owner.insert(real, part_name(part));
                    kept.push(f);
                }
            }
        }
        all.push(kept);
    }
    Ok(all)
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
    let (parts, packages, package, root) = match &spec.sources {
        Some(file) => {
            let (parts, packages, root) = read_sources(file)?;
            (parts, packages, None, Some(root))
        }
        None => {
            let mut inputs = spec.input.clone();
            let package = match &spec.python_package {
                Some(name) => {
                    let (dir, version) = python_package(name)?;
                    inputs.push(dir);
                    Some(format!("{name} {version}"))
                }
                None => None,
            };
            let part = Part {
                name: None,
                inputs,
                glob: spec.glob.clone(),
            };
            (vec![part], Vec::new(), package, None)
        }
    };
    let part_files = list_parts(&parts, root.as_deref())?;
    let files: Vec<&PathBuf> = part_files.iter().flatten().collect();
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
    let mut batch: Vec<(String, bool)> = Vec::new();
    let mut batch_bytes = 0usize;
    let (mut skipped_files, mut skipped) = (Vec::new(), Skipped::default());
    let mut files_skipped_before = 0;
    let mut files_read = 0u64;
    let mut ends = Vec::new();
    for (part, part_files) in parts.iter().zip(&part_files) {
        let before = (files_read, stream.documents, stream.text_bytes);
        let mut part_skipped = Skipped::default();
        for file in part_files {
            let mut emit = |text: String, ends: bool| -> Result<()> {
                batch_bytes += text.len();
                batch.push((text, ends));
                if batch_bytes >= BATCH_BYTES {
                    stream.push_batch(std::mem::take(&mut batch))?;
                    batch_bytes = 0;
                    let done = read_bytes.load(Ordering::Relaxed);
                    progress.update(done >> 20, &stream.rate(start));
                }
                Ok(())
            };
            let read = read_file(
                file,
                &spec.text_field,
                LIMITS,
                &read_bytes,
                &mut part_skipped,
                &mut emit,
            )?;
            match read {
                Ok(()) => files_read += 1,
                Err(reason) => skipped_files.push((file.clone(), reason)),
            }
        }
        // A part ends on a document boundary: its held-out share is its own last documents.
        stream.push_batch(std::mem::take(&mut batch))?;
        batch_bytes = 0;
        ensure!(
            stream.documents > before.1,
            "{}: {}",
            part_name(part),
            nothing_read(
                part_files.len(),
                &skipped_files[files_skipped_before..],
                &part_skipped,
                &spec.text_field
            )
        );
        files_skipped_before = skipped_files.len();
        skipped.absorb(part_skipped);
        ends.push(PartEnd {
            record: part.name.as_ref().map(|name| SourceRecord {
                name: name.clone(),
                input: part
                    .inputs
                    .iter()
                    .map(|i| i.display().to_string())
                    .collect(),
                glob: part.glob.clone(),
                files: files_read - before.0,
                documents: stream.documents - before.1,
                text_bytes: stream.text_bytes - before.2,
                train_tokens: 0,
                val_tokens: 0,
                val: Vec::new(),
            }),
            token: stream.tokens,
        });
    }
    progress.update(total_bytes.div_ceil(1 << 20), &stream.rate(start));
    progress.finish();
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
        packages,
        sources: Vec::new(),
    };
    let (meta, record) = stream.finish(spec.val_fraction, record, ends)?;
    Ok(Summary {
        meta,
        record,
        skipped_files,
        skipped_records: skipped.count,
        record_reasons: skipped.reasons,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Where a part of the corpus ends in the token stream, with its record (None for the one
/// part of a corpus given by flags).
struct PartEnd {
    record: Option<SourceRecord>,
    token: u64,
}

/// Shards of the whole token stream as it is read, before it is split.
const STREAM_PREFIX: &str = "stream";

/// The token stream of a corpus, written as it comes into `stream` shards and split at the
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
            writer: ShardWriter::new(out, STREAM_PREFIX, TOKENS_MAGIC, width, shard_tokens),
            shard_tokens,
            width,
            hash: Sha256::new(),
            tokens: 0,
            documents: 0,
            text_bytes: 0,
        }
    }

    /// Tokenises `docs` (parts of documents, each with whether its document ends there) in
    /// parallel and appends them in order, each document followed by the end of document
    /// token when the tokenizer has one.
    fn push_batch(&mut self, docs: Vec<(String, bool)>) -> Result<()> {
        let tok = self.tok;
        let encoded: Vec<Vec<u32>> = docs
            .par_iter()
            .map(|(d, _)| tok.encode(d))
            .collect::<Result<_>>()?;
        let eot = tok.eot();
        let mut bytes = Vec::new();
        for ((doc, ends), ids) in docs.iter().zip(encoded) {
            self.documents += *ends as u64;
            self.text_bytes += doc.len() as u64;
            bytes.clear();
            let eot = eot.filter(|_| *ends);
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

    /// Splits each part: its last `val_fraction` of tokens (at least one) into its `val`
    /// shards, the rest, parts in order, into the `train` shards; then removes the stream's
    /// shards and writes `meta.json`.
    fn finish(
        self,
        val_fraction: f64,
        mut record: CorpusRecord,
        ends: Vec<PartEnd>,
    ) -> Result<(Meta, CorpusRecord)> {
        let (names, _) = self.writer.finish()?;
        let stream = names
            .iter()
            .map(|n| Shard::open(&self.out.join(n), TOKENS_MAGIC))
            .collect::<Result<Vec<_>>>()?;
        let k = self.shard_tokens as u64;
        let at = |i: u64| stream[(i / k) as usize].get((i % k) as usize);
        let new_writer = |prefix: &str| {
            ShardWriter::new(
                &self.out,
                prefix,
                TOKENS_MAGIC,
                self.width,
                self.shard_tokens,
            )
        };
        let mut train = new_writer("train");
        let (mut val_names, mut val_tokens, mut start) = (Vec::new(), 0u64, 0u64);
        for end in ends {
            let n = end.token - start;
            let n_val = ((n as f64 * val_fraction).ceil() as u64).max(1);
            let what = match &end.record {
                Some(r) => format!("source {:?}", r.name),
                None => "the corpus".into(),
            };
            ensure!(
                n > n_val,
                "{what} holds only {n} tokens: too few to split into train and val"
            );
            let cut = end.token - n_val;
            for i in start..cut {
                train.push(at(i))?;
            }
            let mut val = new_writer(&match &end.record {
                Some(r) => format!("val-{}", r.name),
                None => "val".into(),
            });
            for i in cut..end.token {
                val.push(at(i))?;
            }
            let (names, tokens) = val.finish()?;
            if let Some(mut r) = end.record {
                (r.train_tokens, r.val_tokens, r.val) = (n - n_val, n_val, names.clone());
                record.sources.push(r);
            }
            val_names.extend(names);
            val_tokens += tokens;
            start = end.token;
        }
        let (train_names, train_tokens) = train.finish()?;
        drop(stream);
        for n in &names {
            let path = self.out.join(n);
            std::fs::remove_file(&path)
                .with_context(|| format!("cannot remove {}", path.display()))?;
        }
        record.tokens_sha256 = format!("{:x}", self.hash.finalize());
        let meta = finish_text_dataset(
            &self.out,
            self.tok,
            (train_names, train_tokens),
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
    use crate::data::formats::tests::parquet;

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
    fn sources_are_held_out_each_on_its_own() {
        let d = tmp("sources");
        write(&d.join("src/a/1.txt"), b"one two");
        write(&d.join("src/a/2.txt"), b"three");
        write(&d.join("src/a/skip.md"), b"not matched");
        write(&d.join("src/b/1.txt"), b"four five six seven");
        write(&d.join("src/pkg.tar.gz"), b"pinned bytes");
        write(&d.join("src/.pkg.tar.gz.unpacked"), b"");
        let sha = format!("{:x}", Sha256::digest(b"pinned bytes"));
        let sources = |sha: &str| {
            format!(
                "root = \"src\"\n[[package]]\nfile = \"pkg.tar.gz\"\nurl = \"https://example.org/pkg.tar.gz\"\nsha256 = \"{sha}\"\n\
                 [[source]]\nname = \"a\"\ninput = [\"a\"]\nglob = [\"*.txt\"]\n\
                 [[source]]\nname = \"b-docs\"\ninput = [\"b\"]\n"
            )
        };
        write(&d.join("corpus.toml"), sources(&sha).as_bytes());
        let spec = PrepareSpec {
            sources: Some(d.join("corpus.toml")),
            val_fraction: 0.25,
            shard_tokens: 5,
            ..Default::default()
        };
        let out = d.join("ds");
        let s = prepare(&spec, &out, true).unwrap();
        let stream = |docs: &[&str]| -> Vec<u32> {
            docs.iter()
                .flat_map(|doc| doc.bytes().map(u32::from).chain([data::BYTE_EOT]))
                .collect()
        };
        let (a, b) = (
            stream(&["one two", "three"]),
            stream(&["four five six seven"]),
        );
        // Each part's last quarter (rounded up) is its own validation split.
        let (na, nb) = (
            (a.len() as f64 * 0.25).ceil() as usize,
            (b.len() as f64 * 0.25).ceil() as usize,
        );
        let train = data::Split::open(&out, &s.meta, "train")
            .unwrap()
            .all_tokens();
        let want_train: Vec<u32> = [&a[..a.len() - na], &b[..b.len() - nb]].concat();
        assert_eq!(train, want_train);
        let names: Vec<&str> = s.record.sources.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["a", "b-docs"]);
        for (r, part) in s.record.sources.iter().zip([&a, &b]) {
            let meta_of = Meta {
                val: r.val.clone(),
                val_tokens: r.val_tokens,
                corpus: None,
                ..s.meta.clone()
            };
            let held = data::Split::open(&out, &meta_of, "val")
                .unwrap()
                .all_tokens();
            assert_eq!(held, part[part.len() - r.val_tokens as usize..]);
            assert_eq!(r.train_tokens + r.val_tokens, part.len() as u64);
            assert!(r
                .val
                .iter()
                .all(|n| n.starts_with(&format!("val-{}_", r.name))));
        }
        assert_eq!(
            (s.record.sources[0].files, s.record.sources[0].documents),
            (2, 2)
        );
        assert_eq!(s.record.packages[0].sha256, sha);
        // The content hash is the stream's, in reading order.
        let mut h = Sha256::new();
        for t in a.iter().chain(&b) {
            h.update(t.to_le_bytes());
        }
        assert_eq!(s.record.tokens_sha256, format!("{:x}", h.finalize()));
        // No shard of the unsplit stream is left behind.
        let left: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(STREAM_PREFIX))
            .collect();
        assert!(left.is_empty(), "{left:?}");
        // Evaluation's windows are shared between the parts, each part's own.
        let val = data::Split::open(&out, &s.meta, "val").unwrap();
        assert_eq!(val.part_names(), ["a", "b-docs"]);
        let parts: Vec<usize> = val
            .sequential(1, 2, 2, tch::Device::Cpu)
            .iter()
            .map(|(p, _)| *p)
            .collect();
        assert_eq!(parts, [0, 1]);

        // A changed archive, flags beside the file, and a name that cannot name a file are refused.
        write(&d.join("corpus.toml"), sources(&"0".repeat(64)).as_bytes());
        let err = format!("{:#}", prepare(&spec, &d.join("x"), true).err().unwrap());
        assert!(err.contains("not the pinned"), "{err}");
        let both = PrepareSpec {
            input: vec![d.join("src")],
            ..spec.clone()
        };
        let err = format!("{:#}", prepare(&both, &d.join("y"), true).err().unwrap());
        assert!(err.contains("drop --input"), "{err}");
        write(
            &d.join("corpus.toml"),
            b"root = \"src\"\n[[source]]\nname = \"a/b\"\ninput = [\"a\"]\n",
        );
        let err = format!("{:#}", prepare(&spec, &d.join("z"), true).err().unwrap());
        assert!(err.contains("use letters, digits"), "{err}");
    }

    /// A sources file whose parts read only below its root, each file in one part only, from
    /// archives unpacked whole: the held-out text of every part is nowhere in the training
    /// text. Two parts reading one file, an input outside the root (by path or by a link), and
    /// an archive whose unpacking did not finish are refused by name; a part that yields no
    /// document names its files' reasons.
    #[test]
    fn held_out_text_is_never_trained_on_and_sources_stay_in_their_root() {
        let d = tmp("sources-bounds");
        // Every line of every file is unique, so a held-out line found in training leaked.
        for (part, files) in [("a", 3), ("b", 2)] {
            for f in 0..files {
                let text: String = (0..20)
                    .map(|l| format!("{part} file {f} line {l}\n"))
                    .collect();
                write(&d.join(format!("src/{part}/{f}.txt")), text.as_bytes());
            }
        }
        write(&d.join("src/pkg.tar.gz"), b"pinned");
        let sha = format!("{:x}", Sha256::digest(b"pinned"));
        let package = format!(
            "[[package]]\nfile = \"pkg.tar.gz\"\nurl = \"https://example.org/p\"\nsha256 = \"{sha}\"\n"
        );
        let spec = PrepareSpec {
            sources: Some(d.join("corpus.toml")),
            val_fraction: 0.3,
            ..Default::default()
        };
        let run = |sources: &str, out: &str| {
            write(
                &d.join("corpus.toml"),
                format!("root = \"src\"\n{sources}").as_bytes(),
            );
            prepare(&spec, &d.join(out), true)
        };
        let err =
            |sources: &str, out: &str| format!("{:#}", run(sources, out).err().expect("refused"));
        let two = "[[source]]\nname = \"a\"\ninput = [\"a\"]\n[[source]]\nname = \"b\"\ninput = [\"b\"]\n";

        // The archive is there but its unpacking never finished.
        let e = err(&format!("{package}{two}"), "half");
        assert!(e.contains("is not unpacked whole"), "{e}");
        write(&d.join("src/.pkg.tar.gz.unpacked"), b"");

        let s = run(&format!("{package}{two}"), "ds").unwrap();
        let text = |tokens: Vec<u32>| -> String {
            let bytes: Vec<u8> = tokens
                .into_iter()
                .filter(|&t| t < 256)
                .map(|t| t as u8)
                .collect();
            String::from_utf8(bytes).unwrap()
        };
        let out = d.join("ds");
        let train = text(
            data::Split::open(&out, &s.meta, "train")
                .unwrap()
                .all_tokens(),
        );
        for r in &s.record.sources {
            let meta = Meta {
                val: r.val.clone(),
                val_tokens: r.val_tokens,
                corpus: None,
                ..s.meta.clone()
            };
            let held = text(data::Split::open(&out, &meta, "val").unwrap().all_tokens());
            let whole: Vec<&str> = held
                .lines()
                .filter(|l| l.ends_with(char::is_numeric) && l.split(' ').count() == 5)
                .collect();
            assert!(whole.len() >= 5, "{}: {held:?}", r.name);
            for line in whole {
                assert!(
                    !train.contains(&format!("{line}\n")),
                    "{line} of {} is trained on",
                    r.name
                );
            }
        }

        // One file read by two sources (a directory and a file in it), inside one source
        // read once.
        let e = err(
            &format!("{package}{two}[[source]]\nname = \"c\"\ninput = [\"a/0.txt\"]\n"),
            "twice",
        );
        assert!(
            e.contains("is read by both source \"a\" and source \"c\""),
            "{e}"
        );
        let once = run(
            &format!("{package}[[source]]\nname = \"a\"\ninput = [\"a\", \"a/0.txt\"]\n"),
            "once",
        )
        .unwrap();
        assert_eq!(once.record.files, 3);

        // Inputs outside the root, by path and by a link.
        for outside in ["../corpus.toml", "/etc"] {
            let e = err(
                &format!("{package}[[source]]\nname = \"x\"\ninput = [\"{outside}\"]\n"),
                "outside",
            );
            assert!(e.contains("is not a path below the root"), "{e}");
        }
        std::os::unix::fs::symlink(d.join("corpus.toml"), d.join("src/a/link.txt")).unwrap();
        let e = err(&format!("{package}{two}"), "link");
        assert!(
            e.contains("once links are followed, outside the root"),
            "{e}"
        );
        std::fs::remove_file(d.join("src/a/link.txt")).unwrap();

        // A source whose only file is skipped says which and why.
        write(&d.join("src/bin/x.txt"), b"\0\0");
        let e = err(
            &format!("{package}{two}[[source]]\nname = \"bin\"\ninput = [\"bin\"]\n"),
            "empty",
        );
        assert!(
            e.contains("source \"bin\": no document was read") && e.contains("x.txt: binary"),
            "{e}"
        );
        assert!(!d.join("empty").join("meta.json").exists());
    }
}
