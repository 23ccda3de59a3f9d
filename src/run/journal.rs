//! An evaluation's journal of finished work (`probe_journal.jsonl` beside its outputs): each
//! batch of probes is appended as it finishes, so an evaluation cut off (an allocation's end, a
//! kill, a job's time limit) resumes at its first unfinished batch rather than at its first.
//! The first line holds the key of what was evaluated (the journal's format, the whole config,
//! the data sets it reads and the weights file as found): a journal of another evaluation, or
//! of weights written again since, is replaced by a new one, never mixed in. A kill can cut the
//! last line short; that line is cut off. The finished evaluation removes its journal: by then
//! every batch is in the outputs.

use crate::config::Config;
use crate::data;
use crate::util::fault;
use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The journal's format: a journal of another format is of another evaluation.
const FORMAT: u32 = 1;

/// A batch's place: task, prompt length, and the batch's index among every batch of the
/// evaluation (unique even where a task or length is listed twice).
type Place = (String, usize, u64);

#[derive(Serialize, Deserialize)]
struct Header {
    key: String,
}

#[derive(Serialize, Deserialize)]
struct Line {
    task: String,
    length: usize,
    batch: u64,
    record: serde_json::Value,
}

/// The finished batches of one evaluation, and the file new ones are appended to.
pub(crate) struct Journal {
    path: PathBuf,
    file: File,
    done: BTreeMap<Place, serde_json::Value>,
}

impl Journal {
    /// The journal of the evaluation of `cfg` on the weights at `model_path`, written to
    /// `dir` (`probe_journal.jsonl`); with `show`, says how many batches it resumes.
    pub(crate) fn of_evaluation(
        dir: &Path,
        cfg: &Config,
        model_path: &Path,
        show: bool,
    ) -> Result<Journal> {
        let m = std::fs::metadata(model_path)
            .with_context(|| format!("cannot read {}", model_path.display()))?;
        // Weights trained again at the same path are others: their size or time of writing.
        let written = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        // The data sets the prompts are drawn from (their haystack, their tokenizer).
        let mut sets = vec![data::identity(&cfg.data.dir)?];
        if !cfg.eval.haystack_dir.as_os_str().is_empty() {
            sets.push(data::identity(&cfg.eval.haystack_dir)?);
        }
        let key = format!(
            "format {FORMAT}, attnsweep {}\n{}\ndata {}\nweights {} {} {written}",
            env!("CARGO_PKG_VERSION"),
            cfg.to_toml(),
            sets.join(" "),
            model_path.display(),
            m.len()
        );
        let path = dir.join("probe_journal.jsonl");
        let journal = Journal::open(&path, &key)?;
        if show && journal.resumed() > 0 {
            eprintln!(
                "probes: {} batches finished by an interrupted run are taken from {}",
                journal.resumed(),
                path.display()
            );
        }
        Ok(journal)
    }

    /// The journal at `path` for the evaluation `key`: the batches it holds when its key is
    /// `key`; else (no file, another key) a new journal holding only the key.
    pub(crate) fn open(path: &Path, key: &str) -> Result<Journal> {
        let done = match std::fs::read(path) {
            Ok(bytes) => read(&bytes, key).with_context(|| {
                format!(
                    "{} is not a probe journal; remove it to run the probes from their first \
                     batch",
                    path.display()
                )
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        let file = match &done {
            // A line cut short is cut off, so the next batch starts a line of its own.
            Some((_, whole)) => OpenOptions::new().append(true).open(path).and_then(|f| {
                f.set_len(*whole)?;
                Ok(f)
            }),
            None => fault::write_error().and_then(|_| {
                let mut f = File::create(path)?;
                writeln!(f, "{}", serde_json::to_string(&Header { key: key.into() })?)?;
                f.sync_data()?;
                Ok(f)
            }),
        }
        .with_context(|| format!("cannot write {}", path.display()))?;
        Ok(Journal {
            path: path.to_path_buf(),
            file,
            done: done.map(|(d, _)| d).unwrap_or_default(),
        })
    }

    /// Its file.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Batches a run before this one finished.
    pub(crate) fn resumed(&self) -> usize {
        self.done.len()
    }

    /// The record of the evaluation's batch `batch` (of `task` at `length`), if an earlier run
    /// finished it.
    pub(crate) fn take<T: DeserializeOwned>(
        &mut self,
        task: &str,
        length: usize,
        batch: u64,
    ) -> Result<Option<T>> {
        match self.done.remove(&(task.to_string(), length, batch)) {
            Some(v) => Ok(Some(serde_json::from_value(v).with_context(|| {
                format!(
                    "{}: batch {batch} ({task} at {length}) is not a batch record; remove the \
                     journal to run the probes from their first batch",
                    self.path.display()
                )
            })?)),
            None => Ok(None),
        }
    }

    /// Appends the finished batch's record, on disk before it returns.
    pub(crate) fn append<T: Serialize>(
        &mut self,
        task: &str,
        length: usize,
        batch: u64,
        record: &T,
    ) -> Result<()> {
        let line = Line {
            task: task.into(),
            length,
            batch,
            record: serde_json::to_value(record)?,
        };
        let file = &mut self.file;
        fault::write_error()
            .and_then(|_| writeln!(file, "{}", serde_json::to_string(&line)?))
            .and_then(|_| file.sync_data())
            .with_context(|| format!("cannot write {}", self.path.display()))
    }

    /// The journal's file removed: its batches are in the evaluation's outputs.
    pub(crate) fn finish(self) -> Result<()> {
        std::fs::remove_file(&self.path)
            .or_else(|e| match e.kind() {
                std::io::ErrorKind::NotFound => Ok(()),
                _ => Err(e),
            })
            .with_context(|| format!("cannot remove {}", self.path.display()))
    }
}

/// The batches a journal's bytes hold for `key` and the bytes of its whole lines; None when
/// it is of another evaluation (or empty: a kill before its key was written). Bytes, not
/// text: a kill can cut a line inside a character.
fn read(bytes: &[u8], key: &str) -> Result<Option<(BTreeMap<Place, serde_json::Value>, u64)>> {
    let mut lines = bytes.split_inclusive(|&b| b == b'\n').enumerate();
    let Some((_, first)) = lines.next() else {
        return Ok(None);
    };
    match serde_json::from_slice::<Header>(first) {
        Ok(h) if h.key == key && first.ends_with(b"\n") => {}
        _ => return Ok(None),
    }
    let (mut done, mut whole) = (BTreeMap::new(), first.len());
    for (i, l) in lines {
        // Only the last line can be cut short, by a kill while it was written.
        if !l.ends_with(b"\n") {
            break;
        }
        match serde_json::from_slice::<Line>(l) {
            Ok(b) => {
                done.insert((b.task, b.length, b.batch), b.record);
                whole += l.len();
            }
            Err(e) => bail!("its line {} is not a batch record: {e}", i + 1),
        }
    }
    Ok(Some((done, whole as u64)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A journal file of its own for a test (one per name and process).
    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("attnsweep-journal-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join(name);
        let _ = std::fs::remove_file(&p);
        p
    }

    /// Batches appended are there for the next run of the same key, each taken once; a line
    /// cut short (inside a character, too) is cut off before the next is appended; another
    /// key starts anew; a garbled line in the middle is an error that names the file and how
    /// to start over; `finish` removes the file.
    #[test]
    fn batches_survive_for_their_own_evaluation_only() {
        let p = scratch("j.jsonl");
        let mut j = Journal::open(&p, "k1").unwrap();
        assert_eq!(j.resumed(), 0);
        j.append("passkey", 64, 0, &vec![1.0, 0.0]).unwrap();
        j.append("passkey", 64, 1, &"é".to_string()).unwrap();
        drop(j);
        // A kill in the middle of a third line, inside a two-byte character.
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(b"{\"task\": \"passkey\", \"record\": \"\xc3")
            .unwrap();
        drop(f);
        let mut j = Journal::open(&p, "k1").unwrap();
        assert_eq!(j.resumed(), 2);
        j.append("passkey", 64, 2, &vec![1.0]).unwrap();
        assert_eq!(Journal::open(&p, "k1").unwrap().resumed(), 3);
        assert_eq!(
            j.take::<String>("passkey", 64, 1).unwrap(),
            Some("é".to_string())
        );
        assert_eq!(j.take::<String>("passkey", 64, 1).unwrap(), None);
        assert_eq!(j.take::<Vec<f64>>("passkey", 128, 0).unwrap(), None);
        let e = format!("{:#}", j.take::<String>("passkey", 64, 0).unwrap_err());
        assert!(
            e.contains("j.jsonl") && e.contains("remove the journal"),
            "{e}"
        );
        drop(j);
        let j = Journal::open(&p, "k2").unwrap();
        assert_eq!(j.resumed(), 0);
        drop(j);
        assert_eq!(Journal::open(&p, "k2").unwrap().resumed(), 0);
        std::fs::write(&p, "{\"key\":\"k2\"}\nnot json\n{}\n").unwrap();
        let e = format!("{:#}", Journal::open(&p, "k2").err().unwrap());
        assert!(
            e.contains("j.jsonl is not a probe journal; remove it")
                && e.contains("its line 2 is not a batch record"),
            "{e}"
        );
        std::fs::remove_file(&p).unwrap();
        let j = Journal::open(&p, "k3").unwrap();
        j.finish().unwrap();
        assert!(!p.exists());
    }
}
