//! What a finished cell's own files hold beyond its evaluation report, read once for its row
//! (`rows.rs`): its training and validation logs, its probes' head usage per task
//! (`eval/probe_head_usage.csv`), its NIAH grid (`eval/niah.csv`) and every prompt's scores
//! (`eval/probe_samples.jsonl.gz`, or the plain file of an earlier evaluation). Tables and
//! figures read them from the row, never from the files.

use crate::run::tasks;
use crate::util::stats::median;
use anyhow::{anyhow, bail, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// A training or validation log (`train_log.csv`, `val_log.csv`): its columns, and a row per
/// logged step with each value where it is a finite number.
#[derive(Debug, Clone, Default)]
pub(crate) struct Log {
    columns: Vec<String>,
    rows: Vec<Vec<Option<f64>>>,
}

impl Log {
    /// The log at `path` (None where there is none), and what of it could not be read: a
    /// header that is not CSV, a row cut short or unparseable (the rows before it are kept).
    pub(crate) fn read(path: &Path) -> (Option<Log>, Option<String>) {
        if !path.exists() {
            return (None, None);
        }
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let mut rdr = match csv::Reader::from_path(path) {
            Ok(r) => r,
            Err(e) => return (None, Some(format!("{name} cannot be read ({e})"))),
        };
        let columns: Vec<String> = match rdr.headers() {
            Ok(h) => h.iter().map(String::from).collect(),
            Err(e) => return (None, Some(format!("{name} has no readable header ({e})"))),
        };
        let (mut rows, mut problem) = (Vec::new(), None);
        for (i, r) in rdr.records().enumerate() {
            match r {
                Ok(r) => rows.push(
                    r.iter()
                        .map(|v| v.parse::<f64>().ok().filter(|v| v.is_finite()))
                        .collect(),
                ),
                Err(e) => {
                    problem = Some(format!(
                        "{name} is unreadable from its row {} on (cut short?): {e}",
                        i + 2
                    ));
                    break;
                }
            }
        }
        (Some(Log { columns, rows }), problem)
    }

    /// The named columns, a row per logged step where each of them is a finite number; None
    /// when a column is missing.
    pub(crate) fn select(&self, names: &[&str]) -> Option<Vec<Vec<f64>>> {
        let cols: Vec<usize> = names
            .iter()
            .map(|n| self.columns.iter().position(|h| h == n))
            .collect::<Option<_>>()?;
        Some(
            self.rows
                .iter()
                .filter_map(|r| cols.iter().map(|&i| *r.get(i)?).collect())
                .collect(),
        )
    }

    /// The median of a training log's `tokens_per_s` column (robust to the first steps, which
    /// include compilation and warm-up), None without the column or a rate: the rate the
    /// tables report and the dry run's plan costs cells at.
    pub(crate) fn median_rate(&self) -> Option<f64> {
        let rates: Vec<f64> = self
            .select(&["tokens_per_s"])?
            .into_iter()
            .map(|r| r[0])
            .collect();
        (!rates.is_empty()).then(|| median(rates))
    }
}

/// Per probe task, a layer x head map of full-attention usage, from a cell's
/// `eval/probe_head_usage.csv` (columns task, layer, head, mu_f); empty without the file.
pub(crate) fn probe_usage(path: &Path) -> Result<BTreeMap<String, Vec<Vec<f64>>>> {
    let mut by_task: BTreeMap<String, Vec<Vec<f64>>> = BTreeMap::new();
    if !path.is_file() {
        return Ok(by_task);
    }
    let mut rdr = csv::Reader::from_path(path)?;
    for (i, rec) in rdr.records().enumerate() {
        let rec = rec?;
        let bad = || {
            anyhow!(
                "{}: row {} needs task,layer,head,mu_f",
                path.display(),
                i + 2
            )
        };
        let index = |k: usize| {
            rec.get(k)
                .and_then(|v| v.parse::<usize>().ok())
                .ok_or_else(bad)
        };
        let (layer, head) = (index(1)?, index(2)?);
        let mu: f64 = rec.get(3).and_then(|v| v.parse().ok()).ok_or_else(bad)?;
        anyhow::ensure!(
            mu.is_finite(),
            "{}: row {} gives mu_f {mu}",
            path.display(),
            i + 2
        );
        let m = by_task
            .entry(rec.get(0).ok_or_else(bad)?.to_string())
            .or_default();
        if m.len() <= layer {
            m.resize(layer + 1, vec![]);
        }
        if m[layer].len() <= head {
            m[layer].resize(head + 1, f64::NAN);
        }
        m[layer][head] = mu;
    }
    Ok(by_task)
}

/// A cell's NIAH results (`eval/niah.csv`, as the evaluation suite writes it): per (depth,
/// length), the accuracy and, for routed models, the full ratio on the answer tokens.
#[derive(Debug, Clone)]
pub(crate) struct Niah {
    /// (depth, length, accuracy, full ratio), NaN where a value does not parse.
    pub(crate) cells: Vec<(f64, f64, f64, Option<f64>)>,
    /// The file has a full-ratio column.
    pub(crate) full_ratio: bool,
}

/// The NIAH grid at `path`, None without the file.
pub(crate) fn niah(path: &Path) -> Result<Option<Niah>> {
    if !path.is_file() {
        return Ok(None);
    }
    let mut rdr = csv::Reader::from_path(path)?;
    let headers = rdr.headers()?.clone();
    let idx = |n: &str| headers.iter().position(|h| h == n);
    let (Some(d), Some(l), Some(a)) = (idx("depth"), idx("length"), idx("accuracy")) else {
        bail!("{} needs columns depth, length, accuracy", path.display());
    };
    let fr = idx("full_ratio");
    let mut cells = Vec::new();
    for rec in rdr.records() {
        let rec = rec?;
        let num = |i: usize| {
            rec.get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(f64::NAN)
        };
        cells.push((num(d), num(l), num(a), fr.map(num)));
    }
    Ok(Some(Niah {
        cells,
        full_ratio: fr.is_some(),
    }))
}

/// A cell's probe prompts as its samples (`tasks::SAMPLES`) list them.
#[derive(Debug, Default)]
pub(crate) struct PromptScores {
    /// Per probe score (`<task>.exact_match`, and `<task>.recall` where the file has it),
    /// each prompt's value in the file's order.
    pub(crate) scores: BTreeMap<String, Vec<f64>>,
    /// Per (task, prompt length): each prompt's exact match, in the file's order.
    pub(crate) by_length: BTreeMap<(String, u64), Vec<f64>>,
    /// Beside `by_length`: what each prompt was (its depth, sample index and target as the
    /// file writes them; None where the file names none), so that two models' scores are
    /// paired only on prompts known to be the same.
    pub(crate) ids_by_length: BTreeMap<(String, u64), Vec<Option<String>>>,
}

/// The prompts of the probes in a cell's evaluation folder `eval` (`tasks::read_samples`);
/// empty without them.
pub(crate) fn prompt_scores(eval: &Path) -> Result<PromptScores> {
    let mut out = PromptScores::default();
    let Some((path, text)) = tasks::read_samples(eval)? else {
        return Ok(out);
    };
    let path = path.as_path();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| anyhow!("{}: line {} is not JSON ({e})", path.display(), i + 1))?;
        let task = v["task"]
            .as_str()
            .ok_or_else(|| anyhow!("{}: line {} names no task", path.display(), i + 1))?;
        for metric in ["exact_match", "recall"] {
            if let Some(x) = v[metric].as_f64().filter(|x| x.is_finite()) {
                out.scores
                    .entry(format!("{task}.{metric}"))
                    .or_default()
                    .push(x);
            }
        }
        let exact = v["exact_match"].as_f64().filter(|x| x.is_finite());
        if let (Some(length), Some(x)) = (v["length"].as_u64(), exact) {
            let key = (task.to_string(), length);
            out.by_length.entry(key.clone()).or_default().push(x);
            let id = match (&v["sample"], &v["target"]) {
                (serde_json::Value::Null, _) | (_, serde_json::Value::Null) => None,
                (s, t) => Some(format!("{}|{s}|{t}", v["depth"])),
            };
            out.ids_by_length.entry(key).or_default().push(id);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The compressed samples an evaluation writes and the plain ones of earlier evaluations
    /// read alike; a cut-short compressed file is an error naming it, not an empty cell.
    #[test]
    fn compressed_and_plain_samples_read_alike() {
        let dir = std::env::temp_dir().join(format!("attnsweep-samples-{}", std::process::id()));
        let (gz, plain) = (dir.join("gz"), dir.join("plain"));
        for d in [&gz, &plain] {
            std::fs::create_dir_all(d).unwrap();
        }
        let text = "{\"task\":\"niah_single_1\",\"length\":8,\"depth\":0.5,\"sample\":0,\
                    \"target\":\"7\",\"exact_match\":1.0,\"recall\":1.0}\n\
                    {\"task\":\"niah_single_1\",\"length\":8,\"depth\":0.5,\"sample\":1,\
                    \"target\":\"3\",\"exact_match\":0.0,\"recall\":0.5}\n";
        std::fs::write(plain.join("probe_samples.jsonl"), text).unwrap();
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        std::io::Write::write_all(&mut enc, text.as_bytes()).unwrap();
        let bytes = enc.finish().unwrap();
        std::fs::write(gz.join(tasks::SAMPLES), &bytes).unwrap();
        let (a, b) = (prompt_scores(&gz).unwrap(), prompt_scores(&plain).unwrap());
        assert_eq!(a.scores, b.scores);
        assert_eq!(a.by_length, b.by_length);
        assert_eq!(a.ids_by_length, b.ids_by_length);
        assert_eq!(a.scores["niah_single_1.recall"], [1.0, 0.5]);
        assert!(
            prompt_scores(&dir).unwrap().scores.is_empty(),
            "no samples: empty"
        );
        std::fs::write(gz.join(tasks::SAMPLES), &bytes[..bytes.len() / 2]).unwrap();
        let e = format!("{:#}", prompt_scores(&gz).unwrap_err());
        assert!(e.contains("probe_samples.jsonl.gz"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
