//! A grid file's cells: stages expanded over their axes into cells, each a run whose id is a
//! hash of what it computes (see the folder's documentation).

use crate::config;
use crate::config::{apply_override, Config, Router};
use crate::data::corpus::PrepareSpec;
use crate::data::probes::ProbesArgs;
use crate::data::SynthSpec;
use crate::model::attention::{spec, Gates};
use crate::util::flags::compact;
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct Grid {
    pub(crate) name: String,
    /// `data synth`'s settings (unset ones at their defaults): the corpus is generated at
    /// `base.data.dir` when it holds none.
    #[serde(default)]
    pub(crate) synth: Option<SynthSpec>,
    /// `data prepare`'s settings: a text corpus prepared at `base.data.dir` when it holds
    /// none (instead of `[synth]`).
    #[serde(default)]
    pub(crate) corpus: Option<PrepareSpec>,
    /// `data probes`' settings: probe documents written at `base.data.dir`, mixed into the
    /// `[corpus]` or `[synth]` data set, which is then prepared at `probes.mix_with`.
    #[serde(default)]
    pub(crate) probes: Option<ProbesArgs>,
    /// A converted model's run directory (e.g. `make pretrained`'s): train stages without
    /// `init_from` continue from its weights, and eval stages without `of` evaluate it. The
    /// grid's `[base.model]` must describe its architecture (copy its config.toml's [model]).
    #[serde(default)]
    pub(crate) pretrained: Option<std::path::PathBuf>,
    #[serde(default)]
    pub(crate) base: toml::Table,
    /// Replicates: every train cell runs with this many seeds (`train.seed` = the base's
    /// seed, then the next ones), and the cells that start from, evaluate or prune it follow
    /// their own seed's. `attnsweep plot` gives each setting's mean, spread and 95 % interval
    /// over them (`replicates.csv`, `replicate_differences.csv`, `stage_differences.csv`).
    #[serde(default = "one")]
    pub(crate) seeds: usize,
    #[serde(rename = "stage")]
    pub(crate) stages: Vec<Stage>,
}

#[derive(Deserialize, Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum StageKind {
    Train,
    Eval,
    Prune,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub(crate) struct Stage {
    pub(crate) name: String,
    #[serde(default = "default_kind")]
    pub(crate) kind: StageKind,
    /// train: continue from the matching cell of this stage.
    #[serde(default)]
    pub(crate) init_from: Option<String>,
    /// eval and prune: the stage whose cells they work on.
    #[serde(default)]
    pub(crate) of: Option<String>,
    #[serde(default)]
    pub(crate) set: toml::Table,
    #[serde(default)]
    pub(crate) axes: toml::Table,
    #[serde(default)]
    pub(crate) zip: toml::Table,
    #[serde(default)]
    pub(crate) include: Vec<toml::Table>,
    #[serde(default)]
    pub(crate) exclude: Vec<toml::Table>,
    /// prune: the sparsity thresholds.
    #[serde(default)]
    pub(crate) thresholds: Vec<f64>,
    /// train: a stage whose matching cell this one reads files of (`{reads}` in string
    /// settings names its directory) without starting from its weights; e.g. static top-k
    /// heads ranked by an AHA cell but trained from the same base for the same budget.
    #[serde(default)]
    pub(crate) reads: Option<String>,
    /// train, with `reads` and Bernoulli gates: draw them at the usage the read cell's
    /// evaluation measured gate by gate (each head's for AHA, each layer's for L2A and
    /// SwiAttn: `attention.bernoulli_rates`), so random gates open where and as often as its
    /// learned ones and differ only in which tokens open them.
    #[serde(default)]
    pub(crate) match_usage: bool,
    /// train: replicate over the first N of the grid's `seeds` only (a control that no
    /// verdict's difference rests on); eval and prune: act on the cells of those seeds only
    /// (a timing needs one model of each setting); the grid's count when absent.
    #[serde(default)]
    pub(crate) seeds: Option<usize>,
    /// Run the stage's cells one at a time, with no other cell of the runner beside them,
    /// whatever `--jobs` says: what they time is then the GPU's alone (each cell's own
    /// `cell.json` records that it ran so).
    #[serde(default)]
    pub(crate) exclusive: bool,
    /// train: the train stage whose budget ladder this one's cells are lower rungs of (its
    /// method and settings at fewer tokens, e.g. `zip` over `train.steps`): the budget table
    /// and figure draw them on that stage's line. What a cell computes is unchanged by it.
    #[serde(default)]
    pub(crate) ladder: Option<String>,
}

fn one() -> usize {
    1
}

fn default_kind() -> StageKind {
    StageKind::Train
}

/// One expanded cell.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Cell {
    /// Position in the expanded grid (what `--cell` and Slurm array tasks name).
    pub(crate) index: usize,
    pub(crate) id: String,
    pub(crate) stage: String,
    pub(crate) kind: StageKind,
    /// The settings that distinguish this cell within its stage (`key=value ...`).
    pub(crate) label: String,
    /// The varied settings behind the label (for eval and prune cells, those of the cell
    /// they act on too).
    pub(crate) assignment: BTreeMap<String, toml::Value>,
    /// Every override applied on top of the base, by dotted key.
    pub(crate) settings: BTreeMap<String, toml::Value>,
    /// Cell this one starts from (train) or works on (eval, prune).
    pub(crate) depends_on: Option<String>,
    /// The stage that cell was expanded in: a cell several stages share (one id) is a member
    /// of each, and this says which membership the dependent builds on (absent in sweeps
    /// written before it was recorded, where the cell's first stage stands).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) depends_on_stage: Option<String>,
    /// Cell whose files this one reads (a stage's `reads`).
    #[serde(default)]
    pub(crate) reads: Option<String>,
    /// The stage that names the read cell (a stage's `reads`): of a cell several stages share,
    /// the membership read (absent in sweeps written before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) reads_stage: Option<String>,
    /// Its Bernoulli gates open at the read cell's measured usage (a stage's `match_usage`).
    #[serde(default)]
    pub(crate) match_usage: bool,
    /// It ran with no other cell beside it (a stage's `exclusive`): its timings are the GPU's
    /// alone.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) exclusive: bool,
    /// The stage whose budget ladder it is a lower rung of (a stage's `ladder`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) ladder: Option<String>,
    /// The grid's pretrained model, for a cell that starts from it (train) or evaluates it
    /// (eval) rather than a cell of the grid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) pretrained: Option<std::path::PathBuf>,
    pub(crate) threshold: Option<f64>,
    /// The fully resolved config (for eval cells: the evaluated model's, with overrides).
    pub(crate) config: Config,
}

impl Cell {
    /// The settings its label names: the assignment's, in its order, and a prune cell's
    /// threshold last.
    pub(crate) fn varied(&self) -> Vec<(String, String)> {
        let mut varied: Vec<(String, String)> = self
            .assignment
            .iter()
            .map(|(k, v)| (k.clone(), value_str(v)))
            .collect();
        if let Some(t) = self.threshold {
            varied.push(("threshold".into(), t.to_string()));
        }
        varied
    }

    /// The tokens a train cell trains on: its steps of `batch_size x grad_accum` sequences.
    pub(crate) fn train_tokens(&self) -> usize {
        let t = &self.config.train;
        t.steps * t.batch_size * t.grad_accum * self.config.data.seq_len
    }
}

impl Grid {
    /// Keeps only the first `n` of the grid's seeds (a stage's own count too, where larger):
    /// the cells of those seeds are the grid's own cells, by id, so a run of the first seed
    /// of everything can come before the rest (`sweep --seeds`).
    pub fn keep_first_seeds(&mut self, n: usize) -> Result<()> {
        ensure!(
            (1..=self.seeds).contains(&n),
            "--seeds {n}: the grid {} replicates over {} seed(s); give 1 ..= {}",
            self.name,
            self.seeds,
            self.seeds
        );
        self.seeds = n;
        for stage in &mut self.stages {
            stage.seeds = stage.seeds.map(|k| k.min(n));
        }
        Ok(())
    }
}

pub fn read_grid(path: &Path) -> Result<Grid> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read grid {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("invalid grid {}", path.display()))
}

/// A setting's value as a cell's label writes it: as TOML writes it, but a float whose
/// decimal runs long in exponent form (1e-300, not 300 digits).
pub(super) fn value_str(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Float(f) if v.to_string().len() > 16 => compact(*f),
        other => other.to_string(),
    }
}

/// The key replicates vary.
pub(crate) const SEED_KEY: &str = "train.seed";

/// The assignments of one stage: the cartesian product of its axes (zipped keys advancing
/// together as one axis), minus exclusions, plus inclusions; each once per seed of `seeds`.
fn assignments(stage: &Stage, seeds: &[i64]) -> Result<Vec<BTreeMap<String, toml::Value>>> {
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
    if !seeds.is_empty() {
        let varied = stage.set.contains_key(SEED_KEY)
            || stage.axes.contains_key(SEED_KEY)
            || stage.zip.contains_key(SEED_KEY)
            || stage.include.iter().any(|i| i.contains_key(SEED_KEY));
        ensure!(
            !varied,
            "stage {}: the grid's `seeds` replicates every train cell over {SEED_KEY}; do not also set it in the stage",
            stage.name
        );
        product = product
            .into_iter()
            .flat_map(|a| {
                seeds.iter().map(move |&s| {
                    let mut a = a.clone();
                    a.insert(SEED_KEY.into(), toml::Value::Integer(s));
                    a
                })
            })
            .collect();
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
    check_grid(grid)?;
    let mut cells: Vec<Cell> = Vec::new();
    // Each id's hash with the whole fingerprint behind it: a shared id must mean the same
    // computation, not a collision of the 32-bit hashes.
    let mut fingerprints: BTreeMap<String, String> = BTreeMap::new();
    let seeds: Vec<i64> = if grid.seeds > 1 {
        let first = resolve(&grid.base, &BTreeMap::new(), "base")?.train.seed as i64;
        (0..grid.seeds as i64).map(|i| first + i).collect()
    } else {
        vec![]
    };
    for (si, stage) in grid.stages.iter().enumerate() {
        let what = format!("stage {:?}", stage.name);
        ensure!(
            grid.stages[..si].iter().all(|s| s.name != stage.name),
            "{what} is defined twice"
        );
        let (source, reads) = stage_sources(grid, si, &what)?;
        if stage.kind == StageKind::Prune {
            let of = source.as_deref().expect("prune stages have `of`");
            check_prune(stage, of, &cells, &what)?;
        }
        let seeds = match stage.seeds {
            None => &seeds[..],
            Some(n) => {
                ensure!(
                    stage.kind == StageKind::Train || source.is_some(),
                    "{what}: seeds = {n} on an eval stage picks the seeds of the cells it \
                     evaluates; without `of` it evaluates the pretrained model, which has none"
                );
                ensure!(
                    (1..=grid.seeds).contains(&n),
                    "{what}: seeds = {n} must be within the grid's seeds = {} (a train stage's \
                     cells replicate over the first {n} of them, an eval or prune stage's act on \
                     those seeds' cells)",
                    grid.seeds
                );
                &seeds[..n.min(seeds.len())]
            }
        };
        let first = cells.len();
        for plan in plans(stage, seeds, source.as_deref(), &cells, &what)? {
            let cell = new_cell(
                grid,
                stage,
                plan,
                reads.as_deref(),
                &cells,
                &mut fingerprints,
                &what,
            )?;
            cells.push(cell);
        }
        ensure!(
            cells.len() > first,
            "{what} expands to no cells (every assignment is excluded, or the stage it works on has none); give it axes, include or set"
        );
    }
    Ok(cells)
}

/// The grid's own sections: its name, and its data set described once.
fn check_grid(grid: &Grid) -> Result<()> {
    ensure!(
        !grid.stages.is_empty(),
        "grid {} has no [[stage]]",
        grid.name
    );
    ensure!(
        (1..=100).contains(&grid.seeds),
        "grid {}: seeds = {} (replicates per train cell) must be in 1 ..= 100",
        grid.name,
        grid.seeds
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
    config::reject_non_finite(&grid.base, "base.")?;
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
    Ok(())
}

/// The stages stage `si` starts from or acts on (`init_from`, `of`) and reads, by name, each an
/// earlier stage of a kind it can use.
fn stage_sources(grid: &Grid, si: usize, what: &str) -> Result<(Option<String>, Option<String>)> {
    let stage = &grid.stages[si];
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
            if let Some(l) = &stage.ladder {
                let main = grid.stages.iter().find(|s| &s.name == l);
                ensure!(
                    l != &stage.name && main.is_some_and(|s| s.kind == StageKind::Train),
                    "{what}: ladder = {l:?} names no other train stage of the grid; name the \
                     train stage whose line these cells are lower budgets of"
                );
                ensure!(
                    main.is_some_and(|s| s.ladder.is_none()),
                    "{what}: ladder = {l:?} names a stage that is itself a rung of another; \
                     name the stage whose line both are on"
                );
            }
            (from, earlier(&stage.reads, "reads")?)
        }
        StageKind::Eval | StageKind::Prune => {
            ensure!(
                stage.init_from.is_none() && stage.reads.is_none() && stage.ladder.is_none(),
                "{what}: init_from, reads and ladder are for train stages"
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
                // Without `of`, an eval stage evaluates the grid's pretrained model.
                ensure!(
                    stage.kind == StageKind::Eval && grid.pretrained.is_some(),
                    "{what}: a {:?} stage needs `of` (an eval stage may leave it out only when \
                     the grid names a `pretrained` model, which it then evaluates)",
                    stage.kind
                );
                return Ok((None, None));
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
    Ok((
        source.map(|s| s.name.clone()),
        reads.map(|s| s.name.clone()),
    ))
}

/// A prune stage takes thresholds, and acts on L2A cells only.
fn check_prune(stage: &Stage, of: &str, cells: &[Cell], what: &str) -> Result<()> {
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
    if let Some(c) = cells
        .iter()
        .find(|c| c.stage == of && !spec(c.config.attention.method).prunable)
    {
        bail!(
            "{what}: pruning removes L2A's global modules, but cell {} ({}) of stage {of:?} trains method {:?}",
            c.id,
            c.label,
            c.config.attention.method
        );
    }
    Ok(())
}

/// One cell a stage plans: its own varied settings, the cell it starts from or acts on, and
/// (prune cells) its threshold.
struct Plan {
    assignment: BTreeMap<String, toml::Value>,
    dep: Option<Cell>,
    threshold: Option<f64>,
}

impl Plan {
    fn new(
        assignment: BTreeMap<String, toml::Value>,
        dep: Option<Cell>,
        threshold: Option<f64>,
    ) -> Plan {
        Plan {
            assignment,
            dep,
            threshold,
        }
    }
}

/// The cells a stage plans: its assignments, each from the matching cell of the stage it
/// continues (train), or on every cell of the stage it acts on (eval, prune).
fn plans(
    stage: &Stage,
    seeds: &[i64],
    source: Option<&str>,
    cells: &[Cell],
    what: &str,
) -> Result<Vec<Plan>> {
    let stage_assignments = match stage.kind {
        StageKind::Prune => vec![BTreeMap::new()],
        // Eval cells take their seed from the cell they evaluate.
        StageKind::Eval => assignments(stage, &[])?,
        StageKind::Train => assignments(stage, seeds)?,
    };
    let mut plans: Vec<Plan> = Vec::new();
    match (source, stage.kind) {
        (None, _) => plans.extend(
            stage_assignments
                .into_iter()
                .map(|a| Plan::new(a, None, None)),
        ),
        // A train cell continues from the one cell of the source stage that agrees with
        // it on every varied key both stages have.
        (Some(src), StageKind::Train) => {
            for a in stage_assignments {
                let dep = matching_cell(cells, src, &a, what)?.clone();
                plans.push(Plan::new(a, Some(dep), None));
            }
        }
        // Eval and prune cells act on every cell of their source stage.
        (Some(src), _) => {
            let mut seen = std::collections::BTreeSet::new();
            // `seeds` is the grid's (all of them) or the stage's first few; none when the
            // grid does not replicate.
            let deps: Vec<&Cell> = cells
                .iter()
                .filter(|c| c.stage == src && seen.insert(c.id.clone()))
                .filter(|c| seeds.is_empty() || seeds.contains(&(c.config.train.seed as i64)))
                .collect();
            for d in deps {
                if stage.kind == StageKind::Prune {
                    plans.extend(
                        stage
                            .thresholds
                            .iter()
                            .map(|&t| Plan::new(BTreeMap::new(), Some(d.clone()), Some(t))),
                    );
                } else {
                    plans.extend(
                        stage_assignments
                            .iter()
                            .map(|a| Plan::new(a.clone(), Some(d.clone()), None)),
                    );
                }
            }
        }
    }
    Ok(plans)
}

/// The cell a plan makes: its resolved config, the cell it reads, its id (the hash of what it
/// computes, shared with an earlier cell that computes the same) and its label.
fn new_cell(
    grid: &Grid,
    stage: &Stage,
    plan: Plan,
    reads: Option<&str>,
    cells: &[Cell],
    fingerprints: &mut BTreeMap<String, String>,
    what: &str,
) -> Result<Cell> {
    let Plan {
        assignment,
        dep,
        threshold,
    } = plan;
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
            (resolve(&grid.base, &s, what)?, s)
        }
        (Some(d), StageKind::Prune) => (d.config.clone(), d.settings.clone()),
        _ => (resolve(&grid.base, &settings, what)?, settings),
    };
    let read = match &reads {
        Some(r) => Some(matching_cell(&cells, r, &assignment, &what)?.id.clone()),
        None => None,
    };
    if stage.match_usage {
        let a = &config.attention;
        ensure!(
            read.is_some() && spec(a.method).gates != Gates::None && a.router == Router::Bernoulli,
            "{what}: match_usage draws Bernoulli gates at the usage of the cell it \
                 reads: it needs reads = \"<stage>\" and a routed method with \
                 attention.router = \"bernoulli\""
        );
    }
    // A cell of no other cell's starts from (train) or evaluates (eval) the pretrained model.
    let pretrained = match dep {
        None => grid.pretrained.clone(),
        Some(_) => None,
    };
    let fingerprint = format!(
        "{:?}\n{}\n{}{}\n{:?}{}{}",
        stage.kind,
        config.canonical().non_default_toml(),
        dep.as_ref().map_or("", |d| d.id.as_str()),
        pretrained
            .as_ref()
            .map_or(String::new(), |p| format!("pretrained {}", p.display())),
        threshold.map(|t| t.to_bits()),
        read.as_ref()
            .map_or(String::new(), |r| format!("\nreads {r}")),
        // Matched gate by gate (each head's or layer's usage), not at one global rate as before:
        // a computation of its own, with an id of its own. A per-token method's rates are its
        // layers' since they were read as such (before, its per-head report fell back to one
        // global rate): an id of its own again.
        match (stage.match_usage, spec(config.attention.method).gates) {
            (false, _) => "",
            (true, Gates::PerToken) => "\nmatch_usage per gate, a layer",
            (true, _) => "\nmatch_usage per gate",
        }
    );
    let hash = format!("-{:08x}", crate::util::fnv1a(fingerprint.as_bytes()) >> 32);
    match fingerprints.get(&hash) {
        Some(f) if *f != fingerprint => {
            bail!("{what}: two different cells share the hash {hash}; change any setting of one")
        }
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
    Ok(Cell {
        index: cells.len(),
        id,
        stage: stage.name.clone(),
        kind: stage.kind,
        label: lab,
        assignment: shown,
        settings,
        depends_on_stage: dep.as_ref().map(|d| d.stage.clone()),
        depends_on: dep.map(|d| d.id),
        reads: read,
        reads_stage: reads.map(String::from),
        match_usage: stage.match_usage,
        exclusive: stage.exclusive,
        ladder: stage.ladder.clone(),
        pretrained,
        threshold,
        config,
    })
}

pub(super) fn label(a: &BTreeMap<String, toml::Value>) -> String {
    a.iter()
        .map(|(k, v)| format!("{k}={}", value_str(v)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Whether a setting's value names a directory a train cell resolves when it starts.
pub(super) fn has_placeholder(v: &toml::Value) -> bool {
    let text = v.to_string();
    text.contains("{source}") || text.contains("{reads}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid(text: &str) -> Grid {
        toml::from_str(text).unwrap()
    }

    /// A label writes values as TOML does, but a long float in exponent form.
    #[test]
    fn labels_write_long_floats_compactly() {
        let mut a = BTreeMap::new();
        a.insert("attention.lambda".to_string(), toml::Value::Float(1e-300));
        a.insert("attention.tau".to_string(), toml::Value::Float(0.5));
        a.insert("train.lr".to_string(), toml::Value::Float(0.00001));
        assert_eq!(
            label(&a),
            "attention.lambda=1e-300 attention.tau=0.5 train.lr=0.00001"
        );
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

    /// `seeds = 3`: every train cell three times, over the base's seed and the next two; a
    /// continued cell starts from the base cell of its own seed, an eval cell evaluates each;
    /// a stage that sets the seed itself is refused.
    #[test]
    fn seeds_replicate_every_train_cell_along_its_chain() {
        let text = |extra: &str| {
            format!(
                "seeds = 3\n{BASE}seed = 5\n[[stage]]\nname = \"base\"\n[[stage]]\nname = \"aha\"\ninit_from = \"base\"\nset = {{ \"attention.method\" = \"aha\" }}\naxes = {{ \"attention.window\" = [4, 8] }}{extra}\n[[stage]]\nname = \"ev\"\nkind = \"eval\"\nof = \"aha\"\n"
            )
        };
        let cells = expand(&grid(&text(""))).unwrap();
        let of = |stage: &str| {
            cells
                .iter()
                .filter(|c| c.stage == stage)
                .collect::<Vec<_>>()
        };
        let seeds = |cs: &[&Cell]| cs.iter().map(|c| c.config.train.seed).collect::<Vec<_>>();
        assert_eq!(seeds(&of("base")), [5, 6, 7]);
        assert_eq!(of("aha").len(), 6);
        assert_eq!(of("ev").len(), 6);
        for c in of("aha").iter().chain(&of("ev")) {
            let dep = cells
                .iter()
                .find(|d| Some(&d.id) == c.depends_on.as_ref())
                .unwrap();
            assert_eq!(dep.config.train.seed, c.config.train.seed, "{}", c.label);
        }
        assert!(of("aha")[0].label.contains("train.seed=5"));
        let e = format!(
            "{:#}",
            expand(&grid(&text("\nzip = { \"train.seed\" = [1] }"))).unwrap_err()
        );
        assert!(e.contains("do not also set it"), "{e}");
        // A control stage replicates over the first of the seeds only, and what continues
        // from it finds its seed's cell.
        let cells = expand(&grid(&text("\nseeds = 1"))).unwrap();
        let aha: Vec<_> = cells.iter().filter(|c| c.stage == "aha").collect();
        assert_eq!(aha.len(), 2);
        assert!(aha
            .iter()
            .all(|c| c.config.train.seed == 5 && c.label.contains("train.seed=5")));
        assert_eq!(cells.iter().filter(|c| c.stage == "ev").count(), 2);
        // The first seed alone plans the same cells as the whole grid's first seed.
        let whole = expand(&grid(&text(""))).unwrap();
        let mut first = grid(&text("\nseeds = 2"));
        first.keep_first_seeds(1).unwrap();
        let first = expand(&first).unwrap();
        assert_eq!(
            first.len(),
            5,
            "the base, two windows and their evaluations"
        );
        for c in &first {
            let same = whole
                .iter()
                .find(|w| w.id == c.id)
                .expect("a cell of the whole grid");
            assert_eq!(same.config.train.seed, 5, "{}", c.label);
        }
        let e = format!("{:#}", grid(&text("")).keep_first_seeds(4).unwrap_err());
        assert!(e.contains("--seeds 4") && e.contains("1 ..= 3"), "{e}");
        for bad in ["\nseeds = 4", "\nseeds = 0"] {
            let e = format!("{:#}", expand(&grid(&text(bad))).unwrap_err());
            assert!(e.contains("within the grid's seeds = 3"), "{e}");
        }
    }

    /// An eval stage's `seeds = 1` evaluates the first seed's cells only, the same cells the
    /// stage without it plans for that seed; `exclusive` reaches its cells and no others.
    #[test]
    fn an_eval_stage_can_take_the_first_seed_alone() {
        let text = |extra: &str| {
            grid(&format!(
                "seeds = 3\n{BASE}seed = 5\n[[stage]]\nname = \"swa\"\nset = {{ \"attention.method\" = \"swa\" }}\naxes = {{ \"attention.window\" = [4, 8] }}\n[[stage]]\nname = \"timed\"\nkind = \"eval\"\nof = \"swa\"\nexclusive = true{extra}\n"
            ))
        };
        let all = expand(&text("")).unwrap();
        let first = expand(&text("\nseeds = 1")).unwrap();
        let timed = |cells: &[Cell]| -> Vec<Cell> {
            cells
                .iter()
                .filter(|c| c.stage == "timed")
                .cloned()
                .collect()
        };
        assert_eq!(timed(&all).len(), 6);
        let one = timed(&first);
        assert_eq!(one.len(), 2, "one per window");
        for c in &one {
            assert_eq!(c.config.train.seed, 5, "{}", c.label);
            assert!(c.exclusive);
            assert!(
                timed(&all).iter().any(|a| a.id == c.id),
                "the same cell as the whole stage's"
            );
        }
        assert!(first
            .iter()
            .filter(|c| c.stage == "swa")
            .all(|c| !c.exclusive));
        let e = format!("{:#}", expand(&text("\nseeds = 4")).unwrap_err());
        assert!(e.contains("within the grid's seeds = 3"), "{e}");
        // Without `of` an eval stage evaluates the pretrained model: no seeds to pick.
        let g = grid(&format!(
            "seeds = 3\npretrained = \"p\"\n{BASE}[[stage]]\nname = \"ev\"\nkind = \"eval\"\nseeds = 1\n"
        ));
        let e = format!("{:#}", expand(&g).unwrap_err());
        assert!(e.contains("without `of`"), "{e}");
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
        // A ladder's rungs name another train stage; evaluations have none.
        for (stage, needle) in [
            ("name = \"r\"\nladder = \"r\"", "names no other train stage"),
            (
                "name = \"m\"\nladder = \"b\"\n[[stage]]\nname = \"r\"\nladder = \"m\"",
                "itself a rung",
            ),
            (
                "name = \"r\"\nladder = \"nope\"",
                "names no other train stage",
            ),
            (
                "name = \"r\"\nkind = \"eval\"\nof = \"b\"\nladder = \"b\"",
                "ladder are for train",
            ),
        ] {
            let e = err(&format!("{base}[[stage]]\n{stage}\n"));
            assert!(e.contains("stage \"r\"") && e.contains(needle), "{e}");
        }
        // A rung joins its line without changing what it computes: its id is the same.
        let ids = |ladder: &str| {
            expand(&grid(&format!(
                "{BASE}{base}[[stage]]\nname = \"r\"\n{ladder}set = {{ \"train.steps\" = 2 }}\n"
            )))
            .unwrap()
            .into_iter()
            .map(|c| (c.id, c.ladder))
            .collect::<Vec<_>>()
        };
        let (plain, rung) = (ids(""), ids("ladder = \"b\"\n"));
        assert_eq!(plain.last().unwrap().0, rung.last().unwrap().0);
        assert_eq!(rung.last().unwrap().1.as_deref(), Some("b"));
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
