//! The formats `data prepare` reads a file in, by its name: plain text (one document), JSON
//! Lines (a document a line, its text in a field) and Parquet (a document a row, its text in a
//! column), each optionally gzip-, zstd- or xz-compressed; and the records skipped on the way,
//! with their reasons.

use anyhow::{bail, Result};
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A file's format, from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Format {
    Text,
    JsonLines,
    Parquet,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Compression {
    None,
    Gzip,
    Zstd,
    Xz,
}

/// Format and compression of `path`: a last `.gz`/`.zst`/`.xz`, then the format's suffix.
pub(super) fn kind_of(path: &Path) -> (Format, Compression) {
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
pub(super) fn as_text(bytes: Vec<u8>) -> std::result::Result<String, String> {
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

/// What one read may hold in memory: a plain text document longer than `piece` bytes is
/// tokenised `piece` bytes at a time, a JSON Lines record longer than `record` is skipped, a
/// compressed Parquet file (read whole) larger than `record` decompressed is skipped.
#[derive(Clone, Copy)]
pub(super) struct Limits {
    pub(super) piece: usize,
    pub(super) record: usize,
}

pub(super) const LIMITS: Limits = Limits {
    piece: 16 << 20,
    record: 256 << 20,
};

/// A part of a document: its text, and whether the document ends with it.
pub(super) type Emit<'a> = dyn FnMut(String, bool) -> Result<()> + 'a;

/// Documents of one file, handed to `emit` in order, in parts (`Limits`); Ok(Err(reason))
/// when the file is skipped, before any of it is emitted. Records skipped inside a file are
/// counted in `skipped` (with the first reasons kept in `reasons`).
pub(super) fn read_file(
    path: &Path,
    text_field: &str,
    limits: Limits,
    count: &Arc<AtomicU64>,
    skipped: &mut Skipped,
    emit: &mut Emit,
) -> Result<std::result::Result<(), String>> {
    let (format, compression) = kind_of(path);
    let mut reader = match open(path, compression, count) {
        Ok(r) => r,
        Err(reason) => return Ok(Err(reason)),
    };
    match format {
        Format::Text => {
            let mut head = Vec::new();
            if let Err(e) = (&mut reader)
                .take(limits.piece as u64 + 1)
                .read_to_end(&mut head)
            {
                return Ok(Err(format!("cannot read or decompress: {e}")));
            }
            if head.len() <= limits.piece {
                match as_text(head) {
                    Ok(text) => emit(text, true)?,
                    Err(reason) => return Ok(Err(reason)),
                }
                return Ok(Ok(()));
            }
            drop(reader);
            // A long document is checked whole first, so one found binary or not UTF-8 is
            // skipped before any of it is kept; then read again, a piece at a time.
            let uncounted = Arc::new(AtomicU64::new(0));
            let check = match open(path, compression, &uncounted) {
                Ok(r) => text_pieces(r, limits.piece, &mut |_, _| Ok(()))?,
                Err(reason) => Err(reason),
            };
            if let Err(reason) = check {
                return Ok(Err(reason));
            }
            let read = match open(path, compression, count) {
                Ok(r) => text_pieces(r, limits.piece, emit)?,
                Err(reason) => Err(reason),
            };
            if let Err(reason) = read {
                bail!("{} changed while it was read: {reason}", path.display());
            }
        }
        Format::JsonLines => {
            let mut lines = BufReader::new(reader);
            let mut line = Vec::new();
            for number in 1.. {
                let (n, whole) = match read_record(&mut lines, &mut line, limits.record) {
                    Ok((0, _)) => break,
                    Ok(read) => read,
                    // What came before stays; the rest of the file is one skipped record.
                    Err(e) if number > 1 => {
                        skipped.record(format!(
                            "{}:{number}: cannot read or decompress the rest ({e})",
                            path.display()
                        ));
                        break;
                    }
                    Err(e) => return Ok(Err(format!("cannot read or decompress: {e}"))),
                };
                if !whole {
                    skipped.record(format!(
                        "{}:{number}: a record of {n} bytes, more than the {} one record may \
                         hold (split it into several)",
                        path.display(),
                        limits.record
                    ));
                    continue;
                }
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                match record_text(&line, text_field) {
                    Ok(text) => emit(text, true)?,
                    Err(reason) => skipped.record(format!("{}:{number}: {reason}", path.display())),
                }
            }
        }
        Format::Parquet => {
            return parquet_file(path, reader, compression, text_field, limits, skipped, emit)
        }
    }
    Ok(Ok(()))
}

/// A Parquet file's documents: an uncompressed file mapped from disk, a compressed one
/// decompressed into memory (up to `limits.record` bytes).
fn parquet_file(
    path: &Path,
    mut reader: Box<dyn Read>,
    compression: Compression,
    text_field: &str,
    limits: Limits,
    skipped: &mut Skipped,
    emit: &mut Emit,
) -> Result<std::result::Result<(), String>> {
    let mapped;
    let mut decompressed = Vec::new();
    let bytes: &[u8] = if compression == Compression::None {
        drop(reader);
        let file = std::fs::File::open(path)
            .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
        // Safety: the file is only read while the map lives.
        mapped = match unsafe { memmap2::Mmap::map(&file) } {
            Ok(m) => m,
            Err(e) => return Ok(Err(format!("cannot map ({e})"))),
        };
        &mapped
    } else {
        match (&mut reader)
            .take(limits.record as u64 + 1)
            .read_to_end(&mut decompressed)
        {
            Err(e) => return Ok(Err(format!("cannot read or decompress: {e}"))),
            Ok(n) if n > limits.record => {
                return Ok(Err(format!(
                    "decompressed, it holds more than the {} bytes a compressed Parquet file \
                     is read into (Parquet compresses its own pages: store it uncompressed)",
                    limits.record
                )))
            }
            Ok(_) => &decompressed,
        }
    };
    let mut stopped =
        |row, reason| skipped.record(format!("{}: rows from {row}: {reason}", path.display()));
    let read = parquet_documents(
        bytes,
        text_field,
        PARQUET_ROWS,
        &mut |t| emit(t, true),
        &mut stopped,
    )?;
    if let Ok(&nulls) = read.as_ref() {
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
    Ok(read.map(|_| ()))
}

/// Reads one line (its newline included) into `line`, keeping at most `max` bytes: the bytes
/// the line took, and whether it was kept whole.
fn read_record(
    r: &mut dyn BufRead,
    line: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<(usize, bool)> {
    line.clear();
    let (mut n, mut whole) = (0, true);
    loop {
        let buf = r.fill_buf()?;
        if buf.is_empty() {
            break;
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        if whole && line.len() + take <= max {
            line.extend_from_slice(&buf[..take]);
        } else {
            whole = false;
            line.clear();
        }
        r.consume(take);
        n += take;
        if done {
            break;
        }
    }
    Ok((n, whole))
}

/// A plain text document read `piece` bytes at a time and handed on in parts (the last one
/// marked), each ending at a line break followed by a printable ASCII character: where the
/// pre-tokenizers of byte-level BPE tokenizers (GPT-2's, Llama 3's, Qwen's) always split, so
/// the tokens are those of the whole text. A text with no such place within `2 * piece` bytes
/// is cut at a character boundary there. Err(reason) for a NUL byte or invalid UTF-8.
fn text_pieces(
    mut r: Box<dyn Read>,
    piece: usize,
    emit: &mut Emit,
) -> Result<std::result::Result<(), String>> {
    let mut buf: Vec<u8> = Vec::new();
    let mut offset = 0usize;
    loop {
        let before = buf.len();
        let want = (2 * piece).saturating_sub(before) as u64;
        if let Err(e) = (&mut r).take(want).read_to_end(&mut buf) {
            return Ok(Err(format!("cannot read or decompress: {e}")));
        }
        let end = buf.len() < 2 * piece;
        if let Some(at) = buf[before..].iter().position(|&b| b == 0) {
            return Ok(Err(format!(
                "binary (NUL byte at offset {})",
                offset + before + at
            )));
        }
        let mut cut = if end {
            buf.len()
        } else {
            break_at(&buf, piece)
        };
        if let Err(e) = std::str::from_utf8(&buf[..cut]) {
            match e.error_len() {
                // A character cut in two by the read: it starts the next piece.
                None if !end => cut = e.valid_up_to(),
                _ => {
                    return Ok(Err(format!(
                        "not UTF-8 (invalid byte at offset {})",
                        offset + e.valid_up_to()
                    )))
                }
            }
        }
        let rest = buf.split_off(cut);
        offset += cut;
        emit(String::from_utf8(buf).expect("checked above"), end)?;
        buf = rest;
        if end {
            return Ok(Ok(()));
        }
    }
}

/// Where to end a piece of `buf` (2 * `piece` bytes): the last line break followed by a
/// printable ASCII character from `piece / 2` on, else the last character boundary at
/// `piece`.
fn break_at(buf: &[u8], piece: usize) -> usize {
    (piece / 2 + 1..buf.len())
        .rev()
        .find(|&p| buf[p - 1] == b'\n' && buf[p].is_ascii_graphic())
        .unwrap_or_else(|| {
            (1..=piece)
                .rev()
                .find(|&p| buf[p] & 0xC0 != 0x80)
                .unwrap_or(piece)
        })
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

/// Records skipped inside files: how many, and the first reasons.
#[derive(Default)]
pub(super) struct Skipped {
    pub(super) count: u64,
    pub(super) reasons: Vec<String>,
}

/// Reasons kept for the summary.
pub(super) const REASONS_SHOWN: usize = 10;

impl Skipped {
    fn record(&mut self, reason: String) {
        self.record_many(1, reason)
    }

    /// Another file's (or part's) skipped records added to these.
    pub(super) fn absorb(&mut self, other: Skipped) {
        self.count += other.count;
        let room = REASONS_SHOWN.saturating_sub(self.reasons.len());
        self.reasons.extend(other.reasons.into_iter().take(room));
    }

    /// `n` records skipped for one reason.
    fn record_many(&mut self, n: u64, reason: String) {
        self.count += n;
        if self.reasons.len() < REASONS_SHOWN {
            self.reasons.push(reason);
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A Parquet file of one `text` column, two rows a row group.
    pub(in crate::data) fn parquet(rows: &[Option<&str>]) -> Vec<u8> {
        use polars::prelude::*;
        let mut df = DataFrame::new_infer_height(vec![Column::new("text".into(), rows)]).unwrap();
        let mut bytes = Vec::new();
        ParquetWriter::new(&mut bytes)
            .with_row_group_size(Some(2))
            .finish(&mut df)
            .unwrap();
        bytes
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

    /// `bytes` as the file `name` read with `limits`: its parts (text, ends a document), the
    /// reason it was skipped, and the records skipped inside it.
    fn read_as(
        name: &str,
        bytes: &[u8],
        limits: Limits,
    ) -> (
        Vec<(String, bool)>,
        std::result::Result<(), String>,
        Vec<String>,
    ) {
        let dir = crate::util::scratch_dir(&format!("formats-{name}"));
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        let (mut parts, mut skipped) = (Vec::new(), Skipped::default());
        let count = Arc::new(AtomicU64::new(0));
        let read = read_file(
            &path,
            "text",
            limits,
            &count,
            &mut skipped,
            &mut |t, end| {
                parts.push((t, end));
                Ok(())
            },
        )
        .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        (parts, read, skipped.reasons)
    }

    /// A text longer than a piece streams in pieces that end where a line break meets a
    /// printable character (or, with none, at a character boundary), together the whole
    /// text, the document ending once; a long text binary or not UTF-8 far from its start is
    /// skipped before any of it is handed on. A JSON Lines record longer than a record may be
    /// is skipped by line, and the records after it read.
    #[test]
    fn long_documents_stream_in_pieces_and_long_records_are_skipped() {
        let limits = Limits {
            piece: 64,
            record: 40,
        };
        let text: String = (0..40)
            .map(|i| format!("line {i}: caf\u{e9}\n  indented\n"))
            .collect();
        let (parts, read, _) = read_as("long.txt", text.as_bytes(), limits);
        assert_eq!(read, Ok(()));
        assert!(parts.len() > 5, "{} parts", parts.len());
        assert_eq!(parts.iter().map(|p| p.0.as_str()).collect::<String>(), text);
        let ends: Vec<bool> = parts.iter().map(|p| p.1).collect();
        assert!(ends[..ends.len() - 1].iter().all(|e| !e) && ends[ends.len() - 1]);
        for (p, _) in &parts[..parts.len() - 1] {
            assert!(p.len() <= 128 && p.ends_with('\n'), "{p:?}");
        }
        // One line of multi-byte characters: cut at character boundaries.
        let one_line = "\u{e9}".repeat(200);
        let (parts, read, _) = read_as("oneline.txt", one_line.as_bytes(), limits);
        assert_eq!(read, Ok(()));
        assert_eq!(
            parts.iter().map(|p| p.0.as_str()).collect::<String>(),
            one_line
        );
        // Compressed the same.
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut gz, text.as_bytes()).unwrap();
        let (parts, _, _) = read_as("long.txt.gz", &gz.finish().unwrap(), limits);
        assert_eq!(parts.iter().map(|p| p.0.as_str()).collect::<String>(), text);
        // A NUL or a bad byte far past the first piece: skipped, nothing handed on.
        for (bad, why) in [
            (b'\0', "binary (NUL byte at offset 500)"),
            (0xff, "not UTF-8 (invalid byte at offset 500)"),
        ] {
            let mut bytes = text.clone().into_bytes();
            bytes[500] = bad;
            let (parts, read, _) = read_as("bad.txt", &bytes, limits);
            assert_eq!(read, Err(why.to_string()));
            assert!(parts.is_empty());
        }
        let records = format!(
            "{{\"text\": \"short\"}}\n{{\"text\": \"{}\"}}\n{{\"text\": \"after\"}}\n",
            "x".repeat(100)
        );
        let (parts, read, reasons) = read_as("r.jsonl", records.as_bytes(), limits);
        assert_eq!(read, Ok(()));
        assert_eq!(
            parts,
            [("short".to_string(), true), ("after".to_string(), true)]
        );
        assert!(
            reasons[0].ends_with("r.jsonl:2: a record of 113 bytes, more than the 40 one record may hold (split it into several)"),
            "{reasons:?}"
        );
        // A compressed Parquet file larger than a record decompressed is skipped.
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut gz, &parquet(&[Some("a"), Some("b")])).unwrap();
        let (_, read, _) = read_as("p.parquet.gz", &gz.finish().unwrap(), limits);
        assert!(read.unwrap_err().contains("store it uncompressed"));
    }

    /// Pieces tokenise as the whole text does with a byte-level BPE tokenizer whose merges
    /// would join across a careless cut (a newline with what follows it, letters of a word,
    /// runs of spaces), under GPT-2's pattern and under Llama 3's split.
    #[test]
    fn pieces_tokenise_as_the_whole_text() {
        use tokenizers::models::bpe::BPE;
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        use tokenizers::pre_tokenizers::sequence::Sequence;
        use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
        use tokenizers::PreTokenizerWrapper;
        let mut vocab: Vec<String> = ByteLevel::alphabet()
            .into_iter()
            .map(String::from)
            .collect();
        vocab.sort();
        let merges: Vec<(String, String)> = [
            ("l", "i"),
            ("li", "n"),
            ("lin", "e"),
            ("Ċ", "l"),
            ("Ġ", "Ġ"),
            ("ĠĠ", "Ġ"),
            ("Ċ", "Ġ"),
            ("Ġ", "x"),
            (":", "Ċ"),
            ("e", "Ċ"),
        ]
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
        vocab.extend(merges.iter().map(|(a, b)| format!("{a}{b}")));
        let ids: tokenizers::models::bpe::Vocab = vocab
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(ids, merges)
            .build()
            .unwrap();
        const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
        let gpt2: PreTokenizerWrapper = ByteLevel::new(false, true, true).into();
        let split = Split::new(
            SplitPattern::Regex(LLAMA3.into()),
            tokenizers::SplitDelimiterBehavior::Isolated,
            false,
        )
        .unwrap();
        let llama3: PreTokenizerWrapper = Sequence::new(vec![
            split.into(),
            ByteLevel::new(false, true, false).into(),
        ])
        .into();
        let text: String = (0..60)
            .map(|i| format!("line {i}:\n   x line\n\nline{i}  x\n"))
            .collect();
        let limits = Limits {
            piece: 48,
            record: 1 << 20,
        };
        let (parts, _, _) = read_as("tok.txt", text.as_bytes(), limits);
        assert!(parts.len() > 10);
        for pre in [gpt2, llama3] {
            let mut tok = tokenizers::Tokenizer::new(bpe.clone());
            tok.with_pre_tokenizer(Some(pre));
            let ids = |t: &str| tok.encode(t, false).unwrap().get_ids().to_vec();
            let pieces: Vec<u32> = parts.iter().flat_map(|(p, _)| ids(p)).collect();
            assert_eq!(pieces, ids(&text));
        }
    }
}
