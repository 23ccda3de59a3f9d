//! The formats `data prepare` reads a file in, by its name: plain text (one document), JSON
//! Lines (a document a line, its text in a field) and Parquet (a document a row, its text in a
//! column), each optionally gzip-, zstd- or xz-compressed; and the records skipped on the way,
//! with their reasons.

use anyhow::Result;
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

/// Documents of one file, handed to `emit` in order; Ok(Err(reason)) when the file is
/// skipped. Records skipped inside a file are counted in `skipped` (with the first reasons
/// kept in `reasons`).
pub(super) fn read_file(
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
}
