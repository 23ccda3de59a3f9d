//! Sweeps: a grid file expands into cells, each a run with its own directory
//! (`<out>/<cell id>/`) holding its resolved config, log, checkpoints, evaluation and status.
//!
//! A grid file is TOML:
//!
//! ```toml
//! name = "demo"                     # results go to results/<name> unless --out says otherwise
//! [synth]                           # optional: generate the synthetic corpus at base.data.dir
//! train_tokens = 300000             #   when no data set is there (fields of `data synth`)
//! [base]                            # an experiment config ([base.model], [base.train], ...)
//! data.dir = "runs/demo/data"
//! [[stage]]                         # stages run in order
//! name = "base"
//! set = { "attention.method" = "full" }
//! [[stage]]
//! name = "aha"
//! init_from = "base"                # continue from the matching cell of an earlier stage
//! set = { "attention.method" = "aha" }
//! axes = { "attention.window" = [4, 8, 16] }    # cartesian product
//! zip = { "attention.lambda" = [1e-3, 1e-2], "train.lr" = [1e-3, 2e-3] }  # advanced together
//! include = [{ "attention.window" = 64 }]       # extra cells
//! exclude = [{ "attention.window" = 16, "attention.lambda" = 1e-2 }]
//! [[stage]]
//! name = "tau"
//! kind = "eval"                     # evaluate each cell of stage `of` with the overrides
//! of = "l2a"
//! axes = { "attention.tau" = [0.3, 0.5, 0.7] }
//! [[stage]]
//! name = "prune"
//! kind = "prune"                    # L2A pruning of each cell of stage `of`
//! of = "l2a"
//! thresholds = [0.9, 0.95]
//! ```
//!
//! In string settings, `{source}` stands for the directory of the cell a cell depends on,
//! e.g. `"attention.head_ranking" = "{source}/eval/head_ranking.csv"`.
//!
//! A cell's id is its stage name plus a hash of what it computes (resolved config, the cell it
//! starts from, its kind), so it does not depend on how the grid file orders its keys, and an
//! edited grid reuses every cell whose computation did not change. A cell depends on the one
//! cell of the referenced stage whose settings agree with its own on every key both set.
//!
//! Runners coordinate through the file system: a cell is run under an exclusive lock on
//! `<cell>/lock` (released by the OS when a runner dies), its state is `<cell>/status.json`
//! (written atomically), so re-running a sweep skips finished cells, resumes interrupted ones
//! and reruns failed ones only with `--retry-failed`.

use crate::atomic;
use crate::config::{apply_override, Config};
use crate::data::{self, SynthSpec};
use anyhow::{bail, ensure, Context, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct Grid {
    pub name: String,
    #[serde(default)]
    pub synth: Option<SynthSection>,
    #[serde(default)]
    pub base: toml::Table,
    #[serde(rename = "stage")]
    pub stages: Vec<Stage>,
}

/// `data synth` parameters; the corpus is generated at `base.data.dir` when it holds none.
#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields, default)]
pub struct SynthSection {
    pub seed: u64,
    pub vocab_size: usize,
    pub n_keys: usize,
    pub n_values: usize,
    pub branch: usize,
    pub event_rate: f64,
    pub alpha: f64,
    pub min_distance: usize,
    pub max_distance: usize,
    pub train_tokens: usize,
    pub val_tokens: usize,
}

impl Default for SynthSection {
    fn default() -> Self {
        let s = SynthSpec::default();
        SynthSection {
            seed: s.seed,
            vocab_size: s.vocab_size,
            n_keys: s.n_keys,
            n_values: s.n_values,
            branch: s.branch,
            event_rate: s.event_rate,
            alpha: s.alpha,
            min_distance: s.min_distance,
            max_distance: s.max_distance,
            train_tokens: s.train_tokens,
            val_tokens: s.val_tokens,
        }
    }
}

impl SynthSection {
    fn spec(&self) -> SynthSpec {
        SynthSpec {
            seed: self.seed,
            vocab_size: self.vocab_size,
            n_keys: self.n_keys,
            n_values: self.n_values,
            branch: self.branch,
            event_rate: self.event_rate,
            alpha: self.alpha,
            min_distance: self.min_distance,
            max_distance: self.max_distance,
            train_tokens: self.train_tokens,
            val_tokens: self.val_tokens,
        }
    }
}

#[derive(Deserialize, Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StageKind {
    Train,
    Eval,
    Prune,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct Stage {
    pub name: String,
    #[serde(default = "default_kind")]
    pub kind: StageKind,
    /// train: continue from the matching cell of this stage.
    #[serde(default)]
    pub init_from: Option<String>,
    /// eval and prune: the stage whose cells they work on.
    #[serde(default)]
    pub of: Option<String>,
    #[serde(default)]
    pub set: toml::Table,
    #[serde(default)]
    pub axes: toml::Table,
    #[serde(default)]
    pub zip: toml::Table,
    #[serde(default)]
    pub include: Vec<toml::Table>,
    #[serde(default)]
    pub exclude: Vec<toml::Table>,
    /// prune: the sparsity thresholds.
    #[serde(default)]
    pub thresholds: Vec<f64>,
}

fn default_kind() -> StageKind {
    StageKind::Train
}

/// One expanded cell.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Cell {
    /// Position in the expanded grid (what `--cell` and Slurm array tasks name).
    pub index: usize,
    pub id: String,
    pub stage: String,
    pub kind: StageKind,
    /// The settings that distinguish this cell within its stage (`key=value ...`).
    pub label: String,
    /// The varied settings behind the label (for eval and prune cells, those of the cell
    /// they act on too).
    pub assignment: BTreeMap<String, toml::Value>,
    /// Every override applied on top of the base, by dotted key.
    pub settings: BTreeMap<String, toml::Value>,
    /// Cell this one starts from (train) or works on (eval, prune).
    pub depends_on: Option<String>,
    pub threshold: Option<f64>,
    /// The fully resolved config (for eval cells: the evaluated model's, with overrides).
    pub config: Config,
}

#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Running,
    Done,
    Failed,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Status {
    pub state: State,
    pub attempts: u32,
    pub error: Option<String>,
}

pub fn read_grid(path: &Path) -> Result<Grid> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read grid {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("invalid grid {}", path.display()))
}

/// 64-bit FNV-1a: a hash whose value never changes between builds or platforms.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn value_str(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The assignments of one stage: the cartesian product of its axes (zipped keys advancing
/// together as one axis), minus exclusions, plus inclusions.
fn assignments(stage: &Stage) -> Result<Vec<BTreeMap<String, toml::Value>>> {
    let list = |k: &str, v: &toml::Value| -> Result<Vec<toml::Value>> {
        match v {
            toml::Value::Array(a) if !a.is_empty() => Ok(a.clone()),
            _ => bail!("stage {}: axis {k:?} must be a non-empty list", stage.name),
        }
    };
    let mut product: Vec<BTreeMap<String, toml::Value>> = vec![BTreeMap::new()];
    for (k, v) in &stage.axes {
        let values = list(k, v)?;
        product = product
            .into_iter()
            .flat_map(|a| {
                values.iter().map(move |x| {
                    let mut a = a.clone();
                    a.insert(k.clone(), x.clone());
                    a
                })
            })
            .collect();
    }
    if !stage.zip.is_empty() {
        let cols: Vec<(String, Vec<toml::Value>)> = stage
            .zip
            .iter()
            .map(|(k, v)| Ok((k.clone(), list(k, v)?)))
            .collect::<Result<_>>()?;
        let n = cols[0].1.len();
        ensure!(
            cols.iter().all(|(_, c)| c.len() == n),
            "stage {}: zipped axes must have equal lengths",
            stage.name
        );
        product = product
            .into_iter()
            .flat_map(|a| {
                let cols = &cols;
                (0..n).map(move |i| {
                    let mut a = a.clone();
                    for (k, c) in cols {
                        a.insert(k.clone(), c[i].clone());
                    }
                    a
                })
            })
            .collect();
    }
    // A stage of includes alone has only those cells.
    if stage.axes.is_empty() && stage.zip.is_empty() && !stage.include.is_empty() {
        product.clear();
    }
    let excluded = |a: &BTreeMap<String, toml::Value>| {
        stage
            .exclude
            .iter()
            .any(|ex| ex.iter().all(|(k, v)| a.get(k) == Some(v)))
    };
    product.retain(|a| !excluded(a));
    for inc in &stage.include {
        product.push(inc.iter().map(|(k, v)| (k.clone(), v.clone())).collect());
    }
    Ok(product)
}

fn resolve(
    base: &toml::Table,
    overrides: &BTreeMap<String, toml::Value>,
    what: &str,
) -> Result<Config> {
    let mut tree = base.clone();
    for (k, v) in overrides {
        apply_override(&mut tree, &format!("{k}={v}")).with_context(|| format!("{what}: {k}"))?;
    }
    let cfg: Config = toml::Value::Table(tree)
        .try_into()
        .with_context(|| format!("{what}: invalid config"))?;
    cfg.validate()
        .with_context(|| format!("{what}: invalid config"))?;
    Ok(cfg)
}

/// Expands and validates a grid: every cell resolves to a valid config and finds its
/// dependency. Nothing runs.
pub fn expand(grid: &Grid) -> Result<Vec<Cell>> {
    ensure!(
        !grid.stages.is_empty(),
        "grid {} has no [[stage]]",
        grid.name
    );
    ensure!(
        !grid.name.is_empty()
            && grid
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'),
        "grid name {:?} must be letters, digits, '_' or '-'",
        grid.name
    );
    let mut cells: Vec<Cell> = Vec::new();
    for (si, stage) in grid.stages.iter().enumerate() {
        let what = format!("stage {:?}", stage.name);
        ensure!(
            grid.stages[..si].iter().all(|s| s.name != stage.name),
            "{what} is defined twice"
        );
        let earlier = |name: &Option<String>, field: &str| -> Result<Option<String>> {
            match name {
                None => Ok(None),
                Some(n) if grid.stages[..si].iter().any(|s| &s.name == n) => Ok(Some(n.clone())),
                Some(n) => bail!("{what}: {field} = {n:?} names no earlier stage"),
            }
        };
        let source = match stage.kind {
            StageKind::Train => {
                ensure!(
                    stage.of.is_none(),
                    "{what}: `of` is for eval and prune stages; train stages use init_from"
                );
                ensure!(
                    stage.thresholds.is_empty(),
                    "{what}: thresholds are for prune stages"
                );
                earlier(&stage.init_from, "init_from")?
            }
            StageKind::Eval | StageKind::Prune => {
                ensure!(
                    stage.init_from.is_none(),
                    "{what}: init_from is for train stages"
                );
                let of = earlier(&stage.of, "of")?;
                ensure!(of.is_some(), "{what}: a {:?} stage needs `of`", stage.kind);
                of
            }
        };
        if stage.kind == StageKind::Prune {
            ensure!(
                !stage.thresholds.is_empty(),
                "{what}: a prune stage needs thresholds"
            );
            ensure!(
                stage.axes.is_empty() && stage.zip.is_empty() && stage.include.is_empty(),
                "{what}: prune stages take thresholds, not axes"
            );
        }
        let stage_assignments = match stage.kind {
            StageKind::Prune => vec![BTreeMap::new()],
            _ => assignments(stage)?,
        };
        // (assignment, dependency, threshold) of every cell of the stage.
        let mut plans: Vec<(BTreeMap<String, toml::Value>, Option<Cell>, Option<f64>)> = Vec::new();
        match (&source, stage.kind) {
            (None, _) => plans.extend(stage_assignments.into_iter().map(|a| (a, None, None))),
            // A train cell continues from the one cell of the source stage that agrees with
            // it on every varied key both stages have.
            (Some(src), StageKind::Train) => {
                for a in stage_assignments {
                    let matches: Vec<&Cell> = cells
                        .iter()
                        .filter(|c| {
                            &c.stage == src
                                && c.assignment
                                    .iter()
                                    .all(|(k, v)| a.get(k).is_none_or(|x| x == v))
                        })
                        .collect();
                    ensure!(
                        matches.len() == 1,
                        "{what}: {} cells of stage {src:?} match {{{}}}; vary a key they share to pick one",
                        matches.len(),
                        label(&a)
                    );
                    let dep = matches[0].clone();
                    plans.push((a, Some(dep), None));
                }
            }
            // Eval and prune cells act on every cell of their source stage.
            (Some(src), _) => {
                for d in cells.iter().filter(|c| &c.stage == src) {
                    if stage.kind == StageKind::Prune {
                        plans.extend(
                            stage
                                .thresholds
                                .iter()
                                .map(|&t| (BTreeMap::new(), Some(d.clone()), Some(t))),
                        );
                    } else {
                        plans.extend(
                            stage_assignments
                                .iter()
                                .map(|a| (a.clone(), Some(d.clone()), None)),
                        );
                    }
                }
            }
        }
        for (assignment, dep, threshold) in plans {
            let mut settings: BTreeMap<String, toml::Value> = stage
                .set
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            settings.extend(assignment.clone());
            // Eval and prune cells act on the model of the cell they depend on.
            let (config, settings) = match (&dep, stage.kind) {
                (Some(d), StageKind::Eval) => {
                    let mut s = d.settings.clone();
                    s.extend(settings);
                    (resolve(&grid.base, &s, &what)?, s)
                }
                (Some(d), StageKind::Prune) => (d.config.clone(), d.settings.clone()),
                _ => (resolve(&grid.base, &settings, &what)?, settings),
            };
            let fingerprint = format!(
                "{:?}\n{}\n{}\n{:?}",
                stage.kind,
                config.non_default_toml(),
                dep.as_ref().map_or("", |d| d.id.as_str()),
                threshold.map(|t| t.to_bits())
            );
            let id = format!("{}-{:08x}", stage.name, fnv1a(fingerprint.as_bytes()) >> 32);
            ensure!(
                !cells.iter().any(|c| c.id == id),
                "{what}: two cells compute the same thing ({})",
                label(&assignment)
            );
            // The label names what varies: the dependency's varied keys, then this cell's.
            let mut shown = dep
                .as_ref()
                .map(|d| d.assignment.clone())
                .unwrap_or_default();
            if stage.kind != StageKind::Train {
                shown.extend(assignment.clone());
            } else {
                shown = assignment.clone();
            }
            let mut lab = label(&shown);
            if let Some(t) = threshold {
                lab = format!("{lab} threshold={t}").trim().to_string();
            }
            cells.push(Cell {
                index: cells.len(),
                id,
                stage: stage.name.clone(),
                kind: stage.kind,
                label: lab,
                assignment: shown,
                settings,
                depends_on: dep.map(|d| d.id),
                threshold,
                config,
            });
        }
    }
    Ok(cells)
}

fn label(a: &BTreeMap<String, toml::Value>) -> String {
    a.iter()
        .map(|(k, v)| format!("{k}={}", value_str(v)))
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn read_status(cell_dir: &Path) -> Option<Status> {
    std::fs::read_to_string(cell_dir.join("status.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
}

fn write_status(cell_dir: &Path, status: &Status) -> Result<()> {
    atomic::write_bytes(
        &cell_dir.join("status.json"),
        serde_json::to_string_pretty(status)?.as_bytes(),
    )
}

/// Options of one `attnsweep sweep` invocation.
pub struct SweepArgs {
    pub out: PathBuf,
    pub jobs: usize,
    pub devices: Vec<usize>,
    pub cell: Option<usize>,
    pub retry_failed: bool,
    pub quiet: bool,
}

/// What a run of the sweep ended with.
#[derive(Debug, Default, PartialEq)]
pub struct Outcome {
    pub done: usize,
    pub failed: usize,
    pub skipped: usize,
}

fn ensure_data(grid: &Grid, cells: &[Cell], out: &Path) -> Result<()> {
    let Some(synth) = &grid.synth else {
        return Ok(());
    };
    let dir = &cells[0].config.data.dir;
    if dir.join("meta.json").exists() {
        return Ok(());
    }
    // One runner generates; others wait on the lock and then find the data set.
    let lock = std::fs::File::create(out.join("data.lock"))?;
    lock.lock()?;
    if !dir.join("meta.json").exists() {
        data::synth(&synth.spec(), dir).with_context(|| {
            format!(
                "generating the grid's synthetic corpus at {}",
                dir.display()
            )
        })?;
    }
    Ok(())
}

/// Runs the cells of a grid that are not finished (or only cell `args.cell`).
pub fn run(grid: &Grid, cells: &[Cell], args: &SweepArgs) -> Result<Outcome> {
    atomic::ensure_writable_dir(&args.out)?;
    atomic::write_bytes(
        &args.out.join("cells.json"),
        serde_json::to_string_pretty(cells)?.as_bytes(),
    )?;
    ensure_data(grid, cells, &args.out)?;
    let exe = std::env::current_exe().context("cannot locate the attnsweep binary")?;
    let outcome = Mutex::new(Outcome::default());
    // Each cell is attempted at most once per invocation, so a failing cell cannot loop.
    let attempted = Mutex::new(std::collections::BTreeSet::<String>::new());
    let mp = if args.quiet {
        MultiProgress::with_draw_target(indicatif::ProgressDrawTarget::hidden())
    } else {
        MultiProgress::new()
    };
    let chosen: Vec<&Cell> = match args.cell {
        Some(k) => {
            let c = cells.get(k).with_context(|| {
                format!("--cell {k}: the grid has cells 0 ..= {}", cells.len() - 1)
            })?;
            if let Some(dep) = &c.depends_on {
                let st = read_status(&args.out.join(dep));
                ensure!(
                    st.is_some_and(|s| s.state == State::Done),
                    "--cell {k}: its dependency {dep} is not finished"
                );
            }
            vec![c]
        }
        None => cells.iter().collect(),
    };
    let overall = mp.add(ProgressBar::new(chosen.len() as u64));
    overall.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} cells {msg}").expect("template"),
    );
    let workers = args.devices.len().max(args.jobs).max(1);
    let threads_per_job =
        (std::thread::available_parallelism().map_or(1, |n| n.get()) / workers).max(1);
    let stages: Vec<&str> = {
        let mut s: Vec<&str> = Vec::new();
        for c in &chosen {
            if !s.contains(&c.stage.as_str()) {
                s.push(&c.stage);
            }
        }
        s
    };
    for stage in stages {
        // Loop until every cell of the stage has a final state: cells another runner holds
        // are waited for, and taken over if that runner dies before finishing them.
        loop {
            let pending: Vec<&Cell> = chosen
                .iter()
                .copied()
                .filter(|c| c.stage == stage)
                .filter(|c| !attempted.lock().unwrap().contains(&c.id))
                .filter(|c| match read_status(&args.out.join(&c.id)) {
                    Some(s) if s.state == State::Done => false,
                    Some(s) if s.state == State::Failed => args.retry_failed,
                    // Never started, or interrupted (a runner died while it ran): run/resume.
                    _ => true,
                })
                .collect();
            if pending.is_empty() {
                break;
            }
            let next = AtomicUsize::new(0);
            let held_elsewhere = Mutex::new(Vec::<PathBuf>::new());
            std::thread::scope(|s| {
                for w in 0..workers.min(pending.len()) {
                    let (next, pending, held_elsewhere, outcome, overall, mp, exe, attempted) = (
                        &next,
                        &pending,
                        &held_elsewhere,
                        &outcome,
                        &overall,
                        &mp,
                        &exe,
                        &attempted,
                    );
                    s.spawn(move || loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        let Some(cell) = pending.get(i) else { break };
                        let device = args.devices.get(w).copied();
                        let result = run_cell(cell, args, exe, device, threads_per_job, mp);
                        if !matches!(result, Ok(CellRun::HeldElsewhere)) {
                            attempted.lock().unwrap().insert(cell.id.clone());
                        }
                        match result {
                            Ok(CellRun::Done) => {
                                outcome.lock().unwrap().done += 1;
                                overall.inc(1);
                            }
                            Ok(CellRun::Failed(e)) => {
                                outcome.lock().unwrap().failed += 1;
                                overall.inc(1);
                                let _ = mp.println(format!(
                                    "cell {} ({}) failed: {e}",
                                    cell.id, cell.label
                                ));
                            }
                            Ok(CellRun::HeldElsewhere) => {
                                held_elsewhere.lock().unwrap().push(args.out.join(&cell.id))
                            }
                            Err(e) => {
                                outcome.lock().unwrap().failed += 1;
                                let _ = mp.println(format!("cell {}: {e:#}", cell.id));
                            }
                        }
                    });
                }
            });
            let held = held_elsewhere.into_inner().unwrap();
            if held.is_empty() {
                break;
            }
            for dir in held {
                // Blocks until the other runner releases the cell (or dies).
                if let Ok(f) = std::fs::File::open(dir.join("lock")) {
                    let _ = f.lock();
                }
            }
        }
    }
    overall.finish_and_clear();
    let mut o = outcome.into_inner().unwrap();
    o.skipped = chosen.len() - o.done - o.failed;
    Ok(o)
}

enum CellRun {
    Done,
    Failed(String),
    HeldElsewhere,
}

fn run_cell(
    cell: &Cell,
    args: &SweepArgs,
    exe: &Path,
    device: Option<usize>,
    threads: usize,
    mp: &MultiProgress,
) -> Result<CellRun> {
    let dir = args.out.join(&cell.id);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let lock = std::fs::File::create(dir.join("lock"))?;
    if lock.try_lock().is_err() {
        return Ok(CellRun::HeldElsewhere);
    }
    // Another runner may have finished it between our listing and our lock.
    let previous = read_status(&dir);
    if previous.as_ref().is_some_and(|s| s.state == State::Done) {
        return Ok(CellRun::Done);
    }
    let attempts = previous.map_or(0, |s| s.attempts) + 1;
    atomic::write_bytes(
        &dir.join("cell.json"),
        serde_json::to_string_pretty(cell)?.as_bytes(),
    )?;
    write_status(
        &dir,
        &Status {
            state: State::Running,
            attempts,
            error: None,
        },
    )?;
    let dep_dir = cell.depends_on.as_ref().map(|d| args.out.join(d));
    if let Some(d) = &dep_dir {
        if read_status(d).is_none_or(|s| s.state != State::Done) {
            let error = format!("dependency {} did not finish", d.display());
            write_status(
                &dir,
                &Status {
                    state: State::Failed,
                    attempts,
                    error: Some(error.clone()),
                },
            )?;
            return Ok(CellRun::Failed(error));
        }
    }
    let mut cmd = Command::new(exe);
    match cell.kind {
        StageKind::Train => {
            // `{source}` in a setting names the directory of the cell this one depends on
            // (e.g. a head ranking written by that cell's evaluation).
            let source = dep_dir
                .as_ref()
                .map(|d| d.display().to_string())
                .unwrap_or_default();
            atomic::write_bytes(
                &dir.join("cell.toml"),
                cell.config
                    .to_toml()
                    .replace("{source}", &source)
                    .as_bytes(),
            )?;
            cmd.args(["train", "-q", "--out"]).arg(&dir);
            if dir.join("config.toml").exists() {
                cmd.arg("--resume");
            } else {
                cmd.arg("--config").arg(dir.join("cell.toml"));
                if let Some(d) = &dep_dir {
                    cmd.arg("--init-from").arg(d);
                }
            }
        }
        StageKind::Eval => {
            let d = dep_dir.as_ref().expect("eval cells depend on a cell");
            cmd.args(["eval", "-q", "--run"])
                .arg(d)
                .arg("--out")
                .arg(dir.join("eval"));
            let dep_settings = &cell.settings;
            for (k, v) in dep_settings {
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
    if let Some(dev) = device {
        cmd.env("CUDA_VISIBLE_DEVICES", dev.to_string());
    }
    cmd.env("OMP_NUM_THREADS", threads.to_string());
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("log.txt"))?;
    // The child's stdin is the locked file, so the lock lives as long as the child does: a
    // runner killed mid-cell leaves its child to finish, and no other runner starts the cell
    // until both are gone.
    cmd.stdin(Stdio::from(lock.try_clone()?))
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log));
    let bar = mp.add(ProgressBar::new(cell.config.train.steps as u64));
    bar.set_style(ProgressStyle::with_template("  {bar:20} {pos}/{len} {msg}").expect("template"));
    bar.set_message(format!("{} {}", cell.stage, cell.label));
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {}", exe.display()))?;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if cell.kind == StageKind::Train {
            bar.set_position(last_logged_step(&dir.join("train_log.csv")));
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    bar.finish_and_clear();
    mp.remove(&bar);
    crate::fault::point("sweep_cell_finished");
    if status.success() {
        write_status(
            &dir,
            &Status {
                state: State::Done,
                attempts,
                error: None,
            },
        )?;
        Ok(CellRun::Done)
    } else {
        let text = std::fs::read_to_string(dir.join("log.txt")).unwrap_or_default();
        let error = text
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("exited with an error")
            .to_string();
        write_status(
            &dir,
            &Status {
                state: State::Failed,
                attempts,
                error: Some(error.clone()),
            },
        )?;
        Ok(CellRun::Failed(error))
    }
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

/// Writes a Slurm job array per stage (one array task per cell, each running
/// `attnsweep sweep --grid G --cell K`) and `submit.sh`, which submits them in stage order,
/// each stage waiting for the previous one.
pub fn emit_slurm(grid_path: &Path, grid: &Grid, cells: &[Cell], out: &Path) -> Result<PathBuf> {
    let dir = out.join("slurm");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let exe = std::env::current_exe()?;
    let grid_abs = std::fs::canonicalize(grid_path)?;
    let out_abs = std::fs::canonicalize(out)?;
    let mut submit = String::from("#!/usr/bin/env bash\n# Submits the sweep's stages in order; each stage waits for the one before.\nset -euo pipefail\ncd \"$(dirname \"$0\")\"\nprev=\n");
    for stage in &grid.stages {
        let idx: Vec<usize> = cells
            .iter()
            .filter(|c| c.stage == stage.name)
            .map(|c| c.index)
            .collect();
        let (lo, hi) = (idx[0], idx[idx.len() - 1]);
        let script = format!(
            "#!/usr/bin/env bash\n#SBATCH --job-name={name}-{stage}\n#SBATCH --array={lo}-{hi}\n#SBATCH --output={out}/slurm/{stage}-%a.log\n# Site options (partition, time, --gres=gpu:1, ...) go here or on the sbatch command line.\nset -euo pipefail\ncd {cwd}\nexec {exe} sweep --grid {grid} --out {out} --cell \"$SLURM_ARRAY_TASK_ID\" --quiet\n",
            name = grid.name,
            stage = stage.name,
            out = out_abs.display(),
            cwd = std::env::current_dir()?.display(),
            exe = exe.display(),
            grid = grid_abs.display(),
        );
        atomic::write_bytes(
            &dir.join(format!("{}.sbatch", stage.name)),
            script.as_bytes(),
        )?;
        submit.push_str(&format!(
            "jid=$(sbatch --parsable ${{prev:+--dependency=afterany:$prev}} {}.sbatch)\necho \"stage {}: job $jid\"\nprev=$jid\n",
            stage.name, stage.name
        ));
    }
    let submit_path = dir.join("submit.sh");
    atomic::write_bytes(&submit_path, submit.as_bytes())?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&submit_path, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(submit_path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid(text: &str) -> Grid {
        toml::from_str(text).unwrap()
    }

    const BASE: &str = r#"
name = "t"
[base.data]
dir = "/tmp/none"
[base.train]
steps = 10
warmup_steps = 1
"#;

    #[test]
    fn expansion_product_zip_include_exclude_and_dependencies() {
        let g = grid(&format!(
            r#"{BASE}
[[stage]]
name = "base"
set = {{ "attention.method" = "full" }}
[[stage]]
name = "aha"
init_from = "base"
set = {{ "attention.method" = "aha" }}
axes = {{ "attention.window" = [4, 8, 16] }}
zip = {{ "attention.lambda" = [0.001, 0.01], "train.lr" = [0.001, 0.002] }}
exclude = [{{ "attention.window" = 16, "attention.lambda" = 0.01 }}]
include = [{{ "attention.window" = 64, "attention.lambda" = 0.1 }}]
[[stage]]
name = "tau"
kind = "eval"
of = "aha"
axes = {{ "attention.tau" = [0.3, 0.7] }}
"#
        ));
        let cells = expand(&g).unwrap();
        let aha: Vec<&Cell> = cells.iter().filter(|c| c.stage == "aha").collect();
        assert_eq!(aha.len(), 3 * 2 - 1 + 1);
        assert!(aha
            .iter()
            .all(|c| c.depends_on.as_deref() == Some(cells[0].id.as_str())));
        assert!(aha
            .iter()
            .any(|c| c.config.attention.window == 64 && c.config.attention.lambda == 0.1));
        assert!(!aha
            .iter()
            .any(|c| c.config.attention.window == 16 && c.config.attention.lambda == 0.01));
        let zipped = aha
            .iter()
            .find(|c| c.config.attention.lambda == 0.01)
            .unwrap();
        assert_eq!(zipped.config.train.lr, 0.002);
        // An eval cell per (trained cell, tau), evaluating that cell's model.
        let tau: Vec<&Cell> = cells.iter().filter(|c| c.stage == "tau").collect();
        assert_eq!(tau.len(), aha.len() * 2);
        for c in &tau {
            let dep = cells
                .iter()
                .find(|d| Some(&d.id) == c.depends_on.as_ref())
                .unwrap();
            assert_eq!(dep.stage, "aha");
            assert_eq!(c.config.attention.window, dep.config.attention.window);
        }
        let ids: std::collections::BTreeSet<&str> = cells.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids.len(), cells.len(), "ids are unique");
        assert_eq!(
            cells.iter().map(|c| c.index).collect::<Vec<_>>(),
            (0..cells.len()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn ids_are_stable_under_key_reordering() {
        let a = grid(&format!(
            r#"{BASE}
[[stage]]
name = "s"
set = {{ "attention.method" = "swa", "train.lr" = 0.01 }}
axes = {{ "attention.window" = [4, 8], "attention.hybrid_every" = [2] }}
"#
        ));
        let b = grid(
            r#"
name = "t"
[base.train]
warmup_steps = 1
steps = 10
[base.data]
dir = "/tmp/none"
[[stage]]
name = "s"
axes = { "attention.hybrid_every" = [2], "attention.window" = [4, 8] }
set = { "train.lr" = 0.01, "attention.method" = "swa" }
"#,
        );
        let ids = |g: &Grid| {
            expand(g)
                .unwrap()
                .into_iter()
                .map(|c| c.id)
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(&a), ids(&b));
        // A change in what a cell computes changes its id.
        let c = grid(&format!(
            r#"{BASE}
[[stage]]
name = "s"
set = {{ "attention.method" = "swa", "train.lr" = 0.02 }}
axes = {{ "attention.window" = [4, 8], "attention.hybrid_every" = [2] }}
"#
        ));
        assert_ne!(ids(&a), ids(&c));
    }

    #[test]
    fn every_grid_in_the_repository_expands() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("sweeps");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let p = entry.unwrap().path();
            if p.extension().is_some_and(|e| e == "toml") {
                let g = read_grid(&p).unwrap();
                let cells = expand(&g).unwrap_or_else(|e| panic!("{}: {e:#}", p.display()));
                assert!(cells.len() > 1, "{}", p.display());
                n += 1;
            }
        }
        assert!(n >= 7, "only {n} grids");
    }

    #[test]
    fn invalid_grids_are_rejected_before_anything_runs() {
        let err = |extra: &str| {
            format!(
                "{:#}",
                expand(&grid(&format!("{BASE}{extra}"))).unwrap_err()
            )
        };
        assert!(err("\n[[stage]]\nname = \"a\"\ninit_from = \"nope\"\n")
            .contains("names no earlier stage"));
        assert!(
            err("\n[[stage]]\nname = \"a\"\naxes = { \"attention.window\" = [0] }\n")
                .contains("attention.window")
        );
        assert!(
            err("\n[[stage]]\nname = \"a\"\naxes = { \"attention.windw\" = [4] }\n")
                .contains("windw")
        );
        assert!(err("\n[[stage]]\nname = \"a\"\nzip = { \"train.lr\" = [0.1, 0.2], \"train.seed\" = [1] }\n").contains("equal lengths"));
        assert!(err("\n[[stage]]\nname = \"a\"\nkind = \"eval\"\n").contains("needs `of`"));
        let two = "\n[[stage]]\nname = \"b\"\naxes = { \"train.seed\" = [1, 2] }\n[[stage]]\nname = \"c\"\ninit_from = \"b\"\n";
        assert!(err(two).contains("2 cells of stage \"b\" match"));
        assert!(
            err("\n[[stage]]\nname = \"a\"\n[[stage]]\nname = \"a\"\n").contains("defined twice")
        );
    }
}
