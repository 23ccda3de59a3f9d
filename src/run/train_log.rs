//! A training run's logs (`train_log.csv`, `val_log.csv`): their columns, a row appended as
//! each step or validation finishes, and the rows a resumed run keeps (those up to its
//! checkpoint, under the current columns).

use crate::util::atomic;
use crate::util::fault;
use anyhow::{Context, Result};
use std::path::Path;

/// The validation log's columns.
pub(super) const VAL_LOG_HEADER: [&str; 2] = ["step", "val_loss"];

/// `reg` is the regulariser added to the loss and `mu_f` the mean hard gate; both empty for
/// methods without them. On a GPU, `peak_gib` is the most its tensors held since the row
/// before and `planned_gib` the memory plan's prediction of it (`memory::plan_on_device`).
/// On the CPU, `peak_gib` is the process's peak resident memory so far (the libraries'
/// own included) and `planned_gib` the lower bound the host was checked against
/// (`memory::check_training`).
pub(super) const LOG_HEADER: [&str; 10] = [
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "tokens_seen",
    "reg",
    "mu_f",
    "peak_gib",
    "planned_gib",
];

/// Keeps the header and rows up to `step` of a CSV log whose first column is the step, so a
/// resumed run does not repeat the rows an interrupted run wrote after its last checkpoint.
/// A row cut short by a crash (fewer fields than the header) is dropped too. A log written
/// with fewer columns than `header` (by an earlier version) gets `header`, its rows empty
/// fields for the new columns.
pub(super) fn truncate_log(path: &Path, step: usize, header: &[&str]) -> Result<()> {
    if !path.exists() {
        return Ok(());
    }
    let text = std::fs::read_to_string(path)?;
    let old = text.lines().next().unwrap_or_default();
    let fields = old.split(',').count();
    let widen = header.starts_with(&old.split(',').collect::<Vec<_>>()) && header.len() > fields;
    let pad = match widen {
        true => ",".repeat(header.len() - fields),
        false => String::new(),
    };
    let mut keep = String::new();
    for (i, line) in text.lines().enumerate() {
        let s: Option<usize> = line.split(',').next().and_then(|v| v.parse().ok());
        let whole = line.split(',').count() == fields;
        if i == 0 && widen {
            keep.push_str(&header.join(","));
            keep.push('\n');
        } else if i == 0 || (whole && s.is_some_and(|s| s <= step)) {
            keep.push_str(line);
            keep.push_str(if i == 0 { "" } else { &pad });
            keep.push('\n');
        }
    }
    atomic::write_bytes(path, keep.as_bytes())
}

/// Appends `row` to the CSV log at `path`, writing `header` first where the log is new.
pub(super) fn append_row(path: &Path, header: &[&str], row: &[String]) -> Result<()> {
    let fresh = !path.exists();
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    fault::write_error().with_context(|| format!("cannot write {}", path.display()))?;
    let mut w = csv::Writer::from_writer(f);
    if fresh {
        w.write_record(header)?;
    }
    w.write_record(row)?;
    w.flush()?;
    fault::point("log_row");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log of an earlier version's columns gets the new header, its rows padded, the
    /// rows past the step and a cut row dropped; a current log keeps its rows as they are.
    #[test]
    fn resumed_logs_keep_their_rows_under_the_new_columns() {
        let dir = crate::util::scratch_dir("truncate-log");
        let path = dir.join("train_log.csv");
        std::fs::write(&path, "step,loss\n1,2.5\n2,2.4\n3,2.3\n4\n").unwrap();
        truncate_log(&path, 2, &["step", "loss", "peak_gib"]).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "step,loss,peak_gib\n1,2.5,\n2,2.4,\n"
        );
        truncate_log(&path, 1, &["step", "loss", "peak_gib"]).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "step,loss,peak_gib\n1,2.5,\n"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
