//! Running a grid's cells: each under an exclusive lock in its own directory, its state in
//! `status.json`, data prepared first, several at a time, failures recorded while the others
//! go on.

use super::grid::{has_placeholder, Cell, Grid, StageKind};
use super::retrain;
use super::status::{read_status, write_status, State, Status};
use crate::config::Method;
use crate::data::{self, corpus};
use crate::io::checkpoint;
use crate::model::attention::{spec, Gates};
use crate::run::report;
use crate::util::atomic;
use crate::util::fault;
use anyhow::{ensure, Context, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use std::collections::{BTreeMap, BTreeSet};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// The full-attention usage a finished routed cell's evaluation measured: overall (mu_f) and
/// gate by gate (`[layer][output]`: each head's for AHA, each layer's one gate for L2A and
/// SwiAttn), as `method`'s Bernoulli gates read it.
fn usage_of(cell_dir: &Path, method: Method) -> Result<(f64, Vec<Vec<f64>>)> {
    let eval = cell_dir.join("eval");
    let report = report::read_report(&eval)?
        .with_context(|| format!("{} holds no evaluation to match usage with", eval.display()))?;
    report
        .report
        .gates
        .map(|g| (g.mu_f, per_gate(&g, spec(method).gates)))
        .with_context(|| {
            format!(
                "{} has no gates (its method routes nothing): match_usage needs a routed cell",
                cell_dir.display()
            )
        })
}

/// A layer's rates, one a gate: a per-token gate's usage is its layer's (the report repeats
/// it over the heads the gate covers), a per-head gate's its head's.
fn per_gate(g: &report::GateReport, gates: Gates) -> Vec<Vec<f64>> {
    match gates {
        Gates::PerToken => g.per_layer.iter().map(|&u| vec![u]).collect(),
        _ => g.per_head.clone(),
    }
}

/// Options of one `attnsweep sweep` invocation.
pub(crate) struct SweepArgs {
    pub(crate) out: PathBuf,
    pub(crate) jobs: usize,
    pub(crate) devices: Vec<usize>,
    /// GPUs a train cell runs on (`sweep --gpus-per-cell`): in a train stage the devices form
    /// slots of this many, and a cell trains data parallel over its slot's; an evaluation or
    /// a pruning runs on one GPU, so their stages use every device as a slot (`placement`).
    pub(crate) gpus_per_cell: usize,
    /// Run only these cells (`sweep --cell`); empty: every cell.
    pub(crate) cell: Vec<usize>,
    pub(crate) retry_failed: bool,
    /// Remove each finished train cell's optimizer state (`sweep --drop-optimizer`).
    pub(crate) drop_optimizer: bool,
    /// A rank runs its share of a step's micro-batches as one pass (`train.micro_batch`).
    pub(crate) join_micro_batches: bool,
    /// A train cell's step captured as a CUDA graph where it can be (`train.cuda_graph`).
    pub(crate) cuda_graph: bool,
    /// Train again the finished train cells whose weights are gone and which a cell still to
    /// run reads (`sweep --retrain`).
    pub(crate) retrain: bool,
    /// Start no cell after this long (`sweep --stop-after`).
    pub(crate) stop_after: Option<Duration>,
    pub(crate) quiet: bool,
    /// Seconds between status lines when stderr is not a terminal.
    pub(crate) status_every: u64,
}

/// The cells (ids, once each) of `cells` that `args` would run and whose last attempt failed.
pub(crate) fn failed_cells(cells: &[Cell], args: &SweepArgs) -> Vec<String> {
    let ids: BTreeSet<String> = cells
        .iter()
        .filter(|c| args.cell.is_empty() || args.cell.contains(&c.index))
        .filter(|c| read_status(&args.out.join(&c.id)).is_some_and(|s| s.state == State::Failed))
        .map(|c| c.id.clone())
        .collect();
    ids.into_iter().collect()
}

/// Status lines of a sweep whose stderr is not a terminal (a Slurm log, nohup), where
/// progress bars would not show: cells done, failed and left, and how far each running cell
/// has got, every `every`.
struct StatusLines {
    every: Duration,
    /// The sweep directory and the ids of the cells this invocation covers, once each.
    out: PathBuf,
    ids: Vec<String>,
    /// Time of the last line, and each running cell's progress.
    state: Mutex<(std::time::Instant, BTreeMap<String, String>)>,
}

impl StatusLines {
    fn set(&self, cell: &str, progress: Option<String>) {
        if let Ok(mut s) = self.state.lock() {
            match progress {
                Some(p) => s.1.insert(cell.to_string(), p),
                None => s.1.remove(cell),
            };
        }
    }

    /// Prints the line when it is due: cells done and failed as their status files say
    /// (earlier runs' included), the rest left, and the running cells' progress.
    fn tick(&self) {
        let Ok(mut s) = self.state.lock() else { return };
        if s.0.elapsed() < self.every {
            return;
        }
        s.0 = std::time::Instant::now();
        let states: Vec<Option<State>> = self
            .ids
            .iter()
            .map(|id| read_status(&self.out.join(id)).map(|st| st.state))
            .collect();
        let count = |x: State| states.iter().filter(|s| **s == Some(x)).count();
        let (done, failed) = (count(State::Done), count(State::Failed));
        let running: Vec<String> = s.1.iter().map(|(c, p)| format!("{c} {p}")).collect();
        eprintln!(
            "cells: {done} done, {failed} failed, {} left of {}; running: {}",
            self.ids.len() - done - failed,
            self.ids.len(),
            if running.is_empty() {
                "none".into()
            } else {
                running.join(", ")
            }
        );
    }
}

/// What a run of the sweep ended with.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Outcome {
    pub(crate) done: usize,
    pub(crate) failed: usize,
    pub(crate) skipped: usize,
    /// `--stop-after` passed before every cell was started.
    pub(crate) stopped: bool,
}

/// Generates the grid's synthetic corpus or prepares its text corpus at `base.data.dir` when
/// no data set is there yet; with `[probes]`, that corpus goes to `probes.mix_with` (kept
/// when one is there) and the probes mixed into it to `base.data.dir`.
fn ensure_data(grid: &Grid, cells: &[Cell], out: &Path, quiet: bool) -> Result<()> {
    if let Some(p) = &grid.pretrained {
        ensure!(
            p.join("config.toml").is_file(),
            "the grid's pretrained model {} is not there (no config.toml): convert it first \
             (`make pretrained` makes pretrained/smollm2-135m-instruct)",
            p.display()
        );
    }
    if grid.synth.is_none() && grid.corpus.is_none() && grid.probes.is_none() {
        return Ok(());
    }
    let dir = &cells[0].config.data.dir;
    if dir.join("meta.json").exists() {
        return Ok(());
    }
    // One runner generates; others wait on the lock and then find the data set.
    let lock = atomic::create_file(&out.join("data.lock"))?;
    lock.lock()?;
    if dir.join("meta.json").exists() {
        return Ok(());
    }
    let corpus_dir = match &grid.probes {
        Some(p) => p.mix_with.clone().unwrap_or_default(),
        None => dir.clone(),
    };
    let prepared = corpus_dir.join("meta.json").exists();
    if let (Some(synth), false) = (&grid.synth, prepared) {
        data::synth(synth, &corpus_dir).with_context(|| {
            format!(
                "generating the grid's synthetic corpus at {}",
                corpus_dir.display()
            )
        })?;
    }
    if let (Some(spec), false) = (&grid.corpus, prepared) {
        let summary = corpus::prepare(spec, &corpus_dir, quiet)
            .with_context(|| format!("preparing the grid's corpus at {}", corpus_dir.display()))?;
        if !quiet {
            eprintln!("{}", summary.report(&corpus_dir));
        }
    }
    if let Some(p) = &grid.probes {
        let meta = p
            .write(dir)
            .with_context(|| format!("writing the grid's probe data set at {}", dir.display()))?;
        if !quiet {
            eprintln!(
                "probes: {} train and {} validation tokens at {}",
                meta.train_tokens,
                meta.val_tokens,
                dir.display()
            );
        }
    }
    Ok(())
}

/// The cells this invocation covers: all of them, or the cells `args.cell` lists (in the
/// grid's order) once each one's dependencies have finished or are listed too.
fn chosen<'a>(cells: &'a [Cell], args: &SweepArgs) -> Result<Vec<&'a Cell>> {
    if args.cell.is_empty() {
        return Ok(cells.iter().collect());
    }
    let mut listed: Vec<&Cell> = Vec::new();
    for &k in &args.cell {
        let c = cells.get(k).with_context(|| {
            format!(
                "--cell {k}: the grid has cells 0 ..= {}",
                cells.len().saturating_sub(1)
            )
        })?;
        if !listed.iter().any(|l| l.index == k) {
            listed.push(c);
        }
    }
    listed.sort_by_key(|c| c.index);
    // Every missing dependency at once, and theirs in turn, by index, so one corrected
    // command runs them all (a folder of results drawn before its cells' records were kept
    // has tables only: there a finished dependency is missing too, and is run again by
    // listing it).
    let (mut what, mut all) = (
        Vec::new(),
        BTreeSet::from_iter(listed.iter().map(|c| c.index)),
    );
    let mut todo: Vec<&Cell> = listed.clone();
    while let Some(c) = todo.pop() {
        for dep in c.depends_on.iter().chain(&c.reads) {
            let done = read_status(&args.out.join(dep)).is_some_and(|s| s.state == State::Done);
            let Some(d) = cells.iter().find(|d| &d.id == dep).filter(|_| !done) else {
                continue;
            };
            if all.insert(d.index) {
                what.push(format!(
                    "--cell {}: its dependency {dep} (cell {})",
                    c.index, d.index
                ));
                todo.push(d);
            }
        }
    }
    ensure!(
        what.is_empty(),
        "{} not finished in {} (a folder of results drawn before its cells' records were kept \
         has tables only); finish \
         it first or list it too: --cell {}",
        what.join(", "),
        args.out.display(),
        all.iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(",")
    );
    Ok(listed)
}

/// What the workers of one invocation share: where the cells run and what they have done.
struct Pool<'a> {
    args: &'a SweepArgs,
    exe: PathBuf,
    outcome: Mutex<Outcome>,
    /// Each cell is attempted at most once per invocation, so a failing cell cannot loop.
    attempted: Mutex<BTreeSet<String>>,
    /// Finished cells whose weights are made again (`--retrain`).
    retrain: BTreeSet<String>,
    mp: MultiProgress,
    overall: ProgressBar,
    status: Option<StatusLines>,
    deadline: Option<std::time::Instant>,
    stopped: std::sync::atomic::AtomicBool,
}

impl Pool<'_> {
    /// Whether `--stop-after` has passed (then nothing more starts).
    fn past_deadline(&self) -> bool {
        let past = self
            .deadline
            .is_some_and(|d| std::time::Instant::now() >= d);
        if past {
            self.stopped.store(true, Ordering::SeqCst);
        }
        past
    }

    /// Whether this invocation starts an unfinished cell in state `s`: every one but those
    /// that failed, unless `--retry-failed`.
    fn will_run(&self, s: &Status) -> bool {
        match s.state {
            State::Done => false,
            State::Failed => self.args.retry_failed,
            State::Running => true,
        }
    }

    /// The cells of `wave`'s stages among `chosen` still to run: never started, interrupted (a
    /// runner died while it ran: resume), failed (with --retry-failed), or finished and
    /// retrained.
    fn pending<'c>(&self, chosen: &[&'c Cell], wave: &[&str]) -> Vec<&'c Cell> {
        let mut seen = BTreeSet::new();
        chosen
            .iter()
            .copied()
            .filter(|c| wave.contains(&c.stage.as_str()))
            // Two stages that compute the same thing share a cell: listed once, run once.
            .filter(|c| seen.insert(c.id.as_str()))
            .filter(|c| !self.attempted.lock().unwrap().contains(&c.id))
            .filter(|c| match read_status(&self.args.out.join(&c.id)) {
                Some(s) if s.state == State::Done => self.retrain.contains(&c.id),
                Some(s) => self.will_run(&s),
                None => true,
            })
            .collect()
    }

    /// Runs every cell of `wave`'s stages to a final state, as `at` places them: cells another
    /// runner holds are waited for, and taken over if that runner dies before finishing them.
    fn run_wave(&self, chosen: &[&Cell], wave: &[&str], at: Placement) {
        loop {
            let pending = self.pending(chosen, wave);
            if pending.is_empty() || self.past_deadline() {
                return;
            }
            let held = self.run_cells(&pending, at);
            if held.is_empty() {
                return;
            }
            for dir in held {
                // Blocks until the other runner releases the cell (or dies).
                if let Ok(f) = std::fs::File::open(dir.join("lock")) {
                    let _ = f.lock();
                }
            }
        }
    }

    /// Runs `pending` with `at.workers` threads, each taking the next cell; returns the
    /// folders of the cells another runner held.
    fn run_cells(&self, pending: &[&Cell], at: Placement) -> Vec<PathBuf> {
        let next = AtomicUsize::new(0);
        let held_elsewhere = Mutex::new(Vec::<PathBuf>::new());
        std::thread::scope(|s| {
            for w in 0..at.workers.min(pending.len()) {
                let (next, held_elsewhere) = (&next, &held_elsewhere);
                s.spawn(move || loop {
                    if self.past_deadline() {
                        break;
                    }
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(cell) = pending.get(i) else { break };
                    // A cell has its device to itself on a GPU slot whose GPUs --devices names
                    // once, or where it is the only one running.
                    let alone = at.workers == 1
                        || (at.slot > 0 && !shares_a_gpu(&self.args.devices, at, w));
                    if let Some(dir) = self.run_one(cell, w, at, alone) {
                        held_elsewhere.lock().unwrap().push(dir);
                    }
                });
            }
        });
        held_elsewhere.into_inner().unwrap()
    }

    /// Runs `cell` on worker `w`'s devices and records how it ended; the cell's folder when
    /// another runner holds it.
    fn run_one(&self, cell: &Cell, w: usize, at: Placement, alone: bool) -> Option<PathBuf> {
        let watch = Watch {
            mp: &self.mp,
            status: self.status.as_ref(),
        };
        let k = at.slot;
        let device = self.args.devices.get(w * k..(w + 1) * k);
        let again = self.retrain.contains(&cell.id);
        let result = run_cell(
            cell, self.args, &self.exe, device, at.threads, again, alone, &watch,
        );
        if !matches!(result, Ok(CellRun::HeldElsewhere)) {
            self.attempted.lock().unwrap().insert(cell.id.clone());
        }
        let mut outcome = self.outcome.lock().unwrap();
        match result {
            Ok(CellRun::Done) => {
                outcome.done += 1;
                self.overall.inc(1);
            }
            Ok(CellRun::Failed(e)) => {
                outcome.failed += 1;
                self.overall.inc(1);
                let _ = self
                    .mp
                    .println(format!("cell {} ({}) failed: {e}", cell.id, cell.label));
            }
            Ok(CellRun::HeldElsewhere) => return Some(self.args.out.join(&cell.id)),
            Err(e) => {
                outcome.failed += 1;
                let _ = self.mp.println(format!("cell {}: {e:#}", cell.id));
            }
        }
        None
    }
}

/// Runs the cells of a grid that are not finished (or only the cells `args.cell` lists).
pub(crate) fn run(grid: &Grid, cells: &[Cell], args: &SweepArgs) -> Result<Outcome> {
    atomic::ensure_writable_dir(&args.out)?;
    atomic::write_bytes(
        &args.out.join("cells.json"),
        serde_json::to_string_pretty(cells)?.as_bytes(),
    )?;
    ensure_data(grid, cells, &args.out, args.quiet)?;
    let chosen = chosen(cells, args)?;
    let mp = if args.quiet {
        MultiProgress::with_draw_target(indicatif::ProgressDrawTarget::hidden())
    } else {
        MultiProgress::new()
    };
    let status = (!args.quiet && !std::io::stderr().is_terminal()).then(|| {
        let mut ids: Vec<String> = chosen.iter().map(|c| c.id.clone()).collect();
        ids.sort();
        ids.dedup();
        StatusLines {
            every: Duration::from_secs(args.status_every),
            out: args.out.clone(),
            ids,
            state: Mutex::new((std::time::Instant::now(), BTreeMap::new())),
        }
    });
    let overall = mp.add(ProgressBar::new(chosen.len() as u64));
    overall.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} cells {msg}").expect("template"),
    );
    let mut pool = Pool {
        args,
        exe: std::env::current_exe().context("cannot locate the attnsweep binary")?,
        outcome: Mutex::new(Outcome::default()),
        attempted: Mutex::new(BTreeSet::new()),
        retrain: BTreeSet::new(),
        mp,
        overall,
        status,
        deadline: args.stop_after.map(|d| std::time::Instant::now() + d),
        stopped: std::sync::atomic::AtomicBool::new(false),
    };
    if args.retrain {
        pool.retrain = retrain::to_retrain(cells, &chosen, &args.out, |s| pool.will_run(s));
        retrain::ensure_listed(&pool.retrain, cells, &chosen)?;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for w in waves(&chosen) {
        let at = placement(args, w.train, w.exclusive, cores);
        pool.run_wave(&chosen, &w.stages, at);
    }
    pool.overall.finish_and_clear();
    let mut o = pool.outcome.into_inner().unwrap();
    o.skipped = chosen.len() - o.done - o.failed;
    o.stopped = pool.stopped.into_inner();
    Ok(o)
}

/// The stages of `chosen` gathered into waves whose cells run at once, each stage in the
/// earliest wave after every wave holding a cell it continues from, evaluates or reads, that
/// trains where it trains (one placement serves them) and where neither is exclusive; else in a
/// wave of its own at the end. So `--devices 0,1 --cell 1,7` trains full attention's cell and
/// AHA's side by side, and two train stages with an evaluation listed between them still train
/// together, where stage by stage one GPU would idle.
fn waves<'c>(chosen: &[&'c Cell]) -> Vec<Wave<'c>> {
    let mut out: Vec<Wave> = Vec::new();
    let mut stages: Vec<&str> = Vec::new();
    for c in chosen {
        if !stages.contains(&c.stage.as_str()) {
            stages.push(&c.stage);
        }
    }
    for stage in stages {
        let of = || chosen.iter().filter(|c| c.stage == stage);
        let one = Wave {
            stages: vec![stage],
            train: of().any(|c| c.kind == StageKind::Train),
            exclusive: of().any(|c| c.exclusive),
            ids: of().map(|c| c.id.as_str()).collect(),
        };
        let waits = || of().flat_map(|c| c.depends_on.iter().chain(&c.reads));
        // The first wave it may run in: after the last one holding a cell it waits for.
        let after = out
            .iter()
            .rposition(|w| waits().any(|d| w.ids.contains(d.as_str())))
            .map_or(0, |i| i + 1);
        let fits = |w: &Wave| w.train == one.train && !w.exclusive && !one.exclusive;
        match out[after..].iter_mut().find(|w| fits(w)) {
            Some(w) => {
                w.stages.push(stage);
                w.ids.extend(one.ids);
            }
            None => out.push(one),
        }
    }
    out
}

/// Stages whose cells run at once (`waves`), with what places them: whether they train,
/// whether one is exclusive, and their cells' ids (what a later stage may wait for).
struct Wave<'c> {
    stages: Vec<&'c str>,
    train: bool,
    exclusive: bool,
    ids: BTreeSet<&'c str>,
}

/// How a wave's cells are placed: `workers` run at once, each on a slot of `slot` devices of
/// `--devices` (none on the CPU), with `threads` host threads.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Placement {
    workers: usize,
    slot: usize,
    threads: usize,
}

/// Whether worker `w`'s slot holds a GPU that `--devices` names more than once: a GPU the
/// user declared shared, whether or not another cell runs on it at the moment.
fn shares_a_gpu(devices: &[usize], at: Placement, w: usize) -> bool {
    devices.chunks(at.slot).nth(w).is_some_and(|mine| {
        mine.iter()
            .any(|g| devices.iter().filter(|x| *x == g).count() > 1)
    })
}

/// The placement of a wave (`waves`): on GPUs, a train stage's cells take `--gpus-per-cell` devices
/// each and an evaluation's or pruning's one (they run on one GPU, and the others would idle);
/// on the CPU, `--jobs` at once. An `exclusive` stage runs one cell at a time. The host's
/// `cores` are shared equally among the cells running at once.
fn placement(args: &SweepArgs, train: bool, exclusive: bool, cores: usize) -> Placement {
    let slot = match (args.devices.is_empty(), train) {
        (true, _) => 0,
        (false, true) => args.gpus_per_cell,
        (false, false) => 1,
    };
    let workers = match (exclusive, slot) {
        (true, _) => 1,
        (false, 0) => args.jobs.max(1),
        (false, k) => (args.devices.len() / k).max(1),
    };
    Placement {
        workers,
        slot,
        threads: (cores / workers).max(1),
    }
}

enum CellRun {
    Done,
    Failed(String),
    HeldElsewhere,
}

/// What shows a running cell's progress: its bar, and the status lines off a terminal.
struct Watch<'a> {
    mp: &'a MultiProgress,
    status: Option<&'a StatusLines>,
}

/// `retrain`: a finished cell is to be trained again (`sweep --retrain`).
fn run_cell(
    cell: &Cell,
    args: &SweepArgs,
    exe: &Path,
    device: Option<&[usize]>,
    threads: usize,
    retrain: bool,
    alone: bool,
    watch: &Watch,
) -> Result<CellRun> {
    let dir = args.out.join(&cell.id);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let Some(lock) = atomic::lock_file(&dir.join("lock"))? else {
        return Ok(CellRun::HeldElsewhere);
    };
    let mut previous = read_status(&dir);
    if retrain && retrain::weights_gone(&dir).unwrap_or(false) {
        if let Err(e) = retrain::set_aside(&dir) {
            // Whatever moved stays in before_retrain/; the cell says why it did not run.
            let error = format!("moving its earlier run aside to train it again: {e:#}");
            write_status(
                &dir,
                &Status {
                    state: State::Failed,
                    attempts: previous.map_or(0, |s| s.attempts) + 1,
                    error: Some(error.clone()),
                },
            )?;
            return Ok(CellRun::Failed(error));
        }
        previous = None;
    }
    // Another runner may have finished it between our listing and our lock.
    if previous.as_ref().is_some_and(|s| s.state == State::Done) {
        return Ok(CellRun::Done);
    }
    let attempts = previous.map_or(0, |s| s.attempts) + 1;
    // The cell as it ran, with whether its device ran nothing else meanwhile (its timings and
    // rates are then its own).
    let mut record = serde_json::to_value(cell)?;
    record["alone"] = serde_json::Value::Bool(alone);
    atomic::write_bytes(
        &dir.join("cell.json"),
        serde_json::to_string_pretty(&record)?.as_bytes(),
    )?;
    write_status(
        &dir,
        &Status {
            state: State::Running,
            attempts,
            error: None,
        },
    )?;
    let fail = |error: String| -> Result<CellRun> {
        write_status(
            &dir,
            &Status {
                state: State::Failed,
                attempts,
                error: Some(error.clone()),
            },
        )?;
        Ok(CellRun::Failed(error))
    };
    let mut cmd = match cell_command(cell, args, exe, &dir)? {
        Ok(cmd) => cmd,
        Err(error) => return fail(error),
    };
    if let Some(slot) = device {
        let ids: Vec<String> = slot.iter().map(|d| d.to_string()).collect();
        cmd.env("CUDA_VISIBLE_DEVICES", ids.join(","));
    }
    cmd.env("OMP_NUM_THREADS", threads.to_string());
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("log.txt"))?;
    // The child's stdin is the locked file, so the lock lives as long as the child does: a
    // runner killed mid-cell asks its child to stop (`util::process::tie_to_parent`), and no
    // other runner starts the cell until both are gone.
    cmd.stdin(Stdio::from(lock.try_clone()?))
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log));
    let status = watch_child(cell, cmd, exe, &dir, watch)?;
    fault::point("sweep_cell_finished");
    if status.success() {
        write_status(
            &dir,
            &Status {
                state: State::Done,
                attempts,
                error: None,
            },
        )?;
        if args.drop_optimizer && cell.kind == StageKind::Train {
            checkpoint::drop_optimizer_state(&dir)?;
        }
        Ok(CellRun::Done)
    } else {
        let text = std::fs::read_to_string(dir.join("log.txt")).unwrap_or_default();
        let error = text
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("exited with an error")
            .to_string();
        fail(error)
    }
}

/// The command that runs `cell` in `dir` (`attnsweep train`, `eval` or `prune`), or the reason
/// it cannot run: a dependency that did not finish, a usage to match that is not there.
fn cell_command(
    cell: &Cell,
    args: &SweepArgs,
    exe: &Path,
    dir: &Path,
) -> Result<std::result::Result<Command, String>> {
    let dep_dir = cell.depends_on.as_ref().map(|d| args.out.join(d));
    let reads_dir = cell.reads.as_ref().map(|d| args.out.join(d));
    for d in dep_dir.iter().chain(&reads_dir) {
        if read_status(d).is_none_or(|s| s.state != State::Done) {
            return Ok(Err(format!("dependency {} did not finish", d.display())));
        }
    }
    if let Some(d) = dep_dir
        .as_ref()
        .filter(|_| retrain::reads_dependency(cell, dir))
    {
        match retrain::weights_gone(d) {
            Ok(false) => {}
            Ok(true) => {
                return Ok(Err(format!(
                    "dependency {} finished but its weights are not there (a results folder \
                     keeps none): run the sweep again with --retrain --retry-failed to make \
                     them again and run this cell",
                    d.display()
                )))
            }
            Err(e) => return Ok(Err(format!("dependency {}: {e:#}", d.display()))),
        }
    }
    let mut cmd = Command::new(exe);
    match cell.kind {
        StageKind::Train => {
            // `{source}` in a setting names the directory of the cell this one depends on
            // (e.g. a head ranking written by that cell's evaluation).
            // and `{reads}` that of the cell it reads.
            let shown = |d: &Option<PathBuf>| {
                d.as_ref()
                    .map(|d| d.display().to_string())
                    .unwrap_or_default()
            };
            let mut config = cell.config.clone();
            if cell.match_usage {
                let read = reads_dir.as_ref().expect("match_usage cells read a cell");
                // Matched gate by gate: random gates open where (which heads, which layers)
                // and as often as the learned ones, so the control differs only in which
                // tokens open them.
                match usage_of(read, config.attention.method) {
                    Ok((mu_f, per_gate)) => {
                        config.attention.bernoulli_p = mu_f;
                        config.attention.bernoulli_rates = per_gate;
                    }
                    Err(e) => return Ok(Err(format!("{e:#}"))),
                }
            }
            atomic::write_bytes(
                &dir.join("cell.toml"),
                config
                    .to_toml()
                    .replace("{source}", &shown(&dep_dir))
                    .replace("{reads}", &shown(&reads_dir))
                    .as_bytes(),
            )?;
            cmd.args(["train", "-q", "--out"]).arg(&dir);
            if dir.join("config.toml").exists() {
                cmd.arg("--resume");
            } else {
                cmd.arg("--config").arg(dir.join("cell.toml"));
                if let Some(d) = dep_dir.as_ref().or(cell.pretrained.as_ref()) {
                    cmd.arg("--init-from").arg(d);
                }
            }
            // Data parallel over its slot's GPUs, whatever ranks the grid's config names: a
            // slot of one GPU trains one rank over all the micro-batches (the same global batch).
            let mut ranks = config.train.ranks;
            if !args.devices.is_empty() {
                ranks = args.gpus_per_cell;
                cmd.arg("--gpus").arg(ranks.to_string());
            }
            // Always said, so a cell resumed without the flag runs its passes apart again.
            let micro = match args.join_micro_batches {
                true => config.train.share(ranks),
                false => 0,
            };
            cmd.arg("--set").arg(format!("train.micro_batch={micro}"));
            // A step captured (by the flag or the grid) where one GPU runs it as one pass and
            // the config lets a replay stand for the steps; the others run eagerly.
            let graph = (args.cuda_graph || config.train.cuda_graph)
                && ranks == 1
                && (args.join_micro_batches || config.train.grad_accum == 1)
                && config.graph_refusal().is_none();
            cmd.arg("--set").arg(format!("train.cuda_graph={graph}"));
        }
        // The pretrained weights evaluated as the cell's config (`model/`) describes them.
        StageKind::Eval if dep_dir.is_none() => {
            let weights = cell
                .pretrained
                .as_ref()
                .expect("eval cells without a dependency evaluate the pretrained model");
            std::fs::create_dir_all(dir.join("model"))?;
            atomic::write_bytes(
                &dir.join("model/config.toml"),
                cell.config.to_toml().as_bytes(),
            )?;
            cmd.args(["eval", "-q", "--run"])
                .arg(dir.join("model"))
                .arg("--ckpt")
                .arg(weights)
                .arg("--out")
                .arg(dir.join("eval"));
        }
        StageKind::Eval => {
            let d = dep_dir.as_ref().expect("eval cells depend on a cell");
            cmd.args(["eval", "-q", "--run"])
                .arg(d)
                .arg("--out")
                .arg(dir.join("eval"));
            // A setting naming `{source}` or `{reads}` came from the evaluated cell, whose
            // config holds it resolved (eval stages may not set one of their own).
            for (k, v) in cell.settings.iter().filter(|(_, v)| !has_placeholder(v)) {
                cmd.arg("--set").arg(format!("{k}={v}"));
            }
        }
        StageKind::Prune => {
            let d = dep_dir.as_ref().expect("prune cells depend on a cell");
            cmd.args(["prune", "--run"]).arg(d).arg("--out").arg(&dir);
            cmd.arg("--threshold")
                .arg(cell.threshold.expect("prune threshold").to_string());
        }
    }
    Ok(Ok(cmd))
}

/// Starts `cmd` and waits for it, showing the cell's progress (training's logged steps, or a
/// spinner) on its bar and in the status lines.
fn watch_child(
    cell: &Cell,
    mut cmd: Command,
    exe: &Path,
    dir: &Path,
    watch: &Watch,
) -> Result<std::process::ExitStatus> {
    let mp = watch.mp;
    // Training shows its steps; evaluation and pruning, which log no steps, a spinner.
    let bar = match cell.kind {
        StageKind::Train => {
            let b = mp.add(ProgressBar::new(cell.config.train.steps as u64));
            b.set_style(
                ProgressStyle::with_template("  {bar:20} {pos}/{len} {msg}").expect("template"),
            );
            b
        }
        _ => {
            let b = mp.add(ProgressBar::new_spinner());
            b.set_style(
                ProgressStyle::with_template("  {spinner} {elapsed} {msg}").expect("template"),
            );
            b
        }
    };
    bar.set_message(format!("{} {}", cell.stage, cell.label));
    // A killed sweep stops its cells (each resumes when the sweep runs again) rather than
    // leave them training on, orphaned, on GPUs a restarted sweep would place others on.
    crate::util::process::tie_to_parent(&mut cmd);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {}", exe.display()))?;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        let progress = match cell.kind {
            StageKind::Train => {
                let step = last_logged_step(&dir.join("train_log.csv"));
                bar.set_position(step);
                format!("step {step}/{}", cell.config.train.steps)
            }
            _ => {
                bar.tick();
                format!("{:?} {}s", cell.kind, bar.elapsed().as_secs()).to_lowercase()
            }
        };
        if let Some(s) = watch.status {
            s.set(&cell.id, Some(progress));
            s.tick();
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    if let Some(s) = watch.status {
        s.set(&cell.id, None);
    }
    bar.finish_and_clear();
    mp.remove(&bar);
    Ok(status)
}

fn last_logged_step(log: &Path) -> u64 {
    std::fs::read_to_string(log)
        .ok()
        .and_then(|t| {
            t.lines()
                .last()
                .and_then(|l| l.split(',').next())
                .and_then(|s| s.parse().ok())
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random gates matched to a routed cell read its usage gate by gate as its method's gates
    /// sit: an L2A or SwiAttn layer's one rate (the report repeats it over the heads), an AHA
    /// layer's rate a head; every matched config passes the config's check.
    #[test]
    fn matched_rates_have_one_entry_a_gate() {
        let g = report::GateReport {
            mu_f: 0.1,
            per_layer: vec![0.0, 0.2],
            per_head: vec![vec![0.0; 4], vec![0.1, 0.2, 0.3, 0.2]],
            gaps: Vec::new(),
            censored_heads: 0,
            need: None,
        };
        assert_eq!(per_gate(&g, Gates::PerToken), [vec![0.0], vec![0.2]]);
        assert_eq!(per_gate(&g, Gates::PerHead), g.per_head);
        for (method, gates) in [("l2a", Gates::PerToken), ("aha", Gates::PerHead)] {
            let mut c = crate::config::Config::load(
                None,
                &[
                    format!("attention.method={method}"),
                    "attention.router=bernoulli".into(),
                    "model.num_hidden_layers=2".into(),
                    "model.num_attention_heads=4".into(),
                    "model.num_key_value_heads=4".into(),
                ],
            )
            .unwrap();
            c.attention.bernoulli_rates = per_gate(&g, gates);
            c.validate().unwrap();
        }
    }

    /// A sweep's options with these devices, GPUs a train cell and CPU jobs, the rest off.
    fn args(devices: Vec<usize>, gpus_per_cell: usize, jobs: usize) -> SweepArgs {
        SweepArgs {
            out: PathBuf::new(),
            jobs,
            devices,
            gpus_per_cell,
            cell: vec![],
            retry_failed: false,
            drop_optimizer: false,
            join_micro_batches: false,
            cuda_graph: false,
            retrain: false,
            stop_after: None,
            quiet: true,
            status_every: 30,
        }
    }

    /// Stages run together where nothing between them waits: train stages that do not
    /// continue from each other, then the evaluations of all. A stage joins the earliest wave
    /// of its kind after every wave holding a cell it continues from, evaluates or reads (any
    /// of a wave's stages, not only the last), even past a wave of the other kind; it starts a
    /// wave of its own where none fits, and where it or the wave is exclusive.
    #[test]
    fn independent_stages_run_in_one_wave() {
        let stage = |name: &str, rest: &str| format!("[[stage]]\nname = \"{name}\"\n{rest}\n");
        let lr = |x: &str| format!("set = {{ \"train.lr\" = {x} }}");
        let text = [
            "name = \"t\"\n".to_string(),
            stage("base", ""),
            stage("aha", "init_from = \"base\"\nset = { \"attention.method\" = \"aha\" }"),
            stage("full", &lr("2e-3")),
            stage("ranked", &format!("init_from = \"base\"\nreads = \"aha\"\n{}", lr("3e-3"))),
            stage("after_aha", &format!("init_from = \"aha\"\n{}", lr("4e-3"))),
            stage("after_ranked", &format!("init_from = \"ranked\"\n{}", lr("5e-3"))),
            stage("probes_base", "kind = \"eval\"\nof = \"base\""),
            stage("probes_full", "kind = \"eval\"\nof = \"full\""),
            stage(
                "timed",
                "kind = \"eval\"\nof = \"full\"\nexclusive = true\nset = { \"eval.timing\" = true }",
            ),
            stage("last", "kind = \"eval\"\nof = \"aha\""),
            stage("late", &lr("6e-3")),
        ]
        .concat();
        let grid: super::super::Grid = toml::from_str(&text).unwrap();
        let cells = super::super::expand(&grid).unwrap();
        let stages = |chosen: &[&Cell]| -> Vec<Vec<String>> {
            let names = |w: Wave| w.stages.iter().map(|s| s.to_string()).collect();
            waves(chosen).into_iter().map(names).collect()
        };
        let all: Vec<&Cell> = cells.iter().collect();
        assert_eq!(
            stages(&all),
            [
                vec!["base", "full", "late"],
                vec!["aha"],
                vec!["ranked", "after_aha"],
                vec!["after_ranked"],
                vec!["probes_base", "probes_full", "last"],
                vec!["timed"],
            ]
        );
        // Two train stages with an evaluation listed between them train together (before,
        // the second waited for the first's evaluation and one GPU idled).
        let some: Vec<&Cell> = cells
            .iter()
            .filter(|c| ["aha", "last", "late"].contains(&c.stage.as_str()))
            .collect();
        assert_eq!(stages(&some), [vec!["aha", "late"], vec!["last"]]);
        // A run of some cells (`--cell`) gathers those it runs.
        let some: Vec<&Cell> = cells
            .iter()
            .filter(|c| ["full", "probes_full", "aha"].contains(&c.stage.as_str()))
            .collect();
        assert_eq!(stages(&some), [vec!["aha", "full"], vec!["probes_full"]]);
    }

    /// A train cell placed on GPUs trains over its slot's: one rank on a slot of one GPU
    /// whatever train.ranks its grid names (four ranks cannot share one GPU), and no rank
    /// count is imposed where no devices are named.
    #[test]
    fn train_cells_train_over_their_slot() {
        let grid: super::super::Grid = toml::from_str(
            "name = \"t\"\n[base.train]\nranks = 4\ngrad_accum = 4\n[[stage]]\nname = \"full\"\n",
        )
        .unwrap();
        let cells = super::super::expand(&grid).unwrap();
        let root = std::env::temp_dir().join(format!("attnsweep-slot-{}", std::process::id()));
        let dir = root.join("cell");
        std::fs::create_dir_all(&dir).unwrap();
        let gpus = |devices: Vec<usize>, k: usize| {
            let a = SweepArgs {
                out: root.clone(),
                ..args(devices, k, 1)
            };
            let cmd = cell_command(&cells[0], &a, Path::new("attnsweep"), &dir)
                .unwrap()
                .unwrap();
            let v: Vec<String> = cmd
                .get_args()
                .map(|x| x.to_string_lossy().into_owned())
                .collect();
            v.iter()
                .position(|x| x == "--gpus")
                .map(|i| v[i + 1].clone())
        };
        assert_eq!(gpus(vec![0], 1).as_deref(), Some("1"));
        assert_eq!(gpus(vec![0, 1], 2).as_deref(), Some("2"));
        assert_eq!(gpus(vec![], 1), None);
        let _ = std::fs::remove_dir_all(&root);
    }

    /// `--cell` lists cells in any order and runs them in the grid's; a listed cell waits on
    /// no unfinished dependency unless that one is listed too; an index past the grid's is
    /// refused.
    #[test]
    fn listed_cells_run_in_grid_order_with_their_dependencies() {
        let grid: super::super::Grid = toml::from_str(
            "name = \"t\"\n[[stage]]\nname = \"base\"\n[[stage]]\nname = \"aha\"\ninit_from = \"base\"\n\
             set = { \"attention.method\" = \"aha\" }\naxes = { \"attention.window\" = [4, 8] }\n",
        )
        .unwrap();
        let cells = super::super::expand(&grid).unwrap();
        let out = std::env::temp_dir().join(format!("attnsweep-listed-{}", std::process::id()));
        let args = |cell: Vec<usize>| SweepArgs {
            out: out.clone(),
            cell,
            ..args(vec![], 1, 1)
        };
        let indices = |listed: Vec<&Cell>| listed.iter().map(|c| c.index).collect::<Vec<_>>();
        assert_eq!(indices(chosen(&cells, &args(vec![])).unwrap()), [0, 1, 2]);
        assert_eq!(
            indices(chosen(&cells, &args(vec![2, 0, 2])).unwrap()),
            [0, 2]
        );
        // Both listed cells wait on the unfinished base: one error names it by index and
        // gives the list that runs them all.
        let e = format!("{:#}", chosen(&cells, &args(vec![2, 1])).unwrap_err());
        assert!(
            e.contains("its dependency base-") && e.contains("(cell 0)"),
            "{e}"
        );
        assert!(e.ends_with("--cell 0,1,2"), "{e}");
        let e = format!("{:#}", chosen(&cells, &args(vec![0, 7])).unwrap_err());
        assert!(e.contains("--cell 7") && e.contains("0 ..= 2"), "{e}");
        // An evaluation of an AHA cell waits on that cell and, through it, on the base: the
        // list names both.
        let grid: super::super::Grid = toml::from_str(
            "name = \"t\"\n[[stage]]\nname = \"base\"\n[[stage]]\nname = \"aha\"\ninit_from = \"base\"\n\
             set = { \"attention.method\" = \"aha\" }\naxes = { \"attention.window\" = [4, 8] }\n\
             [[stage]]\nname = \"tau\"\nkind = \"eval\"\nof = \"aha\"\naxes = { \"attention.tau\" = [0.3] }\n",
        )
        .unwrap();
        let cells = super::super::expand(&grid).unwrap();
        let eval = cells
            .iter()
            .find(|c| c.id.starts_with("tau"))
            .unwrap()
            .index;
        let e = format!("{:#}", chosen(&cells, &args(vec![eval])).unwrap_err());
        let aha = cells
            .iter()
            .find(|c| Some(&c.id) == cells[eval].depends_on.as_ref());
        let want = format!("--cell 0,{},{eval}", aha.unwrap().index);
        assert!(e.ends_with(&want), "{e}");
    }

    /// On four GPUs at four a train cell, a train stage runs one cell over all four and an
    /// evaluation stage four cells, one a GPU; an exclusive stage one cell; on the CPU --jobs
    /// cells. The host's cores are shared among the cells running at once.
    #[test]
    fn train_cells_take_their_slot_and_evaluations_one_gpu() {
        let four = args(vec![0, 1, 2, 3], 4, 1);
        let at = |workers, slot, threads| Placement {
            workers,
            slot,
            threads,
        };
        assert_eq!(placement(&four, true, false, 64), at(1, 4, 64));
        assert_eq!(placement(&four, false, false, 64), at(4, 1, 16));
        assert_eq!(placement(&four, false, true, 64), at(1, 1, 64));
        let pairs = args(vec![0, 1, 2, 3], 2, 1);
        assert_eq!(placement(&pairs, true, false, 64), at(2, 2, 32));
        let cpu = args(vec![], 1, 3);
        assert_eq!(placement(&cpu, true, false, 2), at(3, 0, 1));
        assert_eq!(placement(&cpu, false, true, 8), at(1, 0, 8));
        // Two cells on GPU 0, one on GPU 1: the first two share, the third is alone; an
        // evaluation slot of one GPU on [0, 1, 0, 1] shares with the worker two along.
        let twice = args(vec![0, 0, 1], 1, 1);
        let t = placement(&twice, true, false, 48);
        assert_eq!(t, at(3, 1, 16));
        let shared: Vec<bool> = (0..3).map(|w| shares_a_gpu(&twice.devices, t, w)).collect();
        assert_eq!(shared, [true, true, false]);
        assert!(!shares_a_gpu(&four.devices, at(4, 1, 16), 2));
        assert!(shares_a_gpu(&[0, 1, 0, 1], at(4, 1, 16), 1));
    }
}
