//! What a dry run can tell of a grid's cells without training any: that each has a data set
//! (or the grid makes it), that its model can represent the data's vocabulary, that a shard
//! holds a whole training and evaluation sequence, that a cell continued from another has
//! that model's shape, that the grid's pretrained model is a converted model of the cells'
//! shape, and that an eval cell's tasks can read what they need (a text tokenizer, a chat
//! template, the haystack, the multiple-choice files, and the memory of the longest probes
//! where the cell's device is here to ask).

use super::grid::{Cell, Grid, StageKind};
use crate::config::{parse_device, Config, DeviceSpec};
use crate::data::{Meta, Shard, TOKENS_MAGIC};
use crate::io::checkpoint;
use crate::model::manifest;
use crate::run::resolve_with_data;
use crate::run::tasks;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::Device;

/// The problems that would stop cells at once when run: (cell, why) each.
pub(crate) fn problems(grid: &Grid, cells: &[Cell]) -> Vec<(String, String)> {
    let made = made_by_grid(grid);
    let mut shards: BTreeMap<PathBuf, Result<(usize, usize), String>> = BTreeMap::new();
    let mut resolved: BTreeMap<&str, Config> = BTreeMap::new();
    let mut pretrained: BTreeMap<PathBuf, Result<Shapes, String>> = BTreeMap::new();
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
                    sequence_problem(&cfg, cell.kind, longest).or_else(|| {
                        let eval = cell.kind == StageKind::Eval;
                        eval.then(|| tasks::preflight(&cfg, &meta, device_here(&cfg)).err())
                            .flatten()
                            .map(|e| format!("{e:#}"))
                    })
                }
            },
        };
        let why = why
            .or_else(|| shape_problem(cell, &cfg, &resolved))
            .or_else(|| pretrained_problem(cell, &cfg, &mut pretrained));
        if let Some(why) = why {
            out.push((cell.id.clone(), why));
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

/// The device a cell's memory can be checked on from here: the host for a CPU cell, a GPU
/// this machine has for one that asks for it; None where the cell's GPU is not here (a dry
/// run on a login node).
fn device_here(cfg: &Config) -> Option<Device> {
    match parse_device(&cfg.train.device).ok()? {
        DeviceSpec::Cpu => Some(Device::Cpu),
        DeviceSpec::Auto => Some(Device::cuda_if_available()),
        DeviceSpec::Cuda(n) => ((n as i64) < tch::Cuda::device_count()).then_some(Device::Cuda(n)),
    }
}

/// A model file's tensors: name and shape.
type Shapes = BTreeMap<String, Vec<usize>>;

/// The weights of the pretrained model directory `dir`, refused unless it is a converted
/// model: a `config.toml` and weights beside it.
fn pretrained_shapes(dir: &Path) -> Result<Shapes, String> {
    let shown = dir.display();
    if !dir.is_dir() {
        return Err(format!(
            "the grid's pretrained model {shown} does not exist: convert it first (`attnsweep \
             convert`; `make pretrained` makes pretrained/smollm2-135m-instruct)"
        ));
    }
    if !dir.join("config.toml").is_file() {
        let what = match dir.join("meta.json").is_file() {
            true => "a data set (meta.json)",
            false => "no config.toml",
        };
        return Err(format!(
            "the grid's pretrained model {shown} holds {what}, not a converted model: \
             `pretrained` names what `attnsweep convert --out` wrote"
        ));
    }
    let weights = checkpoint::weights_in(dir)
        .map_err(|e| format!("{e:#}"))?
        .ok_or_else(|| {
            format!(
                "the grid's pretrained model {shown} holds a config.toml but no weights (no \
                 model.safetensors): convert it again"
            )
        })?;
    checkpoint::tensor_shapes(&weights).map_err(|e| format!("{e:#}"))
}

/// A cell that starts from or evaluates the grid's pretrained model needs that model to be
/// there with the cell's shape: every tensor of the cell's model (the attention's own
/// additions aside) present with its shape.
fn pretrained_problem(
    cell: &Cell,
    cfg: &Config,
    cache: &mut BTreeMap<PathBuf, Result<Shapes, String>>,
) -> Option<String> {
    if cell.depends_on.is_some() {
        return None;
    }
    let dir = cell.pretrained.as_ref()?;
    let shapes = match cache
        .entry(dir.clone())
        .or_insert_with(|| pretrained_shapes(dir))
    {
        Ok(s) => s,
        Err(e) => return Some(e.clone()),
    };
    let wrong = manifest(&cfg.model).into_iter().find_map(|(name, want)| {
        let want: Vec<usize> = want.iter().map(|&d| d as usize).collect();
        match shapes.get(&name) {
            None => Some(format!("it has no {name}")),
            Some(got) if *got != want => {
                Some(format!("its {name} is {got:?}, the cell's {want:?}"))
            }
            Some(_) => None,
        }
    })?;
    Some(format!(
        "the grid's pretrained model {} is not of the cells' shape: {wrong} ([base.model] must \
         describe it: copy its config.toml's [model])",
        dir.display()
    ))
}

/// `problems` for the user: each reason once, with the cells it stops (at most 6 named).
pub(crate) fn describe(problems: &[(String, String)]) -> String {
    let pairs = problems.iter().map(|(c, w)| (c.as_str(), w.as_str()));
    let mut out = format!("{} cells would fail when run:", problems.len());
    for (why, cells) in super::by_reason(pairs, 6) {
        out += &format!("\n  {cells}: {why}");
    }
    out
}
