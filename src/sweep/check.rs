//! What a dry run can tell of a grid's cells without training any: that each has a data set
//! (or the grid makes it), that its model can represent the data's vocabulary, that a shard
//! holds a whole training and evaluation sequence, and that a cell continued from another has
//! that model's shape.

use super::grid::{Cell, Grid, StageKind};
use crate::config::Config;
use crate::data::{Meta, Shard, TOKENS_MAGIC};
use crate::model::manifest;
use crate::run::resolve_with_data;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The problems that would stop cells at once when run, one line each (`cell: why`).
pub(crate) fn problems(grid: &Grid, cells: &[Cell]) -> Vec<String> {
    let made = made_by_grid(grid);
    let mut shards: BTreeMap<PathBuf, Result<(usize, usize), String>> = BTreeMap::new();
    let mut resolved: BTreeMap<&str, Config> = BTreeMap::new();
    let mut out = Vec::new();
    for cell in cells {
        let mut cfg = cell.config.clone();
        let dir = cfg.data.dir.clone();
        let why = match dir.join("meta.json").exists() {
            // The grid writes this data set when it runs; nothing to read yet.
            false if made.as_deref() == Some(dir.as_path()) => None,
            false => Some(format!(
                "data.dir {} holds no data set (no meta.json), and the grid makes none there \
                 ([synth], [corpus] or [probes] make base.data.dir)",
                dir.display()
            )),
            true => match resolve_with_data(&mut cfg) {
                Err(e) => Some(format!("{e:#}")),
                Ok(meta) => {
                    let longest = shards
                        .entry(dir.clone())
                        .or_insert_with(|| largest_shards(&dir, &meta));
                    sequence_problem(&cfg, cell.kind, longest)
                }
            },
        };
        let why = why.or_else(|| shape_problem(cell, &cfg, &resolved));
        if let Some(why) = why {
            out.push(format!("{}: {why}", cell.id));
        }
        resolved.insert(&cell.id, cfg);
    }
    out
}

/// The data set the grid's own sections write, at `base.data.dir`.
fn made_by_grid(grid: &Grid) -> Option<PathBuf> {
    let makes = grid.synth.is_some() || grid.corpus.is_some() || grid.probes.is_some();
    let dir = grid.base.get("data")?.get("dir")?.as_str()?;
    makes.then(|| PathBuf::from(dir))
}

/// The largest shard of the train and of the val split, read off the shards' headers.
fn largest_shards(dir: &Path, meta: &Meta) -> Result<(usize, usize), String> {
    let largest = |names: &[String]| -> Result<usize, String> {
        names.iter().try_fold(0, |m, n| {
            let s = Shard::open(&dir.join(n), TOKENS_MAGIC).map_err(|e| format!("{e:#}"))?;
            Ok(m.max(s.len()))
        })
    };
    Ok((largest(&meta.train)?, largest(&meta.val)?))
}

/// A sequence (and its next token) lies inside one shard: training's `data.seq_len` in a
/// train shard, evaluation's length in a val shard.
fn sequence_problem(
    cfg: &Config,
    kind: StageKind,
    longest: &Result<(usize, usize), String>,
) -> Option<String> {
    let (train, val) = match longest {
        Ok(l) => *l,
        Err(e) => return Some(e.clone()),
    };
    let checks = [
        (
            kind == StageKind::Train,
            "train",
            train,
            cfg.data.seq_len,
            "data.seq_len",
        ),
        (true, "val", val, cfg.eval_seq_len(), cfg.eval_seq_len_key()),
    ];
    checks
        .into_iter()
        .find(|&(applies, _, largest, len, _)| applies && largest <= len)
        .map(|(_, split, largest, len, key)| {
            format!(
                "{key} = {len} is longer than any {split} shard of {} holds (its largest has \
                 {largest} tokens, and a sequence needs one more)",
                cfg.data.dir.display()
            )
        })
}

/// A train cell continued from another loads that cell's weights: its model must have the same
/// parameters and shapes (the attention's own additions aside).
fn shape_problem(cell: &Cell, cfg: &Config, resolved: &BTreeMap<&str, Config>) -> Option<String> {
    if cell.kind != StageKind::Train {
        return None;
    }
    let dep = resolved.get(cell.depends_on.as_deref()?)?;
    let (ours, theirs) = (manifest(&cfg.model), manifest(&dep.model));
    let differ = ours
        .iter()
        .zip(&theirs)
        .find(|(a, b)| a != b)
        .map(|(a, b)| format!("{} is {:?} here but {:?} there", a.0, a.1, b.1));
    let differ = differ.or_else(|| {
        (ours.len() != theirs.len()).then(|| {
            format!(
                "the models have {} and {} parameter tensors",
                ours.len(),
                theirs.len()
            )
        })
    })?;
    Some(format!(
        "it continues from {}, whose model has another shape: {differ}",
        cell.depends_on.as_deref().unwrap_or_default()
    ))
}
