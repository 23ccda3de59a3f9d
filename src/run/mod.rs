//! What train, eval, prune, export and bench share: the device a config names, the model
//! built from a resolved config with its parameter store, and a trained run loaded back from
//! its directory.

pub mod choice;
pub mod convert;
pub(crate) mod eval;
pub(crate) mod generate;
pub(crate) mod gguf;
pub(crate) mod journal;
pub(crate) mod memory;
pub(crate) mod optim;
pub(crate) mod presets;
pub(crate) mod probe_batch;
pub(crate) mod prune;
pub(crate) mod ranks;
pub(crate) mod report;
pub mod tasks;
pub(crate) mod train;
pub(crate) mod train_graph;
pub(crate) mod train_log;

use crate::config::{parse_device, Config, DeviceSpec, Dtype};
use crate::data;
use crate::io::checkpoint;
use crate::model::Llama;
use anyhow::{ensure, Context, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{nn, Device, Kind, Tensor};

pub(crate) fn resolve_device(spec: &str) -> Result<Device> {
    Ok(match parse_device(spec)? {
        DeviceSpec::Auto => Device::cuda_if_available(),
        DeviceSpec::Cpu => Device::Cpu,
        DeviceSpec::Cuda(n) => {
            ensure!(
                tch::Cuda::is_available(),
                "train.device = {spec:?} but no CUDA device is available"
            );
            ensure!(
                (n as i64) < tch::Cuda::device_count(),
                "train.device = {spec:?} but only {} CUDA devices exist",
                tch::Cuda::device_count()
            );
            Device::Cuda(n)
        }
    })
}

pub(crate) fn compute_kind(d: Dtype) -> Kind {
    match d {
        Dtype::Fp32 => Kind::Float,
        Dtype::Bf16 => Kind::BFloat16,
    }
}

/// A model with its parameter store, built from a fully resolved config.
pub struct Built {
    pub vs: nn::VarStore,
    pub model: Llama,
}

impl Built {
    pub fn new(cfg: &Config, device: Device) -> Result<Built> {
        let (m, a) = (&cfg.model, &cfg.attention);
        tch::manual_seed(cfg.train.seed as i64);
        let vs = nn::VarStore::new(device);
        let model = Llama::new(&vs.root(), m, a, compute_kind(cfg.train.dtype))?;
        let built = Built { vs, model };
        built.copy_derived(|_| true);
        Ok(built)
    }

    pub fn params(&self) -> BTreeMap<String, Tensor> {
        self.vs.variables().into_iter().collect()
    }

    /// Sets each parameter a method adds to a copy of the base parameter it starts from
    /// (L2A's global module, SwiAttn's window-branch output projection), for those `which`
    /// selects.
    pub(crate) fn copy_derived(&self, which: impl Fn(&str) -> bool) {
        let params = self.params();
        tch::no_grad(|| {
            for (dst, src) in self.model.derived_params() {
                if which(&dst) {
                    params[&dst].shallow_clone().copy_(&params[&src]);
                }
            }
        });
    }
}

/// A trained model loaded from its run directory, ready to evaluate.
pub(crate) struct LoadedRun {
    pub(crate) cfg: Config,
    /// The run's data set; None when opened without data.
    meta: Option<data::Meta>,
    pub(crate) device: Device,
    pub(crate) built: Built,
    /// The weight file that was loaded.
    pub(crate) weights: PathBuf,
    /// The training step of those weights (None for a bare weight file).
    pub(crate) step: Option<usize>,
    /// What loading converted (`LoadReport::conversion`).
    conversion: Option<String>,
}

/// The config of a run directory with `sets` applied: an error says whether the directory
/// holds no run or an override is at fault.
pub(crate) fn run_config(run: &Path, sets: &[String]) -> Result<Config> {
    let path = run.join("config.toml");
    ensure!(
        path.is_file(),
        "{} is not a run directory (no config.toml)",
        run.display()
    );
    Config::load(Some(&path), &[]).with_context(|| {
        format!(
            "{} is not a run directory with a valid config.toml",
            run.display()
        )
    })?;
    Config::load(Some(&path), sets)
}

impl LoadedRun {
    /// The run's saved config with `sets` applied, its data set (unless `with_data` is false:
    /// reading weights needs none when the config names its vocabulary), and the weights of
    /// `ckpt` (a checkpoint directory or .safetensors file) or of the run's latest checkpoint.
    pub(crate) fn open(
        run: &Path,
        sets: &[String],
        ckpt: Option<&Path>,
        with_data: bool,
    ) -> Result<LoadedRun> {
        let mut cfg = run_config(run, sets)?;
        let meta = match with_data || cfg.model.vocab_size == 0 {
            true => Some(resolve_with_data(&mut cfg)?),
            false => None,
        };
        let device = resolve_device(&cfg.train.device)?;
        let weights = checkpoint::resolve_weights(ckpt.unwrap_or(run))?;
        memory::check_model(&cfg, device)?;
        let built = Built::new(&cfg, device)?;
        let report = checkpoint::load_into(
            &built.params(),
            &weights,
            true,
            checkpoint::precision_of(&weights),
        )?;
        Ok(LoadedRun {
            conversion: report.conversion(),
            step: checkpoint::step_of(&weights),
            cfg,
            meta,
            device,
            built,
            weights,
        })
    }

    /// The run's data set.
    pub(crate) fn meta(&self) -> Result<&data::Meta> {
        self.meta
            .as_ref()
            .context("the run was opened without its data set")
    }

    /// Says on stderr what loading the weights converted, and when they are not those of
    /// the finished run.
    pub(crate) fn report_load(&self) {
        if let Some(c) = &self.conversion {
            eprintln!("{}: {c}", self.weights.display());
        }
        if let Some(step) = self.step.filter(|&s| s < self.cfg.train.steps) {
            eprintln!(
                "warning: evaluating the checkpoint of step {step}, before training finished \
                 (train.steps = {}); eval.json records the step",
                self.cfg.train.steps
            );
        }
    }
}

/// Resolves settings that depend on the data set (the vocabulary size) and checks the
/// model can represent it.
pub(crate) fn resolve_with_data(cfg: &mut Config) -> Result<data::Meta> {
    ensure!(!cfg.data.dir.as_os_str().is_empty(), "data.dir is not set: point it at a directory made by `attnsweep data prepare` or `data synth`");
    let meta = data::read_meta(&cfg.data.dir)?;
    if cfg.model.vocab_size == 0 {
        cfg.model.vocab_size = meta.vocab_size;
        cfg.validate().with_context(|| {
            format!(
                "model.vocab_size comes from {}",
                cfg.data.dir.join("meta.json").display()
            )
        })?;
    }
    // Probes default to the settings the data set's probe documents were written with.
    if let Some(p) = &meta.probes {
        let e = &mut cfg.eval;
        e.digits = e.digits.or(Some(p.digits));
        e.needles = e.needles.or(Some(p.needles));
        e.queries = e.queries.or(Some(p.queries));
    }
    ensure!(
        cfg.model.vocab_size >= meta.vocab_size,
        "model.vocab_size = {} is smaller than the data set's vocabulary ({})",
        cfg.model.vocab_size,
        meta.vocab_size
    );
    Ok(meta)
}
