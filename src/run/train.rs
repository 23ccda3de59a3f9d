//! Training: the optimizer's steps (`optim.rs`: AdamW with linear warm-up and cosine decay)
//! with gradient clipping and accumulation, atomic checkpoints, exact resume, continued
//! pretraining from another run's weights.

use crate::config;
use crate::config::Config;
use crate::config::RESUME_MAY_CHANGE;
use crate::data::{self, Split};
use crate::io::checkpoint::{self, Precision, TrainState};
use crate::model::attention::{spec, ForwardCtx, GateOverride, UsageRamp};
use crate::model::kernels;
use crate::model::kernels::Kernels;
use crate::model::step::forward_backward;
use crate::run::eval;
use crate::run::memory;
use crate::run::memory::{MemoryPlan, GIB};
use crate::run::optim::{is_router, learning_rate, penalty_scale, AdamW};
use crate::run::ranks::{self, Place, Team};
use crate::run::report;
use crate::run::train_graph::{self, Graphs};
use crate::run::train_log::{append_row, truncate_log, LOG_HEADER, VAL_LOG_HEADER};
use crate::run::{resolve_device, resolve_with_data, Built};
use crate::util::atomic;
use crate::util::fault;
use crate::util::progress::Progress;
use crate::util::rng::Rng;
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tch::{Device, Tensor};

/// The parameters `train.freeze_mlp` keeps fixed (L2A E.1.3: only attention, routers and
/// norms learn): the MLPs, the token embedding and the output head, tied or not.
pub(crate) fn frozen_by_freeze_mlp(name: &str) -> bool {
    name.contains(".mlp.")
        || name.starts_with("model.embed_tokens.")
        || name.starts_with("lm_head.")
}

/// Options of one `attnsweep train` invocation beyond the config.
pub(crate) struct TrainArgs {
    pub(crate) out: PathBuf,
    pub(crate) resume: bool,
    pub(crate) init_from: Option<PathBuf>,
    /// Stop (with a checkpoint) once this many steps are done, leaving the run resumable;
    /// the schedule still spans `train.steps`.
    pub(crate) stop_at: Option<usize>,
    pub(crate) quiet: bool,
    /// Seconds between status lines when stderr is not a terminal.
    pub(crate) status_every: u64,
    /// This process's place in a data-parallel job; None for a process training alone.
    pub(crate) place: Option<Place>,
}

impl TrainArgs {
    /// Whether this process writes the run's files: alone, or rank 0 of a job.
    fn leads(&self) -> bool {
        self.place.as_ref().is_none_or(Place::leads)
    }
}

/// What a resumed run changes against the config.toml it was started with: only settings that
/// leave the run's computation as it was (`config::RESUME_MAY_CHANGE`); any other difference
/// is an error naming each setting, before anything is written.
fn resume_changes(cfg_path: &Path, cfg: &Config) -> Result<Vec<(String, String, String)>> {
    let saved = Config::load(Some(cfg_path), &[])?;
    let (changed, refused): (Vec<_>, Vec<_>) = saved
        .differences(cfg)
        .into_iter()
        .partition(|(key, _, _)| config::resume_may_change(key));
    ensure!(
        refused.is_empty(),
        "--resume continues the run as {} describes it, and these settings would change it: {}. \
         A resumed run may change only {}; for other settings start a new run (--init-from \
         takes this one's weights)",
        cfg_path.display(),
        refused
            .iter()
            .map(|(k, was, now)| format!("{k} (saved {was}, now {now})"))
            .collect::<Vec<_>>()
            .join(", "),
        RESUME_MAY_CHANGE.join(", ")
    );
    Ok(changed)
}

pub(crate) fn train(mut cfg: Config, args: &TrainArgs) -> Result<()> {
    let prepared = prepare(&mut cfg, args)?;
    let mut t = Trainer::new(&cfg, args, prepared)?;
    t.record_run()?;
    let last = args
        .stop_at
        .map_or(cfg.train.steps, |s| s.min(cfg.train.steps));
    let start = t.state.step;
    while t.state.step < last {
        let step = t.step()?;
        if t.state.step == start + 1 && !args.quiet && args.leads() {
            // What the step ran, not what the config asks: a join that ran apart would show.
            let (n, rows) = step.passes;
            let plural = if n == 1 { "" } else { "es" };
            eprintln!("a step runs {n} pass{plural} of {rows} sequences on each rank");
        }
        t.record(&step, last)?;
    }
    t.finish()
}

/// What a run records of the data set it trains on (`data.json`), so that a resumed run can
/// tell whether the data set under `data.dir` is still that one.
#[derive(Serialize, Deserialize, PartialEq, Debug)]
struct DataRecord {
    dir: String,
    /// `data::identity`: the hash of its `meta.json`, which holds the hash of its shards.
    meta_sha256: String,
}

fn data_record_path(out: &Path) -> PathBuf {
    out.join("data.json")
}

/// Refuses to resume on a data set other than the one the run started on (replaced under the
/// same directory: another seed, another corpus), or on shards changed under its `meta.json`.
/// Runs started before the record was kept are not checked.
fn check_same_data(out: &Path, dir: &Path) -> Result<()> {
    let path = data_record_path(out);
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(());
    };
    let started: DataRecord =
        serde_json::from_str(&text).with_context(|| format!("{} is malformed", path.display()))?;
    let now = data::identity(dir)?;
    ensure!(
        started.meta_sha256 == now,
        "--resume: the data set at {} is not the one this run started on (its meta.json hashed \
         {} then and {now} now: regenerated, or another corpus); a resumed run continues on the \
         data it started with, so restore that data set, or start a new run on this one \
         (--init-from {} takes this run's weights)",
        dir.display(),
        started.meta_sha256,
        out.display()
    );
    data::check_shards(dir).context("--resume: a run continues on the data it started with")
}

/// A run directory ready to train into: checked against what it holds, with its data split,
/// the device, the lock that keeps other trainers out, and the weights a fresh continued
/// run starts from.
struct Prepared {
    device: Device,
    train_split: Split,
    val_split: Split,
    /// Held for the whole run by the process that writes it: the OS releases it when the
    /// process dies.
    _lock: Option<std::fs::File>,
    init_from: Option<PathBuf>,
    /// Settings a resumed run changes (`resume_changes`), as (key, was, now).
    changed: Vec<(String, String, String)>,
    /// The memory plan from the config alone (on a GPU, planned again once the model is
    /// there: `memory::plan_on_device`).
    plan: MemoryPlan,
}

/// Checks the run directory, the data and the memory before anything is written, then takes
/// the directory's lock. What records the run (`config.toml`, `init_from.txt`) is written once
/// its weights are in place (`Trainer::record_run`), so a run that fails before (an
/// `--init-from` that does not fit) leaves nothing that blocks a second try.
fn prepare(cfg: &mut Config, args: &TrainArgs) -> Result<Prepared> {
    let out = &args.out;
    let cfg_path = out.join("config.toml");
    if args.resume {
        ensure!(
            cfg_path.is_file(),
            "--resume: {} holds no run (no config.toml)",
            out.display()
        );
    } else if args.leads() && (cfg_path.exists() || checkpoint::checkpoints_dir(out).exists()) {
        bail!(
            "{} already holds a run; pass --resume to continue it or choose another --out",
            out.display()
        );
    }
    // A replaced data set is named as such before its settings (its vocabulary) are compared.
    if args.resume {
        check_same_data(out, &cfg.data.dir)?;
    }
    let meta = resolve_with_data(cfg)?;
    let changed = if args.resume {
        resume_changes(&cfg_path, cfg)?
    } else {
        Vec::new()
    };
    let device = match &args.place {
        Some(p) => ranks::device_of(&cfg.train.device, p.local)?,
        None => resolve_device(&cfg.train.device)?,
    };
    let train_split = Split::open(&cfg.data.dir, &meta, "train")?;
    let val_split = Split::open(&cfg.data.dir, &meta, "val")?;
    // A sequence (and its next token) lies inside one shard. The final evaluation needs one
    // of the val split: found out now, not after the last step.
    for (split, name, len, key) in [
        (&train_split, "train", cfg.data.seq_len, "data.seq_len"),
        (
            &val_split,
            "val",
            cfg.eval_seq_len(),
            cfg.eval_seq_len_key(),
        ),
    ] {
        ensure!(
            split.largest_shard() > len,
            "the {name} split of {} has no shard of more than {key} = {len} tokens (its largest \
             has {}); lower {key} or prepare the data set with larger shards",
            cfg.data.dir.display(),
            split.largest_shard()
        );
    }
    let plan = memory::check_training(cfg, device)?;
    atomic::ensure_writable_dir(out)?;
    // One trainer (or job) per run directory; the OS releases the lock when the process dies.
    let lock = match args.leads() {
        true => {
            let lock = atomic::lock_file(&out.join("train.lock"))?;
            ensure!(
                lock.is_some(),
                "another attnsweep process is training into {}",
                out.display()
            );
            lock
        }
        false => None,
    };
    Ok(Prepared {
        device,
        train_split,
        val_split,
        _lock: lock,
        init_from: init_source(args)?,
        changed,
        plan,
    })
}

/// The weights a continued-pretraining run starts from: `--init-from`, or on resume what
/// `init_from.txt` recorded, so that a run resumed before its first checkpoint starts again from
/// the same weights. The path's own bytes, so a path that is not UTF-8 comes back unchanged; a
/// relative record is relative to the run's directory (see `record_run`).
fn init_source(args: &TrainArgs) -> Result<Option<PathBuf>> {
    let init_record = args.out.join("init_from.txt");
    Ok(match &args.init_from {
        Some(src) if !args.resume => {
            Some(std::fs::canonicalize(src).unwrap_or_else(|_| src.clone()))
        }
        _ if args.resume => std::fs::read(&init_record).ok().map(|mut bytes| {
            // A newline added by an editor is not part of the path.
            if bytes.last() == Some(&b'\n') {
                bytes.pop();
            }
            args.out.join(std::ffi::OsStr::from_bytes(&bytes))
        }),
        _ => None,
    })
}

/// `path` from `dir` (`../../pretrained/x` from `results/g/cell`), both canonical; None when
/// they share no directory but the root. A run's records then name what it read wherever the
/// tree is moved, and name no directory of the machine it ran on.
fn relative_to(path: &Path, dir: &Path) -> Option<PathBuf> {
    use std::path::Component;
    let (path, dir) = (
        std::fs::canonicalize(path).ok()?,
        std::fs::canonicalize(dir).ok()?,
    );
    let (p, d): (Vec<Component>, Vec<Component>) =
        (path.components().collect(), dir.components().collect());
    let shared = p.iter().zip(&d).take_while(|(a, b)| a == b).count();
    // The first component is the root: sharing only it, the relative path would spell out
    // the whole of one of them.
    if shared < 2 {
        return None;
    }
    let mut out: PathBuf = d[shared..].iter().map(|_| Component::ParentDir).collect();
    out.extend(&p[shared..]);
    Some(out)
}

/// A training run in progress: the model, its optimizer and counters, the generators, and
/// where it logs.
struct Trainer<'a> {
    cfg: &'a Config,
    args: &'a TrainArgs,
    prepared: Prepared,
    built: Built,
    params: BTreeMap<String, Tensor>,
    opt: AdamW,
    state: TrainState,
    rng: Rng,
    gate_rng: Rng,
    ctx: ForwardCtx,
    /// How each micro-step keeps its activations and computes its loss.
    plan: MemoryPlan,
    /// The library that reads the GPU's memory and the device's index, on a GPU, where the
    /// plan's peak is predicted from the model measured there (`memory::plan_on_device`).
    gpu: Option<(&'static Kernels, usize)>,
    /// Probability per step of a forced global step (`MethodSpec::force_global`).
    p_force: f64,
    /// Static heads ramped along another run's usage, and how many ranked heads it ends with.
    static_ramp: Option<(UsageRamp, usize)>,
    /// Its part in a data-parallel job, if it is one rank of several.
    team: Option<Team>,
    /// The step captured as a CUDA graph (`train.cuda_graph`).
    graphs: Option<Graphs>,
    /// The routers' weights, kept out of the update while `train.router_hold_steps` holds them.
    routers: Vec<Tensor>,
    log_path: PathBuf,
    val_log_path: PathBuf,
    progress: Progress,
    status: String,
    /// Tokens and time since the last logged row, for its tokens/s.
    window_start: Instant,
    window_tokens: u64,
}

/// What one optimizer step measured.
struct Step {
    lr: f64,
    loss: f64,
    grad_norm: f64,
    /// Sums over the micro-batches of the regulariser and mu_f, for methods with them.
    reg_sum: Option<f64>,
    mu_sum: Option<f64>,
    /// Forward and backward passes this rank ran, and the sequences of each.
    passes: (usize, usize),
}

impl<'a> Trainer<'a> {
    /// Builds the model and optimizer, then restores them: from the run's latest checkpoint
    /// when resuming, else from `--init-from`'s weights (new modules a paper initialises from
    /// the base attention copying them).
    fn new(cfg: &'a Config, args: &'a TrainArgs, prepared: Prepared) -> Result<Trainer<'a>> {
        let out = &args.out;
        let built = Built::new(cfg, prepared.device)?;
        let params = built.params();
        let t = &cfg.train;
        let trainable: BTreeMap<String, Tensor> = params
            .iter()
            .filter(|(name, p)| {
                let frozen = t.freeze_mlp && frozen_by_freeze_mlp(name);
                if frozen {
                    let _ = p.set_requires_grad(false);
                }
                !frozen
            })
            .map(|(n, p)| (n.clone(), p.shallow_clone()))
            .collect();
        // On a GPU the plan is made again with the model there, before the optimizer's state
        // is: its blocks measured, the device's memory read.
        let gpu = match prepared.device {
            Device::Cuda(i) => kernels::cuda().map(|k| (k, i)),
            Device::Cpu | Device::Mps | Device::Vulkan => None,
        };
        let plan = match gpu {
            Some((k, i)) => {
                let trained: Vec<Tensor> = trainable.values().map(|p| p.shallow_clone()).collect();
                memory::plan_on_device(cfg, &built.model, &trained, k, i)?
            }
            None => prepared.plan.clone(),
        };
        if !args.quiet {
            eprintln!("{}", plan.describe(cfg, gpu.map(|_| plan.peak)));
        }
        let mut opt = AdamW::new(&trainable, built.model.kernels);
        let mut state = TrainState {
            step: 0,
            rng_state: Rng::new(t.seed ^ 0xDA7A).state,
            gate_rng_state: Rng::new(t.seed ^ 0x6A7E).state,
            tokens_seen: 0,
        };
        let resumed_from = if args.resume {
            checkpoint::latest(out)?
        } else {
            None
        };
        if let Some(ckpt) = &resumed_from {
            state = resume_from(ckpt, &params, &mut opt, t.steps, out)?;
        } else if let Some(src) = &prepared.init_from {
            init_from(&built, &params, src, args.quiet)?;
        }
        let team = match &args.place {
            Some(place) => {
                let team = Team::join(place, prepared.device, t.dist_timeout_s)?;
                team.share(&params)?;
                Some(team)
            }
            None => None,
        };
        let trained: Vec<Tensor> = trainable.values().map(Tensor::shallow_clone).collect();
        let passes = t.grad_accum / t.joined();
        let graphs = Graphs::new(
            cfg,
            &built.model,
            &trained,
            passes,
            team.is_some(),
            prepared.device,
        )?;
        let log_path = out.join("train_log.csv");
        let val_log_path = out.join("val_log.csv");
        if args.resume {
            truncate_log(&log_path, state.step, &LOG_HEADER)?;
            // The final evaluation's row is written again below.
            truncate_log(&val_log_path, state.step.min(t.steps - 1), &VAL_LOG_HEADER)?;
            checkpoint::remove_temporaries(out)?;
        }
        let ctx = ForwardCtx {
            compute_logits: built.model.kernels.is_some(),
            ..Default::default()
        };
        let routers: Vec<Tensor> = trainable
            .iter()
            .filter(|(n, _)| t.router_hold_steps > 0 && is_router(n))
            .map(|(_, p)| p.shallow_clone())
            .collect();
        if !args.quiet {
            let n: i64 = params.values().map(|p| p.numel() as i64).sum();
            let path = match &built.model.kernels {
                Some(k) => format!("kernels {}", k.path.display()),
                None => "reference path".into(),
            };
            eprintln!(
                "device {:?}, {} params, attention {:?} ({path}), {} steps from step {}{}",
                prepared.device,
                n,
                cfg.attention.method,
                t.steps,
                state.step,
                resumed_from
                    .as_ref()
                    .map(|c| format!(" (resumed from {})", c.display()))
                    .unwrap_or_default()
            );
        }
        let mut progress = Progress::new(
            t.steps as u64,
            "steps",
            args.quiet,
            Duration::from_secs(args.status_every),
        );
        progress.start_at(state.step as u64);
        Ok(Trainer {
            cfg,
            args,
            prepared,
            built,
            params,
            opt,
            rng: Rng {
                state: state.rng_state,
            },
            gate_rng: Rng {
                state: state.gate_rng_state,
            },
            state,
            ctx,
            plan,
            gpu,
            p_force: (spec(cfg.attention.method).force_global)(&cfg.attention),
            static_ramp: static_ramp(&cfg)?,
            team,
            graphs,
            routers,
            log_path,
            val_log_path,
            progress,
            status: String::new(),
            window_start: Instant::now(),
            window_tokens: 0,
        })
    }

    /// Records the run once its weights are in place: `init_from.txt` (a fresh continued run)
    /// and `config.toml` (a fresh run, or a resumed one that changes settings).
    fn record_run(&self) -> Result<()> {
        let (args, p) = (self.args, &self.prepared);
        if !args.leads() {
            return Ok(());
        }
        if let (false, Some(src)) = (args.resume, &p.init_from) {
            let src = relative_to(src, &args.out).unwrap_or_else(|| src.clone());
            atomic::write_bytes(&args.out.join("init_from.txt"), src.as_os_str().as_bytes())?;
        }
        if !args.resume {
            let record = DataRecord {
                dir: self.cfg.data.dir.to_string_lossy().into_owned(),
                meta_sha256: data::identity(&self.cfg.data.dir)?,
            };
            atomic::write_bytes(
                &data_record_path(&args.out),
                serde_json::to_string_pretty(&record)?.as_bytes(),
            )?;
        }
        if !args.resume || !p.changed.is_empty() {
            atomic::write_bytes(&args.out.join("config.toml"), self.cfg.to_toml().as_bytes())?;
        }
        if !args.quiet {
            for (key, was, now) in &p.changed {
                eprintln!("resuming with {key} = {now} (was {was})");
            }
        }
        Ok(())
    }

    /// One optimizer step over `train.grad_accum` micro-batches; refused before the update
    /// when the loss or the gradient norm is not finite.
    fn step(&mut self) -> Result<Step> {
        let t = &self.cfg.train;
        let lr = learning_rate(t, self.state.step);
        // A captured step zeroes the gradients itself.
        if self.graphs.is_none() {
            self.opt.zero_grad();
        }
        // A forced global step (L2A's anti-collapse draw): once per optimizer step, from the
        // gate generator.
        self.ctx.force_global = self.p_force > 0.0 && self.gate_rng.uniform() < self.p_force;
        self.ctx.penalty_scale = Some(penalty_scale(t, self.state.step));
        self.ctx.static_heads = (self.static_ramp.as_ref())
            .map(|(ramp, total)| ramp.heads(self.state.step, t.steps, *total));
        // While held, every gate is open and the router gets no gradient (so AdamW leaves it
        // and its moments untouched).
        let held = self.state.step < t.router_hold_steps;
        self.ctx.gate_override = held.then_some(GateOverride::Constant(1.0));
        for r in &self.routers {
            let _ = r.set_requires_grad(!held);
        }
        // Context-free (Bernoulli) gates are drawn afresh each step.
        self.ctx.gate_seed = self.gate_rng.next_u64();
        // This rank's share of the step's micro-batches (all of them alone); the others are
        // drawn past, so every rank's generator stays the one process's.
        let mine = self
            .team
            .as_ref()
            .map_or(0..t.grad_accum, |tm| tm.mine(t.grad_accum));
        if let Some(team) = &mut self.team {
            team.reduce_over(&self.params)?;
        }
        let mut sums = [0.0, 0.0, 0.0];
        let (mut has_reg, mut has_mu) = (false, false);
        let mut ran = (0, 0);
        // This rank's micro-batches run `joined` a pass: their sequences drawn one after the
        // other as for separate passes, so the pass's mean is the mean of theirs (each holds
        // as many tokens), counted once for each.
        let (join, seq) = (t.joined(), self.cfg.data.seq_len);
        let passes = mine.len() / join;
        for j in 0..t.grad_accum {
            let split = &self.prepared.train_split;
            if !mine.contains(&j) {
                split.skip(&mut self.rng, t.batch_size, seq)?;
                continue;
            }
            if (j - mine.start) % join != 0 {
                continue;
            }
            let rows = t.batch_size * join;
            let b = split.sample(&mut self.rng, rows, seq, self.prepared.device)?;
            // Drawn gates hash the step's row: the same draws joined or apart, on any rank.
            self.ctx.gate_row = (j * t.batch_size) as i64;
            let last = j + join == mine.end;
            if let (true, Some(team)) = (last, &self.team) {
                team.arm()?;
            }
            let model = &self.built.model;
            let m = match &mut self.graphs {
                Some(g) => g.pass(model, &b.x, &b.y, &self.ctx, &self.plan.step, &self.opt)?,
                None => {
                    forward_backward(model, &b.x, &b.y, &self.ctx, &self.plan.step, passes).read()
                }
            };
            ran = (ran.0 + 1, rows);
            if let (true, Some(team)) = (last, &self.team) {
                team.finish()?;
            }
            let n = join as f64;
            sums[0] += m.loss * n;
            if let Some(r) = m.reg {
                (sums[1], has_reg) = (sums[1] + r * n, true);
            }
            if let Some(mu) = m.full_usage {
                (sums[2], has_mu) = (sums[2] + mu * n, true);
            }
        }
        if let Some(team) = &self.team {
            let total = team.sum(&sums, self.prepared.device)?;
            sums.copy_from_slice(&total);
        }
        let loss_sum = sums[0];
        let (reg_sum, mu_sum) = (has_reg.then_some(sums[1]), has_mu.then_some(sums[2]));
        let loss = loss_sum / t.grad_accum as f64;
        let grad_norm = self.opt.clip_grad_norm(t.grad_clip);
        if !loss.is_finite() || !grad_norm.is_finite() {
            bail!(
                "non-finite {} at step {}: the update was not applied; {}",
                if loss.is_finite() {
                    format!("gradient norm ({grad_norm})")
                } else {
                    format!("loss ({loss})")
                },
                self.state.step + 1,
                self.what_is_kept()?
            );
        }
        self.opt.update(lr, t);
        fault::point("step_applied");
        let tokens_per_step = (t.batch_size * t.grad_accum * self.cfg.data.seq_len) as u64;
        self.state.step += 1;
        self.state.tokens_seen += tokens_per_step;
        self.window_tokens += tokens_per_step;
        Ok(Step {
            lr,
            loss,
            grad_norm,
            reg_sum,
            mu_sum,
            passes: ran,
        })
    }

    /// What a run stopped by a non-finite step leaves: the weights that are not finite, if any
    /// (the step before produced them), and the newest checkpoint, if one was written.
    fn what_is_kept(&self) -> Result<String> {
        let bad: Vec<&String> = self
            .params
            .iter()
            .filter(|(_, p)| p.isfinite().all().int64_value(&[]) == 0)
            .map(|(n, _)| n)
            .collect();
        let weights = match bad.is_empty() {
            true => String::new(),
            false => format!("the weights {bad:?} are no longer finite; "),
        };
        let kept = match checkpoint::latest(&self.args.out)? {
            Some(ckpt) => format!(
                "the newest checkpoint, {}, is kept (resume continues from it)",
                ckpt.display()
            ),
            None => "no checkpoint was written before it: lower train.lr or set \
                     train.grad_clip, and start again"
                .into(),
        };
        Ok(weights + &kept)
    }

    /// After a step: its log row, a validation loss and a checkpoint when they are due.
    fn record(&mut self, s: &Step, last: usize) -> Result<()> {
        // The other ranks of a job write nothing: rank 0 keeps the run.
        if !self.args.leads() {
            return Ok(());
        }
        let t = &self.cfg.train;
        let step = self.state.step;
        let accum = t.grad_accum as f64;
        let fmt_opt = |v: Option<f64>| v.map(|v| format!("{:.6}", v / accum)).unwrap_or_default();
        if step % t.log_every == 0 || step == last {
            let tps = self.window_tokens as f64 / self.window_start.elapsed().as_secs_f64();
            let (loss, lr) = (s.loss, s.lr);
            // The GPU's peak since the last row, and from now on the next row's.
            let peak = match self.gpu {
                Some((k, i)) => Some(k.cuda_memory(i, true)?.peak),
                None => memory::host_peak(),
            };
            self.status = format!("loss {loss:.4} lr {lr:.2e} {tps:.0} tok/s");
            append_row(
                &self.log_path,
                &LOG_HEADER,
                &[
                    step.to_string(),
                    format!("{loss:.6}"),
                    format!("{lr:.6e}"),
                    format!("{:.6}", s.grad_norm),
                    format!("{tps:.1}"),
                    self.state.tokens_seen.to_string(),
                    fmt_opt(s.reg_sum),
                    fmt_opt(s.mu_sum),
                    peak.map_or(String::new(), |p| format!("{:.3}", p / GIB)),
                    format!("{:.3}", self.plan.peak / GIB),
                ],
            )?;
            self.window_start = Instant::now();
            self.window_tokens = 0;
        }
        self.progress.update(step as u64, &self.status);
        if t.eval_every > 0 && step % t.eval_every == 0 && step < t.steps {
            if let Some(g) = &mut self.graphs {
                g.release();
            }
            let r = eval::evaluate(
                &self.built.model,
                &self.prepared.val_split,
                self.cfg,
                "val",
                self.prepared.device,
                false,
            )?;
            append_row(
                &self.val_log_path,
                &VAL_LOG_HEADER,
                &[step.to_string(), format!("{:.6}", r.loss)],
            )?;
            self.progress
                .println(&format!("step {step}: val loss {:.4}", r.loss));
        }
        if step % t.ckpt_every == 0 || step == last {
            self.state.rng_state = self.rng.state;
            self.state.gate_rng_state = self.gate_rng.state;
            let model_tensors: Vec<(String, Tensor)> = self
                .params
                .iter()
                .map(|(n, p)| (n.clone(), p.shallow_clone()))
                .collect();
            checkpoint::save(
                &self.args.out,
                &model_tensors,
                &self.opt.state_tensors(),
                &self.state,
                t.keep_checkpoints,
            )?;
        }
        Ok(())
    }

    /// The final evaluation (`eval/`) once every step is done, or a note that the run stopped
    /// early and can be resumed.
    fn finish(mut self) -> Result<()> {
        self.progress.finish();
        // The last collective is behind every rank: the final evaluation is rank 0's alone.
        // A shutdown that fails costs the run nothing (its steps are done, the membership is
        // freed either way): a warning, not a failed run.
        if let Some(team) = self.team.take() {
            if let Err(e) = team.close() {
                eprintln!("warning: {e:#}");
            }
        }
        if !self.args.leads() {
            return Ok(());
        }
        self.graphs = None;
        let (cfg, args, t) = (self.cfg, self.args, &self.cfg.train);
        let (model, device) = (&self.built.model, self.prepared.device);
        if self.state.step == t.steps {
            let val = &self.prepared.val_split;
            let mut r = eval::evaluate(model, val, cfg, "val", device, !args.quiet)?;
            r.checkpoint_step = Some(self.state.step);
            r.timing = eval::timing_of(model, val, cfg, device);
            append_row(
                &self.val_log_path,
                &VAL_LOG_HEADER,
                &[self.state.step.to_string(), format!("{:.6}", r.loss)],
            )?;
            report::write_report(&args.out.join("eval"), &r, cfg)?;
            if !args.quiet {
                if t.cuda_graph {
                    eprintln!(
                        "{} steps replayed a captured CUDA graph",
                        train_graph::replayed()
                    );
                }
                eprintln!(
                    "done: {} steps, val loss {:.4} (ppl {:.2}), results in {}",
                    t.steps,
                    r.loss,
                    r.perplexity,
                    args.out.display()
                );
            }
        } else if !args.quiet {
            eprintln!(
                "stopped at step {} of {}; continue with --resume",
                self.state.step, t.steps
            );
        }
        Ok(())
    }
}

/// The state of a resumed run from its checkpoint `ckpt`, its weights and optimizer state
/// loaded; refused where the checkpoint lies beyond `steps` or lacks the optimizer's state.
fn resume_from(
    ckpt: &Path,
    params: &BTreeMap<String, Tensor>,
    opt: &mut AdamW,
    steps: usize,
    out: &Path,
) -> Result<TrainState> {
    let state = checkpoint::read_state(ckpt)?;
    ensure!(
        state.step <= steps,
        "{} is at step {}, beyond train.steps = {steps}: it belongs to a longer run, so this \
         config.toml does not describe it",
        ckpt.display(),
        state.step
    );
    checkpoint::load_into(
        params,
        &ckpt.join("model.safetensors"),
        true,
        Precision::Exact,
    )?;
    let optim = ckpt.join(checkpoint::OPTIMIZER_FILE);
    ensure!(
        optim.is_file(),
        "{} holds no optimizer state (a sweep run with --drop-optimizer removes it once \
         the cell has finished), so the run cannot be resumed; continue from its weights \
         in a new run with --init-from {}",
        ckpt.display(),
        out.display()
    );
    opt.load_state(&optim, state.step)?;
    Ok(state)
}

/// Loads `--init-from`'s weights into `params` (continued pretraining); new modules a paper
/// initialises from the base attention copy the loaded weights.
fn init_from(
    built: &Built,
    params: &BTreeMap<String, Tensor>,
    src: &Path,
    quiet: bool,
) -> Result<()> {
    let file = checkpoint::resolve_weights(src)?;
    let r = checkpoint::load_into(params, &file, false, checkpoint::precision_of(&file))?;
    ensure!(
        !r.loaded.is_empty(),
        "--init-from {}: no tensor name matches this model",
        file.display()
    );
    built.copy_derived(|dst| r.initialised.iter().any(|n| n == dst));
    if !quiet {
        eprintln!(
            "init-from {}: loaded {} tensors ({}), initialised {} new ({:?}), ignored {} ({:?})",
            file.display(),
            r.loaded.len(),
            r.conversion().unwrap_or_else(|| "none converted".into()),
            r.initialised.len(),
            r.initialised,
            r.unused.len(),
            r.unused
        );
    }
    Ok(())
}

/// Static heads ramped along another run's usage (`attention.top_k_ramp`): the ramp and how
/// many ranked heads it ends with (the assignment's); None for any other run.
fn static_ramp(cfg: &Config) -> Result<Option<(UsageRamp, usize)>> {
    let a = &cfg.attention;
    if a.top_k_ramp.as_os_str().is_empty() || a.method != config::Method::StaticHeads {
        return Ok(None);
    }
    let heads = (spec(a.method).fixed_heads)(&cfg.model, a)?;
    let total = heads
        .iter()
        .flatten()
        .flatten()
        .filter(|p| p.is_some())
        .count();
    Ok(Some((UsageRamp::read(&a.top_k_ramp)?, total)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Method;
    use std::collections::BTreeMap;
    use tch::{Device, Tensor};

    /// Of every parameter an untied L2A model has, freeze_mlp fixes exactly the MLPs, the
    /// embedding and the head.
    #[test]
    fn freeze_mlp_trains_attention_routers_and_norms_only() {
        let mut c = Config::default();
        c.model.vocab_size = 11;
        c.model.hidden_size = 8;
        c.model.intermediate_size = 8;
        c.model.num_hidden_layers = 1;
        c.model.tie_word_embeddings = false;
        c.attention.method = Method::L2a;
        let b = Built::new(&c, Device::Cpu).unwrap();
        let frozen: Vec<String> = b
            .params()
            .into_keys()
            .filter(|n| frozen_by_freeze_mlp(n))
            .collect();
        assert_eq!(
            frozen,
            [
                "lm_head.weight",
                "model.embed_tokens.weight",
                "model.layers.0.mlp.down_proj.weight",
                "model.layers.0.mlp.gate_proj.weight",
                "model.layers.0.mlp.up_proj.weight",
            ]
        );
    }

    /// A tiny model of every method's example (`MethodSpec::examples`) over synthetic data in
    /// `dir`: 4 steps of 2 sequences of 32 tokens on the CPU, a checkpoint every 2.
    fn tiny_runs(dir: &Path) -> Vec<(&'static str, Config)> {
        let data = dir.join("data");
        crate::data::synth(
            &crate::data::SynthSpec {
                train_tokens: 20_000,
                val_tokens: 2_048,
                max_distance: 32,
                ..Default::default()
            },
            &data,
        )
        .unwrap();
        let examples = crate::model::attention::all_methods().flat_map(|s| s.examples);
        examples
            .map(|e| {
                let mut c = Config {
                    model: crate::config::ModelConfig {
                        vocab_size: 256,
                        hidden_size: 16,
                        intermediate_size: 24,
                        num_hidden_layers: 2,
                        num_attention_heads: 2,
                        num_key_value_heads: 2,
                        ..Default::default()
                    },
                    train: crate::config::TrainConfig {
                        device: "cpu".into(),
                        batch_size: 2,
                        steps: 4,
                        warmup_steps: 1,
                        log_every: 1,
                        ckpt_every: 2,
                        eval_every: 0,
                        ..Default::default()
                    },
                    ..Default::default()
                };
                (c.attention.window, c.attention.hybrid_every) = (4, 2);
                (e.set)(&mut c.attention);
                (c.data.dir, c.data.seq_len) = (data.clone(), 32);
                c.eval.max_batches = 1;
                (e.name, c)
            })
            .collect()
    }

    fn args(out: &Path, resume: bool, stop_at: Option<usize>) -> TrainArgs {
        TrainArgs {
            out: out.to_path_buf(),
            resume,
            init_from: None,
            stop_at,
            quiet: true,
            status_every: 0,
            place: None,
        }
    }

    fn weights(run: &Path) -> BTreeMap<String, Tensor> {
        let path = checkpoint::weights_in(run)
            .unwrap()
            .expect("a trained model");
        checkpoint::read_tensors(&path)
            .unwrap()
            .into_iter()
            .collect()
    }

    /// For every method's examples (`MethodSpec::examples`), training stopped halfway and
    /// resumed gives the weights of training straight through, bit for bit: the checkpoint
    /// holds everything a method's training reads (its routers, the gates' seeds, L2A's forced
    /// steps, Bernoulli draws). And a step's two micro-batches of 2 joined into one pass of 4
    /// (`train.micro_batch`) train the same weights to rounding, with the same logged loss,
    /// gradient norm, regulariser and usage, for every method, those whose gates are drawn
    /// at random too (the draws hash the step's row, not the pass's). One test, so that
    /// its runs never start beside each other: a run's initial weights come from libtorch's
    /// one global generator.
    #[test]
    fn every_method_trains_alike_resumed_and_joined() {
        let dir = crate::util::scratch_dir("resume-join-every-method");
        let runs = tiny_runs(&dir);
        // Among them, methods whose gates are drawn at random (Bernoulli, sampled probes).
        assert!(
            runs.iter()
                .filter(|(_, c)| c.attention.draws_gates())
                .count()
                >= 2
        );
        for (name, mut c) in runs.clone() {
            c.train.grad_accum = 2;
            let (straight, resumed) = (dir.join(name), dir.join(format!("{name}-resumed")));
            train(c.clone(), &args(&straight, false, None)).unwrap();
            train(c.clone(), &args(&resumed, false, Some(2))).unwrap();
            train(c.clone(), &args(&resumed, true, None)).unwrap();
            let (a, b) = (weights(&straight), weights(&resumed));
            assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
            for (key, t) in &a {
                assert!(t.equal(&b[key]), "{name}: {key} differs after resuming");
            }
            c.train.micro_batch = 4;
            let joined = dir.join(format!("{name}-joined"));
            train(c.clone(), &args(&joined, false, None)).unwrap();
            let b = weights(&joined);
            for (key, t) in &a {
                let gap = (t - &b[key]).abs().max().double_value(&[]);
                assert!(gap < 1e-5, "{name}: {key} differs by {gap} when joined");
            }
            // The logged loss, gradient norm, regulariser and usage of every step (columns 1,
            // 3, 6, 7; Adam's update hardly moves with the gradient's scale, its norm does).
            let logged = |run: &Path| -> Vec<Vec<f64>> {
                let text = std::fs::read_to_string(run.join("train_log.csv")).unwrap();
                text.lines()
                    .skip(1)
                    .map(|l| {
                        let v: Vec<&str> = l.split(',').collect();
                        [1, 3, 6, 7].map(|i| v[i].parse().unwrap_or(0.0)).to_vec()
                    })
                    .collect()
            };
            let (la, lb) = (logged(&straight), logged(&joined));
            assert_eq!(la.len(), 4);
            assert_eq!(la.len(), lb.len());
            let close =
                |x: &Vec<f64>, y: &Vec<f64>| x.iter().zip(y).all(|(p, q)| (p - q).abs() < 1e-5);
            assert!(
                la.iter().zip(&lb).all(|(x, y)| close(x, y)),
                "{name}: {la:?} {lb:?}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// On a GPU, `train.cuda_graph` trains the weights eager steps train (bf16, so to cuBLAS's
    /// choice of algorithm on another stream), with the same logged losses, for full attention,
    /// AHA and L2A, with an evaluation every two steps (the graph dropped and captured again):
    /// every step after the first runs from a replay, but L2A's forced global steps (drawn at
    /// its p_force), which run eagerly.
    #[test]
    #[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
    fn cuda_graph_steps_train_the_eager_weights() {
        crate::model::kernels::tests::on_cuda("cuda_graph_steps_train_the_eager_weights", |_| {
            let dir = crate::util::scratch_dir("cuda-graph-steps");
            let runs = tiny_runs(&dir).into_iter().enumerate();
            for (i, (name, mut c)) in runs {
                if !["full", "aha", "l2a"].contains(&name) || c.attention.draws_gates() {
                    continue;
                }
                let name = format!("{name}-{i}");
                (c.model.hidden_size, c.model.intermediate_size) = (128, 256);
                c.train.device = "cuda".into();
                c.train.dtype = crate::config::Dtype::Bf16;
                c.attention.attn_impl = crate::config::AttnImpl::Cuda;
                (c.train.steps, c.train.eval_every) = (6, 2);
                let eager = dir.join(format!("{name}-eager"));
                train(c.clone(), &args(&eager, false, None)).unwrap();
                c.train.cuda_graph = true;
                let graphed = dir.join(format!("{name}-graphed"));
                let before = train_graph::replayed();
                train(c.clone(), &args(&graphed, false, None)).unwrap();
                // Step 1 eager, step 2 captured, steps 3-6 replayed or captured after the
                // evaluations of steps 2 and 4.
                let replayed = train_graph::replayed() - before;
                match name.starts_with("l2a") {
                    true => assert!((1..=5).contains(&replayed), "{name}: {replayed}"),
                    false => assert_eq!(replayed, 5, "{name}"),
                }
                let (a, b) = (weights(&eager), weights(&graphed));
                for (key, t) in &a {
                    let scale = t.abs().max().double_value(&[]).max(1e-6);
                    let gap = (t - &b[key]).abs().max().double_value(&[]);
                    assert!(gap <= 2e-2 * scale, "{name}: {key} differs by {gap}");
                }
                let losses = |run: &Path| -> Vec<f64> {
                    let text = std::fs::read_to_string(run.join("train_log.csv")).unwrap();
                    text.lines()
                        .skip(1)
                        .map(|l| l.split(',').nth(1).unwrap().parse().unwrap())
                        .collect()
                };
                let (la, lb) = (losses(&eager), losses(&graphed));
                assert_eq!(la.len(), 6);
                assert!(
                    la.iter()
                        .zip(&lb)
                        .all(|(p, q)| (p - q).abs() <= 1e-2 * p.abs()),
                    "{name}: {la:?} {lb:?}"
                );
            }
            std::fs::remove_dir_all(&dir).unwrap();
        });
    }

    /// A join that does not divide a rank's share of the micro-batches is refused, naming the
    /// ones that do.
    #[test]
    fn a_join_must_divide_a_ranks_micro_batches() {
        let mut c = Config::default();
        (c.train.batch_size, c.train.grad_accum, c.train.micro_batch) = (2, 4, 6);
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("use one of 2, 4, 8"), "{e}");
        c.train.ranks = 2;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("use one of 2, 4 "), "{e}");
        c.train.micro_batch = 4;
        c.validate().unwrap();
        // The memory plan sizes a pass by the sequences it takes.
        let bytes = |c: &Config| memory::activation_bytes(c, 0);
        let mut four = c.clone();
        (four.train.batch_size, four.train.micro_batch) = (4, 0);
        assert_eq!(bytes(&c), bytes(&four));
        c.train.micro_batch = 0;
        assert!(bytes(&c) < bytes(&four));
    }
}
