//! Checkpoints of a run directory:
//!
//! ```text
//! <run>/checkpoints/step_00000200/{model.safetensors, optim.safetensors, state.json}
//! <run>/checkpoints/latest          the name of the newest complete checkpoint
//! ```
//!
//! A checkpoint is written into a temporary directory and renamed into place, then `latest`
//! is replaced atomically, so an interruption at any point leaves the previous checkpoint
//! intact and `latest` never names a partial one.

use crate::util::atomic;
use crate::util::fault;
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// Everything besides tensors that a resumed run needs to continue exactly.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct TrainState {
    /// Optimizer steps completed.
    pub(crate) step: usize,
    /// State of the data-sampling generator after `step` steps.
    pub(crate) rng_state: u64,
    /// State of the generator behind random gates (Bernoulli routers, L2A's p_force).
    pub(crate) gate_rng_state: u64,
    pub(crate) tokens_seen: u64,
}

pub(crate) fn checkpoints_dir(run: &Path) -> PathBuf {
    run.join("checkpoints")
}

/// The newest complete checkpoint of a run, if any.
pub(crate) fn latest(run: &Path) -> Result<Option<PathBuf>> {
    let p = checkpoints_dir(run).join("latest");
    match std::fs::read_to_string(&p) {
        Ok(name) => {
            ensure!(
                !name.trim().is_empty(),
                "{} is empty; it should name the newest checkpoint directory beside it (such as \
                 step_00000200): write that name into it, or remove the run to start again",
                p.display()
            );
            let dir = checkpoints_dir(run).join(name.trim());
            ensure!(
                dir.is_dir(),
                "{} names {}, which does not exist",
                p.display(),
                dir.display()
            );
            Ok(Some(dir))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", p.display())),
    }
}

/// The optimizer state's file in a checkpoint directory.
pub(crate) const OPTIMIZER_FILE: &str = "optim.safetensors";

/// Removes the optimizer state of every checkpoint of `run` (its weights and state stay), for
/// a finished run that will not be resumed (`sweep --drop-optimizer`).
pub(crate) fn drop_optimizer_state(run: &Path) -> Result<()> {
    let root = checkpoints_dir(run);
    let Ok(entries) = std::fs::read_dir(&root) else {
        return Ok(());
    };
    for entry in entries {
        let path = entry?.path().join(OPTIMIZER_FILE);
        if path.is_file() {
            std::fs::remove_file(&path)
                .with_context(|| format!("cannot remove {}", path.display()))?;
        }
    }
    Ok(())
}

/// Writes a checkpoint for `state.step` and keeps the newest `keep` of them.
pub(crate) fn save(
    run: &Path,
    model: &[(String, Tensor)],
    optim: &[(String, Tensor)],
    state: &TrainState,
    keep: usize,
) -> Result<PathBuf> {
    let root = checkpoints_dir(run);
    std::fs::create_dir_all(&root).with_context(|| format!("cannot create {}", root.display()))?;
    let name = format!("step_{:08}", state.step);
    let final_dir = root.join(&name);
    let tmp = root.join(format!(".tmp-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    let written = (|| -> Result<()> {
        Tensor::write_safetensors(model, tmp.join("model.safetensors"))?;
        fault::point("checkpoint_files");
        fault::write_error()?;
        Tensor::write_safetensors(optim, tmp.join(OPTIMIZER_FILE))?;
        std::fs::write(tmp.join("state.json"), serde_json::to_string_pretty(state)?)?;
        for f in ["model.safetensors", OPTIMIZER_FILE, "state.json"] {
            std::fs::File::open(tmp.join(f))?.sync_all()?;
        }
        if final_dir.exists() {
            // A checkpoint of this step from an interrupted earlier attempt: replace it.
            std::fs::remove_dir_all(&final_dir)?;
        }
        std::fs::rename(&tmp, &final_dir)?;
        fault::point("checkpoint_renamed");
        Ok(())
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e).with_context(|| format!("writing checkpoint {}", final_dir.display()));
    }
    atomic::write_bytes(&root.join("latest"), name.as_bytes())?;
    prune(&root, keep, &name)?;
    Ok(final_dir)
}

/// Removes what crashed processes left half-written: checkpoint directories, and the file
/// that was to replace `latest`.
pub(crate) fn remove_temporaries(run: &Path) -> Result<()> {
    let root = checkpoints_dir(run);
    let Ok(entries) = std::fs::read_dir(&root) else {
        return Ok(());
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(".tmp-") {
            let path = e.path();
            match path.is_dir() {
                true => std::fs::remove_dir_all(&path),
                false => std::fs::remove_file(&path),
            }
            .with_context(|| format!("removing {}", path.display()))?;
        }
    }
    Ok(())
}

/// Keeps `latest` (the checkpoint just written) and the newest `keep - 1` others. A run
/// resumed from an older `latest` (one interrupted before it named a newer checkpoint) can
/// leave checkpoints of higher steps behind: they never count against `latest`.
fn prune(root: &Path, keep: usize, latest: &str) -> Result<()> {
    let mut steps: Vec<PathBuf> = std::fs::read_dir(root)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_dir()
                && p.file_name().is_some_and(|n| {
                    let n = n.to_string_lossy();
                    n.starts_with("step_") && n != latest
                })
        })
        .collect();
    steps.sort();
    let n = steps.len();
    for old in steps
        .into_iter()
        .take(n.saturating_sub(keep.saturating_sub(1)))
    {
        std::fs::remove_dir_all(&old)
            .with_context(|| format!("removing old checkpoint {}", old.display()))?;
    }
    Ok(())
}

pub(crate) fn read_state(ckpt: &Path) -> Result<TrainState> {
    let p = ckpt.join("state.json");
    let text =
        std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is malformed", p.display()))
}

/// The names and shapes of a safetensors file's tensors, read from its header alone (the
/// file mapped, no tensor read).
pub(crate) fn tensor_shapes(path: &Path) -> Result<BTreeMap<String, Vec<usize>>> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // Safety: the file is only read while the map lives.
    let map = unsafe { memmap2::Mmap::map(&f) }
        .with_context(|| format!("cannot map {}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&map).map_err(|e| {
        anyhow::anyhow!(
            "{} is not a readable safetensors file (truncated or corrupt?): {e:?}",
            path.display()
        )
    })?;
    Ok(st
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, view.shape().to_vec()))
        .collect())
}

pub fn read_tensors(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    ensure!(
        path.is_file(),
        "checkpoint file {} does not exist",
        path.display()
    );
    let list = Tensor::read_safetensors(path).with_context(|| {
        format!(
            "{} is not a readable safetensors file (truncated or corrupt?)",
            path.display()
        )
    })?;
    Ok(list.into_iter().collect())
}

/// The weights a directory holds: its own `model.safetensors` (a checkpoint directory, a
/// pruned model), else its latest checkpoint's; None when neither is there (a run kept
/// without its weights). An unreadable `checkpoints/latest` is an error.
pub(crate) fn weights_in(dir: &Path) -> Result<Option<PathBuf>> {
    let own = dir.join("model.safetensors");
    if own.is_file() {
        return Ok(Some(own));
    }
    Ok(latest(dir)?
        .map(|ckpt| ckpt.join("model.safetensors"))
        .filter(|w| w.is_file()))
}

/// Resolves what `--init-from` or `eval --ckpt` may name: a run directory (its latest
/// checkpoint), a checkpoint directory, or a `.safetensors` file.
pub(crate) fn resolve_weights(path: &Path) -> Result<PathBuf> {
    if path.is_file() {
        return Ok(path.to_path_buf());
    }
    if path.is_dir() {
        return weights_in(path)?.with_context(|| {
            format!(
                "{} holds no weights (no model.safetensors, and no checkpoints/latest naming a \
                 checkpoint with one)",
                path.display()
            )
        });
    }
    bail!("{} does not exist", path.display())
}

/// The training step of a weight file that sits in a checkpoint directory (beside its
/// `state.json`); None for a bare weight file.
pub(crate) fn step_of(weights: &Path) -> Option<usize> {
    let dir = weights.parent()?;
    dir.join("state.json")
        .is_file()
        .then(|| read_state(dir).ok().map(|s| s.step))
        .flatten()
}

/// How loading a weight file into a model went.
#[derive(Debug, Default)]
pub struct LoadReport {
    pub(crate) loaded: Vec<String>,
    /// Model parameters the file did not have (left at their initialisation).
    pub(crate) initialised: Vec<String>,
    /// File tensors no model parameter has.
    pub(crate) unused: Vec<String>,
    /// Loaded tensors of another float type, converted to the parameters', with the type
    /// each was stored in.
    pub(crate) converted: Vec<(String, Kind)>,
}

impl LoadReport {
    /// What the load converted, for the user: `3 tensors converted from bf16 to the
    /// parameters' fp32`; None where nothing was.
    pub(crate) fn conversion(&self) -> Option<String> {
        let name = |k: Kind| match k {
            Kind::Half => "fp16",
            Kind::BFloat16 => "bf16",
            Kind::Double => "fp64",
            Kind::Float => "fp32",
            _ => "another type",
        };
        let from: std::collections::BTreeSet<&str> =
            self.converted.iter().map(|(_, k)| name(*k)).collect();
        (!self.converted.is_empty()).then(|| {
            let n = self.converted.len();
            format!(
                "{n} tensor{} converted from {} to the parameters' fp32",
                if n == 1 { "" } else { "s" },
                from.into_iter().collect::<Vec<_>>().join(" and ")
            )
        })
    }
}

/// Which element types a load accepts beside the parameters' own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// The parameters' type exactly: the run's own checkpoints, which hold fp32 parameters.
    Exact,
    /// Any floating-point type, converted: a model file stating its own (`convert --dtype`
    /// writes bf16 or fp16 ones). The load report lists the tensors converted.
    AnyFloat,
}

/// What a load of `path` may convert: a step checkpoint of a run (`checkpoints/step_N/`) holds
/// the parameters as trained, so nothing; a model file (converted or exported) any float type.
pub(crate) fn precision_of(path: &Path) -> Precision {
    match step_of(path) {
        Some(_) => Precision::Exact,
        None => Precision::AnyFloat,
    }
}

/// The tensor `name` of `path` as a parameter takes it: the right shape, a float type the load
/// allows, finite values; an error naming the tensor otherwise.
fn check_tensor(
    path: &Path,
    name: &str,
    t: &Tensor,
    p: &Tensor,
    precision: Precision,
) -> Result<()> {
    ensure!(
        t.size() == p.size(),
        "{}: tensor {name} has shape {:?}, the model expects {:?}",
        path.display(),
        t.size(),
        p.size()
    );
    let float = matches!(
        t.kind(),
        Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16
    );
    ensure!(
        float,
        "{}: tensor {name} holds {:?} values, not floating point: it is not a weight of this \
         model",
        path.display(),
        t.kind()
    );
    ensure!(
        precision == Precision::AnyFloat || t.kind() == p.kind(),
        "{}: tensor {name} is {:?} where the model holds {:?}; a checkpoint of a run holds its \
         parameters as trained, so this one was changed after it was written",
        path.display(),
        t.kind(),
        p.kind()
    );
    let bad = t.isfinite().logical_not().sum(Kind::Int64).int64_value(&[]);
    ensure!(
        bad == 0,
        "{}: tensor {name} holds {bad} non-finite values (NaN or infinite); these weights \
         cannot be trained or evaluated",
        path.display()
    );
    Ok(())
}

/// Copies tensors into `params` by name. With `strict`, every parameter must be filled and
/// every tensor used; without it, missing parameters keep their initialisation (continued
/// pretraining into a model with new parts). Each tensor must have its parameter's shape, a
/// float type `precision` allows and finite values; nothing is copied unless the whole file
/// checks out.
pub fn load_into(
    params: &BTreeMap<String, Tensor>,
    path: &Path,
    strict: bool,
    precision: Precision,
) -> Result<LoadReport> {
    let file = read_tensors(path)?;
    let mut report = LoadReport::default();
    for (name, p) in params {
        match file.get(name) {
            Some(t) => {
                check_tensor(path, name, t, p, precision)?;
                if t.kind() != p.kind() {
                    report.converted.push((name.clone(), t.kind()));
                }
                report.loaded.push(name.clone())
            }
            None => report.initialised.push(name.clone()),
        }
    }
    report.unused = file
        .keys()
        .filter(|k| !params.contains_key(*k))
        .cloned()
        .collect();
    if strict && (!report.initialised.is_empty() || !report.unused.is_empty()) {
        // L2A's global module gained its input norm: a checkpoint from before lacks only that.
        let l2a_before_norm = report
            .initialised
            .iter()
            .all(|n| n.ends_with("global_attn.norm.weight"));
        bail!(
            "{} does not match the model: missing {:?}, unexpected {:?}{}",
            path.display(),
            report.initialised,
            report.unused,
            match l2a_before_norm && report.unused.is_empty() {
                true =>
                    "; it is an L2A model from before the global module read its own norm of \
                         the stream after the window (RMSNorm_g(h + s)): train it again, or start \
                         a new run from it with --init-from",
                false => "",
            }
        );
    }
    tch::no_grad(|| {
        for name in &report.loaded {
            let mut p = params[name].shallow_clone();
            p.copy_(&file[name]);
        }
    });
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util;
    use tch::{Device, Kind};

    fn save_step(run: &Path, step: usize, keep: usize) -> PathBuf {
        let w = vec![(
            "w".to_string(),
            Tensor::ones([2], (Kind::Float, Device::Cpu)),
        )];
        let state = TrainState {
            step,
            rng_state: 1,
            gate_rng_state: 2,
            tokens_seen: 3,
        };
        save(run, &w, &w, &state, keep).unwrap()
    }

    #[test]
    fn leftovers_of_a_crash_are_removed_files_and_directories_alike() {
        let run = util::scratch_dir("ckpt-leftovers");
        save_step(&run, 100, 2);
        let root = checkpoints_dir(&run);
        // A crash while replacing `latest`, and one while writing a checkpoint.
        std::fs::write(root.join(".tmp-77-latest"), b"step_00000200").unwrap();
        std::fs::create_dir_all(root.join(".tmp-78-step_00000200")).unwrap();
        remove_temporaries(&run).unwrap();
        let left: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(left.iter().all(|n| !n.starts_with(".tmp-")), "{left:?}");
        assert_eq!(latest(&run).unwrap(), Some(root.join("step_00000100")));
        std::fs::remove_dir_all(&run).unwrap();
    }

    #[test]
    fn pruning_never_removes_the_checkpoint_latest_names() {
        let run = util::scratch_dir("ckpt-prune");
        let s200 = save_step(&run, 200, 1);
        // A crash after step 400's directory was renamed into place, before `latest` named
        // it: the resumed run goes on from step 200 and saves step 300.
        let s400 = checkpoints_dir(&run).join("step_00000400");
        std::fs::create_dir_all(&s400).unwrap();
        for f in ["model.safetensors", OPTIMIZER_FILE, "state.json"] {
            std::fs::copy(s200.join(f), s400.join(f)).unwrap();
        }
        let s300 = save_step(&run, 300, 1);
        assert_eq!(latest(&run).unwrap(), Some(s300.clone()));
        assert!(s300.is_dir() && !s200.exists() && !s400.exists());
        // keep 2: latest and the newest other.
        let s500 = save_step(&run, 500, 2);
        assert!(s500.is_dir() && s300.is_dir());
        save_step(&run, 600, 2);
        assert!(!s300.exists() && s500.is_dir());
        std::fs::remove_dir_all(&run).unwrap();
    }
}
