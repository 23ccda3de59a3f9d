//! Making finished cells' weights again (`sweep --retrain`): a results folder keeps a cell's
//! record without its weights, and a cell that evaluates, prunes or continues from it needs
//! them. Which cells to train again, that a run restricted by `--cell` lists them, and their
//! earlier files set aside so nothing of the first run is lost.

use super::grid::{Cell, StageKind};
use super::status::{read_status, State, Status};
use crate::io::checkpoint;
use anyhow::{ensure, Context, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Whether a finished cell's folder lacks the weights it made (a results folder is kept
/// without them): a train cell's latest checkpoint's, a prune cell's `model.safetensors`. An
/// unreadable `checkpoints/latest` is an error, not weights gone.
pub(super) fn weights_gone(dir: &Path) -> Result<bool> {
    Ok(checkpoint::weights_in(dir)?.is_none())
}

/// Whether running `cell` now reads the weights of the cell it depends on: an evaluation or a
/// pruning always, a train cell unless it has a checkpoint of its own to resume from (one
/// stopped before its first checkpoint starts again from the dependency's weights). An
/// unreadable `checkpoints/latest` is left to the cell's own run to report.
pub(super) fn reads_dependency(cell: &Cell, dir: &Path) -> bool {
    cell.depends_on.is_some()
        && (cell.kind != StageKind::Train || matches!(checkpoint::weights_in(dir), Ok(None)))
}

/// The finished cells of the grid (`cells`) that made weights (train and prune cells) whose
/// weights are gone and which a cell of `chosen` that this run will start reads, and what
/// those read in turn where their weights are gone too. `will_run` says which unfinished
/// cells run.
pub(super) fn to_retrain(
    cells: &[Cell],
    chosen: &[&Cell],
    out: &Path,
    will_run: impl Fn(&Status) -> bool,
) -> BTreeSet<String> {
    let done = |id: &str| read_status(&out.join(id)).is_some_and(|s| s.state == State::Done);
    let makers: BTreeMap<&str, &Cell> = cells
        .iter()
        .filter(|c| c.kind != StageKind::Eval)
        .map(|c| (c.id.as_str(), c))
        .collect();
    let mut needed: Vec<&str> = chosen
        .iter()
        .filter(|c| read_status(&out.join(&c.id)).is_none_or(|s| will_run(&s)))
        .filter(|c| reads_dependency(c, &out.join(&c.id)))
        .filter_map(|c| c.depends_on.as_deref())
        .collect();
    let mut again = BTreeSet::new();
    while let Some(id) = needed.pop() {
        let Some(cell) = makers.get(id) else { continue };
        let gone = weights_gone(&out.join(id)).unwrap_or(false);
        if again.contains(id) || !done(id) || !gone {
            continue;
        }
        again.insert(id.to_string());
        needed.extend(cell.depends_on.as_deref());
    }
    again
}

/// Moves a cell's files, all but its lock, into a new `before_retrain/` (or
/// `before_retrain.N/`) of its folder, so a cell trained again loses none of its earlier run.
pub(super) fn set_aside(dir: &Path) -> Result<()> {
    let aside = (0..)
        .map(|n| match n {
            0 => dir.join("before_retrain"),
            n => dir.join(format!("before_retrain.{n}")),
        })
        .find(|p| !p.exists())
        .expect("an unused name");
    std::fs::create_dir(&aside).with_context(|| format!("cannot create {}", aside.display()))?;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name == "lock" || name.starts_with("before_retrain") {
            continue;
        }
        std::fs::rename(&path, aside.join(&*name))
            .with_context(|| format!("cannot move {} aside", path.display()))?;
    }
    Ok(())
}

/// Refuses a run restricted by `--cell` whose listed cells read weights that must be made
/// again by a cell it does not list (`again`, from `to_retrain`): only listed cells run, so
/// the command that works names them too.
pub(super) fn ensure_listed(
    again: &BTreeSet<String>,
    cells: &[Cell],
    chosen: &[&Cell],
) -> Result<()> {
    let unlisted: Vec<&Cell> = cells
        .iter()
        .filter(|c| again.contains(&c.id) && !chosen.iter().any(|l| l.id == c.id))
        .collect();
    let mut all: BTreeSet<usize> = chosen.iter().map(|c| c.index).collect();
    all.extend(unlisted.iter().map(|c| c.index));
    ensure!(
        unlisted.is_empty(),
        "--retrain makes again only cells --cell lists, and the listed cells need the weights \
         of {}, which are gone; list {} too: --cell {}",
        unlisted
            .iter()
            .map(|c| format!("{} (cell {})", c.id, c.index))
            .collect::<Vec<_>>()
            .join(", "),
        if unlisted.len() == 1 { "it" } else { "them" },
        all.iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(",")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A train cell's weights are its latest checkpoint's, a prune cell's its own
    /// `model.safetensors`; either missing is gone, and a `latest` naming nothing is an error
    /// to show, not weights to make again. A continued cell reads its dependency's weights
    /// until it has a checkpoint of its own.
    #[test]
    fn weights_are_found_where_each_kind_of_cell_writes_them() {
        let root = std::env::temp_dir().join(format!("attnsweep-weights-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (train, prune) = (root.join("train"), root.join("prune"));
        let step = train.join("checkpoints/step_00000004");
        std::fs::create_dir_all(&step).unwrap();
        std::fs::create_dir_all(&prune).unwrap();
        std::fs::write(train.join("checkpoints/latest"), "step_00000004").unwrap();
        std::fs::write(step.join("model.safetensors"), b"w").unwrap();
        std::fs::write(prune.join("model.safetensors"), b"w").unwrap();
        assert!(!weights_gone(&train).unwrap());
        assert!(!weights_gone(&prune).unwrap());
        // A continued train cell with a checkpoint of its own resumes from it; one stopped
        // before its first (a config written, no weights) starts from its dependency again.
        let grid: super::super::Grid = toml::from_str(
            "name = \"t\"\n[[stage]]\nname = \"base\"\n[[stage]]\nname = \"more\"\n\
             init_from = \"base\"\n",
        )
        .unwrap();
        let cells = super::super::expand(&grid).unwrap();
        let more = cells.iter().find(|c| c.stage == "more").unwrap();
        assert!(!reads_dependency(more, &train));
        std::fs::write(root.join("config.toml"), "").unwrap();
        assert!(reads_dependency(more, &root));
        assert!(
            !reads_dependency(&cells[0], &root),
            "the base depends on nothing"
        );
        std::fs::remove_file(step.join("model.safetensors")).unwrap();
        std::fs::remove_file(prune.join("model.safetensors")).unwrap();
        assert!(weights_gone(&train).unwrap());
        assert!(weights_gone(&prune).unwrap());
        std::fs::write(train.join("checkpoints/latest"), "step_00000008").unwrap();
        let e = format!("{:#}", weights_gone(&train).unwrap_err());
        assert!(e.contains("does not exist"), "{e}");
        let _ = std::fs::remove_dir_all(&root);
    }
}
