//! An evaluation's journal of finished work (`probe_journal.jsonl` beside its outputs): each
//! batch of probes is appended as it finishes, so an evaluation cut off (a lease's end, a
//! kill) resumes at its first unfinished batch rather than at its first. The first line holds
//! the key of what was evaluated (the whole config and the weights file as found): a journal
//! of another evaluation, or of weights written again since, is set aside and started anew,
//! never mixed in. A kill can cut the last line short; that line is dropped. The finished
//! evaluation removes its journal: by then every batch is in the outputs.

use crate::config::Config;
use crate::util::fault;
use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// A batch's place: task, prompt length, batch index within them.
type Place = (String, usize, usize);

#[derive(Serialize, Deserialize)]
struct Header {
    key: String,
}

#[derive(Serialize, Deserialize)]
struct Line {
    task: String,
    length: usize,
    batch: usize,
    record: serde_json::Value,
}

/// The finished batches of one evaluation, and the file new ones are appended to (none for
/// an evaluation that keeps no journal).
pub(crate) struct Journal {
    path: Option<PathBuf>,
    file: Option<File>,
    done: BTreeMap<Place, serde_json::Value>,
}

impl Journal {
    /// A journal that keeps nothing (tests that probe without writing outputs).
    #[cfg(test)]
    pub(crate) fn off() -> Journal {
        Journal {
            path: None,
            file: None,
            done: BTreeMap::new(),
        }
    }

    /// The journal at `path` for the evaluation `key`: the batches it holds when its key is
    /// `key`; else (no file, another key) a new journal holding only the key.
    pub(crate) fn open(path: &Path, key: &str) -> Result<Journal> {
        let done = match std::fs::read_to_string(path) {
            Ok(text) => read(&text, key)
                .with_context(|| format!("{} is not a probe journal", path.display()))
                .context("remove it to run the probes from their first batch")?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        let file = match &done {
            // A line cut short is cut off, so the next batch starts a line of its own.
            Some((_, whole)) => OpenOptions::new().append(true).open(path).and_then(|f| {
                f.set_len(*whole)?;
                Ok(f)
            }),
            None => {
                fault::write_error()?;
                File::create(path).and_then(|mut f| {
                    writeln!(f, "{}", serde_json::to_string(&Header { key: key.into() })?)?;
                    f.sync_data()?;
                    Ok(f)
                })
            }
        }
        .with_context(|| format!("cannot write {}", path.display()))?;
        Ok(Journal {
            path: Some(path.to_path_buf()),
            file: Some(file),
            done: done.map(|(d, _)| d).unwrap_or_default(),
        })
    }

    /// The journal of the evaluation of `cfg` on the weights at `model_path`, written to
    /// `dir` (`probe_journal.jsonl`); with `show`, says how many batches it resumes.
    pub(crate) fn of_evaluation(
        dir: &Path,
        cfg: &Config,
        model_path: &Path,
        show: bool,
    ) -> Result<Journal> {
        // What its batches hold true for: the whole config, and the weights file as found (its
        // path, size and time of writing: weights trained again at the same path are others).
        let m = std::fs::metadata(model_path)
            .with_context(|| format!("cannot read {}", model_path.display()))?;
        let written = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        let key = format!(
            "{}\nweights {} {} {written}",
            cfg.to_toml(),
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

    /// Batches a run before this one finished.
    pub(crate) fn resumed(&self) -> usize {
        self.done.len()
    }

    /// The record of the batch at (`task`, `length`, `batch`), if an earlier run finished it.
    pub(crate) fn take<T: DeserializeOwned>(
        &mut self,
        task: &str,
        length: usize,
        batch: usize,
    ) -> Result<Option<T>> {
        match self.done.remove(&(task.to_string(), length, batch)) {
            Some(v) => Ok(Some(serde_json::from_value(v).with_context(|| {
                format!("the journal's batch {batch} of {task} at {length} is not a batch record")
            })?)),
            None => Ok(None),
        }
    }

    /// Appends the finished batch's record, on disk before it returns.
    pub(crate) fn append<T: Serialize>(
        &mut self,
        task: &str,
        length: usize,
        batch: usize,
        record: &T,
    ) -> Result<()> {
        let (Some(file), Some(path)) = (&mut self.file, &self.path) else {
            return Ok(());
        };
        let line = Line {
            task: task.into(),
            length,
            batch,
            record: serde_json::to_value(record)?,
        };
        fault::write_error()
            .and_then(|_| writeln!(file, "{}", serde_json::to_string(&line)?))
            .and_then(|_| file.sync_data())
            .with_context(|| format!("cannot write {}", path.display()))
    }

    /// The journal's file removed: its batches are in the evaluation's outputs.
    pub(crate) fn finish(self) -> Result<()> {
        match &self.path {
            Some(p) => std::fs::remove_file(p)
                .or_else(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => Ok(()),
                    _ => Err(e),
                })
                .with_context(|| format!("cannot remove {}", p.display())),
            None => Ok(()),
        }
    }
}

/// The batches a journal's text holds for `key` and the bytes of its whole lines; None when
/// it is of another evaluation (or empty: a kill before its key was written).
fn read(text: &str, key: &str) -> Result<Option<(BTreeMap<Place, serde_json::Value>, u64)>> {
    let mut lines = text.split_inclusive('\n').enumerate();
    let Some((_, first)) = lines.next() else {
        return Ok(None);
    };
    match serde_json::from_str::<Header>(first) {
        Ok(h) if h.key == key && first.ends_with('\n') => {}
        _ => return Ok(None),
    }
    let (mut done, mut whole) = (BTreeMap::new(), first.len());
    for (i, l) in lines {
        // Only the last line can be cut short, by a kill while it was written.
        if !l.ends_with('\n') {
            break;
        }
        match serde_json::from_str::<Line>(l) {
            Ok(b) => {
                done.insert((b.task, b.length, b.batch), b.record);
                whole += l.len();
            }
            Err(e) => bail!("line {} is not a batch record: {e}", i + 1),
        }
    }
    Ok(Some((done, whole as u64)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("attnsweep-journal-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join(name);
        let _ = std::fs::remove_file(&p);
        p
    }

    /// Batches appended are there for the next run of the same key, each taken once; a line
    /// cut short is dropped; another key starts anew; a garbled line in the middle is an error
    /// that says how to start over; `finish` removes the file.
    #[test]
    fn batches_survive_for_their_own_evaluation_only() {
        let p = scratch("j.jsonl");
        let mut j = Journal::open(&p, "k1").unwrap();
        assert_eq!(j.resumed(), 0);
        j.append("passkey", 64, 0, &vec![1.0, 0.0]).unwrap();
        j.append("passkey", 64, 1, &vec![0.5]).unwrap();
        drop(j);
        // A kill in the middle of a third line.
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        write!(f, "{{\"task\": \"passkey\", \"len").unwrap();
        drop(f);
        let mut j = Journal::open(&p, "k1").unwrap();
        assert_eq!(j.resumed(), 2);
        // The cut line is cut off before the next batch is appended.
        j.append("passkey", 64, 2, &vec![1.0]).unwrap();
        assert_eq!(Journal::open(&p, "k1").unwrap().resumed(), 3);
        assert_eq!(
            j.take::<Vec<f64>>("passkey", 64, 1).unwrap(),
            Some(vec![0.5])
        );
        assert_eq!(j.take::<Vec<f64>>("passkey", 64, 1).unwrap(), None);
        assert_eq!(j.take::<Vec<f64>>("passkey", 128, 0).unwrap(), None);
        assert!(j.take::<String>("passkey", 64, 0).is_err());
        drop(j);
        let j = Journal::open(&p, "k2").unwrap();
        assert_eq!(j.resumed(), 0);
        drop(j);
        assert_eq!(Journal::open(&p, "k2").unwrap().resumed(), 0);
        std::fs::write(&p, "{\"key\":\"k2\"}\nnot json\n{}\n").unwrap();
        let e = format!("{:#}", Journal::open(&p, "k2").err().unwrap());
        assert!(
            e.contains("line 2 is not a batch record") && e.contains("remove it"),
            "{e}"
        );
        std::fs::remove_file(&p).unwrap();
        let j = Journal::open(&p, "k3").unwrap();
        j.finish().unwrap();
        assert!(!p.exists());
        Journal::off().finish().unwrap();
    }
}
