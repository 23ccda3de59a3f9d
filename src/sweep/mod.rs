//! Sweeps: a grid file expands into cells, each a run with its own directory
//! (`<out>/<cell id>/`) holding its resolved config, log, checkpoints, evaluation and status.
//!
//! A grid file is TOML:
//!
//! ```toml
//! name = "demo"                     # results go to results/<name> unless --out says otherwise
//! [synth]                           # optional: generate the synthetic corpus at base.data.dir
//! train_tokens = 300000             #   when no data set is there (fields of `data synth`)
//! # or [corpus]: prepare a text corpus there instead (fields of `data prepare`), e.g.
//! # python_package = "torch", glob = ["*.py"]
//! # and [probes] (fields of `data probes`): probe documents at base.data.dir, mixed into
//! # that corpus, which then goes to probes.mix_with
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
//! In string settings, `{source}` stands for the directory of the cell a cell starts from,
//! and `{reads}` for that of the cell named by the stage's `reads` (a train stage's second
//! dependency, whose files it reads without taking its weights), e.g. static heads trained
//! from the base with `reads = "aha"` and `"attention.head_ranking" =
//! "{reads}/eval/head_ranking.csv"` (eval and prune stages act on a cell whose config holds
//! them resolved, and may not set one of their own). A train stage with `reads` and Bernoulli gates may set
//! `match_usage = true`: its gates then open at the usage (mu_f) the read cell's evaluation
//! measured, which is only known once that cell has run (gates at random against learned
//! ones at equal sparsity).
//!
//! A cell's id is its stage name plus a hash of what it computes (resolved config with the
//! settings its method ignores set aside, the cells it starts from and reads, its kind), so it
//! does not depend on how the grid file orders its keys, an edited grid reuses every cell whose
//! computation did not change, and a stage that computes what an earlier one did shares that
//! cell (same id and directory) instead of running it twice. A stage that expands to no cells
//! is an error. A cell depends on the one cell of the referenced stage whose settings agree
//! with its own on every key both set.
//!
//! Runners coordinate through the file system: a cell is run under an exclusive lock on
//! `<cell>/lock` (released by the OS when a runner dies), its state is `<cell>/status.json`
//! (written atomically), so re-running a sweep skips finished cells, resumes interrupted ones
//! and reruns failed ones only with `--retry-failed`.

pub mod pareto;
pub mod plot;
pub mod tables;

use crate::util::atomic;
use crate::config::{apply_override, Config, Method, Router};
use crate::data::corpus::{self, PrepareSpec};
use crate::data::{self, SynthSpec};
use crate::data::probes::ProbesArgs;
use anyhow::{bail, ensure, Context, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct Grid {
    pub name: String,
    /// `data synth`'s settings (unset ones at their defaults): the corpus is generated at
    /// `base.data.dir` when it holds none.
    #[serde(default)]
    pub synth: Option<SynthSpec>,
    /// `data prepare`'s settings: a text corpus prepared at `base.data.dir` when it holds
    /// none (instead of `[synth]`).
    #[serde(default)]
    pub corpus: Option<PrepareSpec>,
    /// `data probes`' settings: probe documents written at `base.data.dir`, mixed into the
    /// `[corpus]` or `[synth]` data set, which is then prepared at `probes.mix_with`.
    #[serde(default)]
    pub probes: Option<ProbesArgs>,
    #[serde(default)]
    pub base: toml::Table,
    #[serde(rename = "stage")]
    pub stages: Vec<Stage>,
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
    /// train: a stage whose matching cell this one reads files of (`{reads}` in string
    /// settings names its directory) without starting from its weights; e.g. static top-k
    /// heads ranked by an AHA cell but trained from the same base for the same budget.
    #[serde(default)]
    pub reads: Option<String>,
    /// train, with `reads` and Bernoulli gates: draw them at the usage (mu_f) the read
    /// cell's evaluation measured, so random gates open as often as its learned ones.
    #[serde(default)]
    pub match_usage: bool,
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
    /// Cell whose files this one reads (a stage's `reads`).
    #[serde(default)]
    pub reads: Option<String>,
    /// Its Bernoulli gates open at the read cell's measured usage (a stage's `match_usage`).
    #[serde(default)]
    pub match_usage: bool,
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
    Config::from_tree(tree).with_context(|| format!("{what}: invalid config"))
}

/// The one cell of stage `src` that agrees with assignment `a` on every varied key both
/// have (cells that compute the same thing share one id, and count once).
fn matching_cell<'a>(
    cells: &'a [Cell],
    src: &str,
    a: &BTreeMap<String, toml::Value>,
    what: &str,
) -> Result<&'a Cell> {
    let mut matches: Vec<&Cell> = cells
        .iter()
        .filter(|c| {
            c.stage == src
                && c.assignment
                    .iter()
                    .all(|(k, v)| a.get(k).is_none_or(|x| x == v))
        })
        .collect();
    let mut seen = std::collections::BTreeSet::new();
    matches.retain(|c| seen.insert(c.id.clone()));
    ensure!(
        matches.len() == 1,
        "{what}: {} cells of stage {src:?} match {{{}}}; vary a key they share to pick one",
        matches.len(),
        label(a)
    );
    Ok(matches[0])
}

/// Expands and validates a grid: every cell resolves to a valid config and finds its
/// dependency. Nothing runs. A cell that computes what an earlier one computes (the same
/// config once the settings its method ignores are set aside, the same starting point and
/// kind) shares that cell's id and directory, so it is run once.
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
    crate::config::reject_non_finite(&grid.base, "base.")?;
    ensure!(
        grid.synth.is_none() || grid.corpus.is_none(),
        "grid {}: [synth] and [corpus] both describe the data set at base.data.dir; keep one",
        grid.name
    );
    if let Some(s) = &grid.synth {
        s.validate().context("in the grid's [synth]")?;
    }
    if let Some(c) = &grid.corpus {
        c.validate().context("in the grid's [corpus]")?;
    }
    if let Some(p) = &grid.probes {
        p.validate().context("in the grid's [probes]")?;
        let corpus = grid.synth.is_some() || grid.corpus.is_some();
        ensure!(
            !corpus || p.mix_with.is_some(),
            "grid {}: [probes] mixes into the [corpus] or [synth] data set, which needs a place \
             of its own: set probes.mix_with (e.g. the directory another grid prepares it at)",
            grid.name
        );
        let data_dir = grid
            .base
            .get("data")
            .and_then(|d| d.get("dir"))
            .and_then(|d| d.as_str());
        let same = matches!((&p.mix_with, data_dir), (Some(m), Some(d)) if m == Path::new(d));
        ensure!(
            !same,
            "grid {}: probes.mix_with is base.data.dir, where the mixed data set goes; give the \
             corpus a directory of its own",
            grid.name
        );
    }
    let mut cells: Vec<Cell> = Vec::new();
    // Each id's hash with the whole fingerprint behind it: a shared id must mean the same
    // computation, not a collision of the 32-bit hashes.
    let mut fingerprints: BTreeMap<String, String> = BTreeMap::new();
    for (si, stage) in grid.stages.iter().enumerate() {
        let what = format!("stage {:?}", stage.name);
        ensure!(
            grid.stages[..si].iter().all(|s| s.name != stage.name),
            "{what} is defined twice"
        );
        let earlier = |name: &Option<String>, field: &str| -> Result<Option<&Stage>> {
            match name {
                None => Ok(None),
                Some(n) => match grid.stages[..si].iter().find(|s| &s.name == n) {
                    Some(s) => Ok(Some(s)),
                    None => bail!("{what}: {field} = {n:?} names no earlier stage"),
                },
            }
        };
        let (source, reads) = match stage.kind {
            StageKind::Train => {
                ensure!(
                    stage.of.is_none(),
                    "{what}: `of` is for eval and prune stages; train stages use init_from"
                );
                ensure!(
                    stage.thresholds.is_empty(),
                    "{what}: thresholds are for prune stages"
                );
                let from = earlier(&stage.init_from, "init_from")?;
                if let Some(f) = from.filter(|f| f.kind == StageKind::Eval) {
                    bail!(
                        "{what}: init_from = {:?} names a stage of kind eval, whose cells hold no weights to start from",
                        f.name
                    );
                }
                (from, earlier(&stage.reads, "reads")?)
            }
            StageKind::Eval | StageKind::Prune => {
                ensure!(
                    stage.init_from.is_none() && stage.reads.is_none(),
                    "{what}: init_from and reads are for train stages"
                );
                if let Some(k) = stage
                    .set
                    .iter()
                    .chain(stage.axes.iter())
                    .find(|(_, v)| has_placeholder(v))
                    .map(|(k, _)| k)
                {
                    bail!(
                        "{what}: {k} holds {{source}} or {{reads}}, which only train stages \
                         resolve; give the path itself"
                    );
                }
                let of = earlier(&stage.of, "of")?;
                let Some(of) = of else {
                    bail!("{what}: a {:?} stage needs `of`", stage.kind)
                };
                // Evaluation needs a model: a trained or a pruned one; pruning a trained one.
                let allowed = match stage.kind {
                    StageKind::Eval => of.kind != StageKind::Eval,
                    _ => of.kind == StageKind::Train,
                };
                ensure!(
                    allowed,
                    "{what}: of = {:?} names a stage of kind {}, whose cells hold no model to {}",
                    of.name,
                    format!("{:?}", of.kind).to_lowercase(),
                    if stage.kind == StageKind::Eval {
                        "evaluate"
                    } else {
                        "prune"
                    }
                );
                (Some(of), None)
            }
        };
        let source = source.map(|s| s.name.clone());
        let reads = reads.map(|s| s.name.clone());
        if stage.kind == StageKind::Prune {
            ensure!(
                !stage.thresholds.is_empty(),
                "{what}: a prune stage needs thresholds"
            );
            if let Some(t) = stage.thresholds.iter().find(|t| !(0.0..=1.0).contains(*t)) {
                bail!("{what}: threshold {t} is outside 0 ..= 1 (a layer is pruned when its sparsity, 1 - its mean gate, reaches the threshold)");
            }
            ensure!(
                stage.axes.is_empty() && stage.zip.is_empty() && stage.include.is_empty(),
                "{what}: prune stages take thresholds, not axes"
            );
            let of = source.as_deref().expect("prune stages have `of`");
            if let Some(c) = cells
                .iter()
                .find(|c| c.stage == of && c.config.attention.method != Method::L2a)
            {
                bail!(
                    "{what}: pruning removes L2A's global modules, but cell {} ({}) of stage {of:?} trains method {:?}",
                    c.id,
                    c.label,
                    c.config.attention.method
                );
            }
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
                    let dep = matching_cell(&cells, src, &a, &what)?.clone();
                    plans.push((a, Some(dep), None));
                }
            }
            // Eval and prune cells act on every cell of their source stage.
            (Some(src), _) => {
                let mut seen = std::collections::BTreeSet::new();
                let deps: Vec<&Cell> = cells
                    .iter()
                    .filter(|c| &c.stage == src && seen.insert(c.id.clone()))
                    .collect();
                for d in deps {
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
        let first = cells.len();
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
            let read = match &reads {
                Some(r) => Some(matching_cell(&cells, r, &assignment, &what)?.id.clone()),
                None => None,
            };
            if stage.match_usage {
                let a = &config.attention;
                ensure!(
                    read.is_some() && a.method.is_routed() && a.router == Router::Bernoulli,
                    "{what}: match_usage draws Bernoulli gates at the usage of the cell it \
                     reads: it needs reads = \"<stage>\" and a routed method with \
                     attention.router = \"bernoulli\""
                );
            }
            let fingerprint = format!(
                "{:?}\n{}\n{}\n{:?}{}{}",
                stage.kind,
                config.canonical().non_default_toml(),
                dep.as_ref().map_or("", |d| d.id.as_str()),
                threshold.map(|t| t.to_bits()),
                read.as_ref()
                    .map_or(String::new(), |r| format!("\nreads {r}")),
                if stage.match_usage {
                    "\nmatch_usage"
                } else {
                    ""
                }
            );
            let hash = format!("-{:08x}", fnv1a(fingerprint.as_bytes()) >> 32);
            match fingerprints.get(&hash) {
                Some(f) if *f != fingerprint => bail!(
                    "{what}: two different cells share the hash {hash}; change any setting of one"
                ),
                _ => fingerprints.insert(hash.clone(), fingerprint),
            };
            let id = cells
                .iter()
                .find(|c| c.id.ends_with(&hash))
                .map_or_else(|| format!("{}{hash}", stage.name), |c| c.id.clone());
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
                reads: read,
                match_usage: stage.match_usage,
                threshold,
                config,
            });
        }
        ensure!(
            cells.len() > first,
            "{what} expands to no cells (every assignment is excluded, or the stage it works on has none); give it axes, include or set"
        );
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

/// Whether a setting's value names a directory a train cell resolves when it starts.
fn has_placeholder(v: &toml::Value) -> bool {
    let text = v.to_string();
    text.contains("{source}") || text.contains("{reads}")
}

/// The full-attention usage (mu_f) a finished routed cell's evaluation measured.
fn usage_of(cell_dir: &Path) -> Result<f64> {
    let eval = cell_dir.join("eval");
    let report = crate::run::eval::read_report(&eval)?
        .with_context(|| format!("{} holds no evaluation to match usage with", eval.display()))?;
    report.report.gates.map(|g| g.mu_f).with_context(|| {
        format!(
            "{} has no gates (its method routes nothing): match_usage needs a routed cell",
            cell_dir.display()
        )
    })
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
    /// Seconds between status lines when stderr is not a terminal.
    pub status_every: u64,
}

/// The cells (ids, once each) of `cells` that `args` would run and whose last attempt failed.
pub fn failed_cells(cells: &[Cell], args: &SweepArgs) -> Vec<String> {
    let ids: std::collections::BTreeSet<String> = cells
        .iter()
        .filter(|c| args.cell.is_none_or(|k| c.index == k))
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
pub struct Outcome {
    pub done: usize,
    pub failed: usize,
    pub skipped: usize,
}

/// Generates the grid's synthetic corpus or prepares its text corpus at `base.data.dir` when
/// no data set is there yet; with `[probes]`, that corpus goes to `probes.mix_with` (kept
/// when one is there) and the probes mixed into it to `base.data.dir`.
fn ensure_data(grid: &Grid, cells: &[Cell], out: &Path, quiet: bool) -> Result<()> {
    if grid.synth.is_none() && grid.corpus.is_none() && grid.probes.is_none() {
        return Ok(());
    }
    let dir = &cells[0].config.data.dir;
    if dir.join("meta.json").exists() {
        return Ok(());
    }
    // One runner generates; others wait on the lock and then find the data set.
    let lock = std::fs::File::create(out.join("data.lock"))?;
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

/// Runs the cells of a grid that are not finished (or only cell `args.cell`).
pub fn run(grid: &Grid, cells: &[Cell], args: &SweepArgs) -> Result<Outcome> {
    atomic::ensure_writable_dir(&args.out)?;
    atomic::write_bytes(
        &args.out.join("cells.json"),
        serde_json::to_string_pretty(cells)?.as_bytes(),
    )?;
    ensure_data(grid, cells, &args.out, args.quiet)?;
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
                format!(
                    "--cell {k}: the grid has cells 0 ..= {}",
                    cells.len().saturating_sub(1)
                )
            })?;
            for dep in c.depends_on.iter().chain(&c.reads) {
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
                    let watch = Watch {
                        mp,
                        status: status.as_ref(),
                    };
                    s.spawn(move || loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        let Some(cell) = pending.get(i) else { break };
                        let device = args.devices.get(w).copied();
                        let result = run_cell(cell, args, exe, device, threads_per_job, &watch);
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

/// What shows a running cell's progress: its bar, and the status lines off a terminal.
struct Watch<'a> {
    mp: &'a MultiProgress,
    status: Option<&'a StatusLines>,
}

fn run_cell(
    cell: &Cell,
    args: &SweepArgs,
    exe: &Path,
    device: Option<usize>,
    threads: usize,
    watch: &Watch,
) -> Result<CellRun> {
    let mp = watch.mp;
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
    let reads_dir = cell.reads.as_ref().map(|d| args.out.join(d));
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
    for d in dep_dir.iter().chain(&reads_dir) {
        if read_status(d).is_none_or(|s| s.state != State::Done) {
            return fail(format!("dependency {} did not finish", d.display()));
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
                match usage_of(read) {
                    Ok(mu_f) => config.attention.bernoulli_p = mu_f,
                    Err(e) => return fail(format!("{e:#}")),
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
    crate::util::fault::point("sweep_cell_finished");
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
        fail(error)
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
        let (Some(&lo), Some(&hi)) = (idx.first(), idx.last()) else {
            bail!("stage {:?} has no cells", stage.name);
        };
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

    /// A setting the cell's method ignores does not make it another cell: two stages that
    /// compute the same thing share one id (run once), and a later stage's dependency on
    /// either finds that one cell.
    #[test]
    fn cells_that_compute_the_same_thing_are_one_cell() {
        let g = grid(&format!(
            r#"{BASE}
[[stage]]
name = "base"
set = {{ "attention.method" = "full" }}
[[stage]]
name = "full"
init_from = "base"
set = {{ "attention.method" = "full", "attention.lambda" = 0.5 }}
[[stage]]
name = "cpt"
init_from = "base"
set = {{ "attention.method" = "full", "attention.window" = 8 }}
[[stage]]
name = "zs"
kind = "eval"
of = "cpt"
set = {{ "attention.method" = "swa" }}
"#
        ));
        let cells = expand(&g).unwrap();
        assert_eq!(cells.len(), 4);
        assert_eq!(cells[1].id, cells[2].id, "one full-attention continuation");
        assert!(cells[1].id.starts_with("full-"));
        assert_eq!(cells[3].depends_on.as_deref(), Some(cells[1].id.as_str()));
    }

    /// `reads` names a second dependency, whose directory `{reads}` stands for, without
    /// taking its weights: the static heads start from the base like the AHA cell.
    #[test]
    fn a_stage_reads_another_without_starting_from_it() {
        let g = grid(&format!(
            r#"{BASE}
[[stage]]
name = "base"
set = {{ "attention.method" = "full" }}
[[stage]]
name = "aha"
init_from = "base"
set = {{ "attention.method" = "aha" }}
[[stage]]
name = "static"
init_from = "base"
reads = "aha"
set = {{ "attention.method" = "static_heads", "attention.head_ranking" = "{{reads}}/eval/head_ranking.csv" }}
axes = {{ "attention.top_k" = [1, 16] }}
"#
        ));
        let cells = expand(&g).unwrap();
        let (base, aha) = (&cells[0].id, &cells[1].id);
        for c in &cells[2..] {
            assert_eq!(c.depends_on.as_ref(), Some(base));
            assert_eq!(c.reads.as_ref(), Some(aha));
        }
        assert_ne!(cells[2].id, cells[3].id);
    }

    /// What a run would only find out later is refused at expansion, naming the stage.
    #[test]
    fn stages_that_cannot_run_are_refused_when_expanded() {
        let err = |extra: &str| {
            format!(
                "{:#}",
                expand(&grid(&format!("{BASE}{extra}"))).unwrap_err()
            )
        };
        let e = err("\n[[stage]]\nname = \"a\"\naxes = { \"attention.window\" = [4] }\nexclude = [{ \"attention.window\" = 4 }]\n");
        assert!(e.contains("stage \"a\" expands to no cells"), "{e}");
        let base = "\n[[stage]]\nname = \"b\"\nset = { \"attention.method\" = \"l2a\" }\n";
        let e = err(&format!(
            "{base}[[stage]]\nname = \"p\"\nkind = \"prune\"\nof = \"b\"\nthresholds = [1.5]\n"
        ));
        assert!(e.contains("threshold 1.5") && e.contains("0 ..= 1"), "{e}");
        let e = err("\n[[stage]]\nname = \"b\"\n[[stage]]\nname = \"p\"\nkind = \"prune\"\nof = \"b\"\nthresholds = [0.9]\n");
        assert!(e.contains("trains method Full"), "{e}");
        let e = err(&format!(
            "{base}[[stage]]\nname = \"e\"\nkind = \"eval\"\nof = \"b\"\n[[stage]]\nname = \"p\"\nkind = \"prune\"\nof = \"e\"\nthresholds = [0.9]\n"
        ));
        assert!(
            e.contains("kind eval, whose cells hold no model to prune"),
            "{e}"
        );
        // Only train stages resolve directory placeholders.
        let e = err(&format!(
            "{base}[[stage]]\nname = \"e\"\nkind = \"eval\"\nof = \"b\"\nset = {{ \"attention.head_ranking\" = \"{{source}}/r.csv\" }}\n"
        ));
        assert!(
            e.contains("stage \"e\"") && e.contains("only train stages"),
            "{e}"
        );
        // Matching usage needs a cell to read and gates drawn at random.
        for stage in [
            "name = \"m\"\nmatch_usage = true\nset = { \"attention.method\" = \"aha\", \"attention.router\" = \"bernoulli\" }",
            "name = \"m\"\nreads = \"b\"\nmatch_usage = true\nset = { \"attention.method\" = \"aha\" }",
        ] {
            let e = err(&format!("{base}[[stage]]\n{stage}\n"));
            assert!(e.contains("stage \"m\"") && e.contains("match_usage"), "{e}");
        }
        let e = err("\n[[stage]]\nname = \"a\"\naxes = { \"attention.tau\" = [0.5, nan] }\n");
        assert!(e.contains("attention.tau") && e.contains("finite"), "{e}");
        let e = format!(
            "{:#}",
            expand(&grid(
                "name = \"t\"\n[base.train]\nlr = inf\n[[stage]]\nname = \"a\"\n"
            ))
            .unwrap_err()
        );
        assert!(e.contains("base.train.lr"), "{e}");
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
