//! What the tables and figures know of one finished cell of a sweep directory (`Row`): its
//! settings, as the grid varied them and as its method reports them, its evaluation, pruning,
//! task results, logs and probe files, and its training throughput, each file read once.

use super::cell_files::{self, Log, Niah};
use super::grid::{Cell, StageKind, SEED_KEY};
use super::status::{State, Status};
use crate::config::{AttentionConfig, Method, Router};
use crate::model::attention::{spec, CellKind, Provenance, TableCell};
use crate::run::prune::PruneReport;
use crate::run::report::{self, Bucket, EvalReport, GateReport};
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// What the tables know of one finished cell.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) cell: String,
    pub(crate) stage: String,
    pub(crate) kind: StageKind,
    pub(crate) label: String,
    /// The settings its label names, in its order (the grid's varied keys, a prune cell's
    /// threshold), with the seed its replicates differ in.
    pub(crate) varied: Vec<(String, String)>,
    pub(crate) method: Method,
    /// The cell this one continued from or evaluates ("" when none), and its method.
    pub(crate) source: String,
    pub(crate) source_method: Option<Method>,
    pub(crate) window: f64,
    pub(crate) router: Router,
    pub(crate) bernoulli_p: f64,
    /// Its configuration's name in its paper's ablation table (`MethodSpec::variant`).
    pub(crate) variant: String,
    /// Its row's name in AHA Table 5 (`MethodSpec::head_budget`).
    pub(crate) head_budget: String,
    /// The model's (layer, head) pairs.
    pub(crate) heads: usize,
    /// Training tokens behind the model (its own steps and those of every cell it continued
    /// from), and what identifies its model and data: the basis of retain %'s reference.
    pub(crate) budget_tokens: f64,
    /// Tokens behind the model before the cell's own training began, and per step of it.
    pub(crate) start_tokens: f64,
    pub(crate) tokens_per_step: f64,
    pub(crate) model_key: String,
    /// The cell's evaluation (`eval.json`), and its pruning (`prune.json`) for prune cells.
    pub(crate) report: EvalReport,
    pub(crate) prune: Option<PruneReport>,
    /// `<task>.<metric>` from the evaluation suite's results.json (probes, multiple choice).
    pub(crate) tasks: BTreeMap<String, f64>,
    /// Its training log and validation log (train cells).
    pub(crate) train_log: Option<Log>,
    pub(crate) val_log: Option<Log>,
    /// Its probes' layer x head usage per task (routed models), and its NIAH grid.
    pub(crate) probe_usage: BTreeMap<String, Vec<Vec<f64>>>,
    pub(crate) niah: Option<Niah>,
    /// Training throughput of a train cell: the median of its `train_log.csv` rates.
    pub(crate) tokens_per_s: Option<f64>,
    /// The throughput of the training that made the evaluated model: the cell's own, or for
    /// an eval or prune cell that of the train cell it derives from.
    pub(crate) train_tokens_per_s: Option<f64>,
    /// The attention as the grid set it, and as the cell was evaluated with it (a train
    /// cell's Bernoulli gates may open at another cell's measured usage: `match_usage`).
    pub(crate) grid_attention: AttentionConfig,
    pub(crate) attention: AttentionConfig,
    /// It ran with no other cell beside it on its device (its stage's `exclusive`, its own
    /// GPU, or the only cell running, as its own `cell.json` recorded when it ran): its
    /// timing is clean.
    pub(crate) exclusive: bool,
    /// The training that made its model ran alone so (its own, or for an eval or prune cell
    /// the train cell's): `train_tokens_per_s` is its own rate, fit for a front.
    pub(crate) train_alone: bool,
    /// What of its files could not be read (its row lacks what they hold); empty when all
    /// could.
    pub(crate) note: Vec<String>,
    /// Per probe score (`<task>.exact_match`, `<task>.recall`), each prompt's value in the
    /// order the evaluation wrote them (`eval/probe_samples.jsonl.gz`).
    pub(crate) prompt_scores: BTreeMap<String, Vec<f64>>,
    /// Its probes per (task, prompt length): each prompt's exact match, and beside it what
    /// each prompt was (`PromptScores::ids_by_length`).
    pub(crate) probe_by_length: BTreeMap<(String, u64), Vec<f64>>,
    pub(crate) probe_ids: BTreeMap<(String, u64), Vec<Option<String>>>,
    /// The set-up it measures, as a budget ladder draws it (`line_of`): its train stage's
    /// name (a lower rung's, the stage it names in `ladder`) with that stage's varied settings
    /// but the seed; an evaluation's or pruning's, that of the train cell it acts on with the
    /// settings it changes; `pretrained ...` for the grid's pretrained model.
    pub(crate) line: String,
    /// A lower rung of a budget ladder (its stage names another in `ladder`): its line is
    /// drawn as a ladder's even while it has one budget.
    pub(crate) rung: bool,
    /// The other stages that list the cell: one that computes what an earlier stage's cell
    /// computes shares its id and runs once, yet is a replicate of each stage (a regime's
    /// first seed that is also a sweep's point). Replicate tables and budget ladders count
    /// it in every one.
    pub(crate) also: Vec<Membership>,
    /// The lines of the cell it reads (a stage's `reads`: the model whose usage or heads a
    /// control copies), one per stage that lists that cell; empty where it reads none.
    pub(crate) reads: Vec<String>,
}

/// A cell's place in a stage other than the first that lists it.
#[derive(Debug, Clone)]
pub(crate) struct Membership {
    pub(crate) stage: String,
    /// The settings its label names in that stage (`Row::varied`'s counterpart).
    pub(crate) varied: Vec<(String, String)>,
    /// Its line there (`Row::line`).
    pub(crate) line: String,
    /// A lower rung of a ladder there (`Row::rung`): another stage's rung flag is not its own.
    pub(crate) rung: bool,
}

/// A cell the sweep lists that has no row: not finished, or its files unreadable.
#[derive(Debug, Clone)]
pub(crate) struct Unread {
    pub(crate) cell: String,
    pub(crate) stage: String,
    pub(crate) kind: StageKind,
    pub(crate) label: String,
    pub(crate) why: String,
}

/// A sweep directory as the tables read it: a row per finished cell, and the cells without.
pub(crate) struct SweepRows {
    pub(crate) rows: Vec<Row>,
    pub(crate) unread: Vec<Unread>,
}

impl Row {
    pub(crate) fn loss(&self) -> f64 {
        self.report.loss
    }

    pub(crate) fn pairs_vs_full(&self) -> f64 {
        self.report.attention.pairs_vs_full
    }

    /// Full-attention usage of a routed model (pruned L2A layers counted as window).
    pub(crate) fn mu_f(&self) -> Option<f64> {
        self.report.gates.as_ref().map(|g| g.mu_f)
    }

    pub(crate) fn gates(&self) -> Option<&GateReport> {
        self.report.gates.as_ref()
    }

    /// Whether its method is the reference (full attention).
    pub(crate) fn is_reference(&self) -> bool {
        spec(self.method).reference
    }

    /// Its replicate's seed as the grid varied it ("" where the grid has no seeds).
    pub(crate) fn seed(&self) -> &str {
        seed_of(&self.varied)
    }

    /// The settings its replicates share: the varied ones but the seed.
    pub(crate) fn setting(&self) -> impl Iterator<Item = (&str, &str)> {
        setting_of(&self.varied)
    }

    /// `setting` as its label writes it (`attention.window=16 attention.lambda=0.1`).
    pub(crate) fn setting_text(&self) -> String {
        setting_text_of(&self.varied)
    }

    /// How the cell came to be, in the method registry's terms.
    pub(crate) fn provenance(&self) -> Provenance {
        Provenance {
            kind: match self.kind {
                StageKind::Train => CellKind::Trained,
                StageKind::Eval => CellKind::Evaluated,
                StageKind::Prune => CellKind::Pruned,
            },
            from_reference: self.source_method.is_some_and(|m| spec(m).reference),
        }
    }

    /// What a paper table knows of the cell when it picks its rows.
    pub(crate) fn table_cell(&self) -> TableCell<'_> {
        let provenance = self.provenance();
        TableCell {
            method: self.method,
            kind: provenance.kind,
            router: self.router,
            reference: self.is_reference(),
            baseline: spec(self.method).baseline.map(|name| name(&provenance)),
            head_budget: &self.head_budget,
        }
    }

    /// Loss and exact-match accuracy of the predictions whose dependency lies at least the
    /// cell's window back (full attention's window setting, 64 by default, where it has
    /// none), pooled over those distance buckets: the long-range task of the synthetic
    /// corpus. None without buckets, or with none that far.
    pub(crate) fn far(&self) -> Option<(f64, Option<f64>)> {
        self.beyond(self.window)
    }

    /// `far` for the predictions whose dependency lies at least `distance` back (a bucket
    /// counts when its shortest distance does).
    pub(crate) fn beyond(&self, distance: f64) -> Option<(f64, Option<f64>)> {
        let far: Vec<&Bucket> = self
            .report
            .buckets
            .iter()
            .filter(|b| b.min_distance as f64 >= distance && b.min_distance < u32::MAX)
            .collect();
        let n: u64 = far.iter().map(|b| b.tokens).sum();
        (n > 0).then(|| {
            let mean = |f: &dyn Fn(&Bucket) -> f64| {
                far.iter().map(|b| f(b) * b.tokens as f64).sum::<f64>() / n as f64
            };
            let acc = far
                .iter()
                .all(|b| b.accuracy.is_some())
                .then(|| mean(&|b| b.accuracy.unwrap_or(0.0)));
            (mean(&|b| b.loss), acc)
        })
    }
}

/// Tokens of one training step of a train cell (0 for the other kinds).
fn tokens_per_step(c: &Cell) -> f64 {
    let t = &c.config.train;
    match c.kind {
        StageKind::Train => (t.batch_size * t.grad_accum * c.config.data.seq_len) as f64,
        _ => 0.0,
    }
}

/// Training tokens behind each cell's model: its own (train cells) plus those of the cells
/// it continued from, evaluated or pruned.
fn budgets(cells: &[Cell]) -> BTreeMap<String, f64> {
    let mut out: BTreeMap<String, f64> = BTreeMap::new();
    // Cells come in stage order, so a dependency's budget is known before its dependents'.
    for c in cells {
        let own = c.config.train.steps as f64 * tokens_per_step(c);
        let before = c
            .depends_on
            .as_ref()
            .and_then(|d| out.get(d))
            .copied()
            .unwrap_or(0.0);
        out.entry(c.id.clone()).or_insert(own + before);
    }
    out
}

/// Whether a cell had its device to itself when it ran (an `exclusive` stage's, or one on its
/// own GPU or run alone), as the `cell.json` written into its folder then says: the sweep's
/// own cells.json follows the grid, which may have changed since.
fn ran_alone(dir: &Path) -> bool {
    let v = std::fs::read_to_string(dir.join("cell.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    let flag = |k: &str| v.as_ref().and_then(|v| v[k].as_bool()).unwrap_or(false);
    flag("exclusive") || flag("alone")
}

/// The replicate's seed among a cell's varied settings ("" where the grid has no seeds).
pub(crate) fn seed_of(varied: &[(String, String)]) -> &str {
    varied
        .iter()
        .find(|(k, _)| k == SEED_KEY)
        .map_or("", |(_, v)| v.as_str())
}

/// The varied settings a cell's replicates share: all but the seed.
fn setting_of(varied: &[(String, String)]) -> impl Iterator<Item = (&str, &str)> {
    varied
        .iter()
        .filter(|(k, _)| k != SEED_KEY)
        .map(|(k, v)| (k.as_str(), v.as_str()))
}

/// The shared setting as a label writes it (`attention.window=16 attention.lambda=0.1`).
pub(crate) fn setting_text_of(varied: &[(String, String)]) -> String {
    setting_of(varied)
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The cells a sweep directory's `cells.json` lists.
pub(crate) fn read_cells(sweep: &Path) -> Result<Vec<Cell>> {
    let cells_path = sweep.join("cells.json");
    let text = std::fs::read_to_string(&cells_path).with_context(|| {
        format!(
            "{} is not a sweep directory (no cells.json)",
            sweep.display()
        )
    })?;
    serde_json::from_str(&text).with_context(|| format!("{} is malformed", cells_path.display()))
}

/// The finished cells of a sweep directory, each once (cells that several stages share
/// appear under the first, the others named in `also`), and every other cell it lists with
/// the reason it has no row.
pub(crate) fn rows(sweep: &Path) -> Result<SweepRows> {
    let cells = read_cells(sweep)?;
    let budget = budgets(&cells);
    let (mut out, mut unread): (Vec<Row>, Vec<Unread>) = (Vec::new(), Vec::new());
    for c in &cells {
        if let Some(r) = out.iter_mut().find(|r| r.cell == c.id) {
            if r.stage != c.stage && r.also.iter().all(|m| m.stage != c.stage) {
                r.also.push(Membership {
                    stage: c.stage.clone(),
                    varied: c.varied(),
                    line: line_of(c, &cells),
                    rung: c.ladder.is_some(),
                });
            }
            continue;
        }
        if unread.iter().any(|u| u.cell == c.id) {
            continue;
        }
        match row_of(c, &cells, &sweep.join(&c.id), &budget) {
            Ok(row) => out.push(row),
            Err(why) => unread.push(Unread {
                cell: c.id.clone(),
                stage: c.stage.clone(),
                kind: c.kind,
                label: c.label.clone(),
                why,
            }),
        }
    }
    // Rows come in stage order, so the cell an eval or prune cell derives from is resolved
    // before it.
    for i in 0..out.len() {
        (out[i].train_tokens_per_s, out[i].train_alone) = match out[i].kind {
            StageKind::Train => (out[i].tokens_per_s, out[i].exclusive),
            _ => {
                let source = &out[i].source;
                out[..i]
                    .iter()
                    .find(|r| &r.cell == source)
                    .map_or((None, false), |r| (r.train_tokens_per_s, r.train_alone))
            }
        };
    }
    Ok(SweepRows { rows: out, unread })
}

/// Whether the cell in `dir` finished: Err with why not, or why its state cannot be told.
fn finished(dir: &Path) -> Result<(), String> {
    let path = dir.join("status.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(match dir.is_dir() {
                true => "not run (no status.json)".into(),
                false => "not run (no folder)".into(),
            })
        }
        Err(e) => return Err(format!("status.json cannot be read ({e})")),
    };
    let status: Status = serde_json::from_str(&text)
        .map_err(|e| format!("status.json is unreadable (cut short?): {e}"))?;
    match status.state {
        State::Done => Ok(()),
        State::Running => Err("running, or stopped while it ran".into()),
        State::Failed => Err(format!(
            "failed: {}",
            status.error.unwrap_or_else(|| "no error recorded".into())
        )),
    }
}

/// The row of cell `c` (in `dir`), or why it has none: not finished, its evaluation or
/// pruning unreadable. Files a row can do without (logs, probe files) that cannot be read
/// leave its `note`.
fn row_of(
    c: &Cell,
    cells: &[Cell],
    dir: &Path,
    budget: &BTreeMap<String, f64>,
) -> Result<Row, String> {
    finished(dir)?;
    let ev = report::read_report(&dir.join("eval"))
        .map_err(|e| format!("{e:#}"))?
        .ok_or("finished but its eval/eval.json is missing")?;
    let a = &c.config.attention;
    let heads = c.config.model.num_hidden_layers * c.config.model.num_attention_heads;
    let source = c
        .depends_on
        .as_ref()
        .and_then(|d| cells.iter().find(|x| &x.id == d));
    let prune_path = dir.join("prune.json");
    let prune = match prune_path.is_file() {
        true => Some(
            std::fs::read_to_string(&prune_path)
                .map_err(|e| e.to_string())
                .and_then(|t| serde_json::from_str::<PruneReport>(&t).map_err(|e| e.to_string()))
                .map_err(|e| format!("prune.json is unreadable (cut short?): {e}"))?,
        ),
        false => None,
    };
    let mut note = Vec::new();
    let mut log = |name: &str| {
        let (log, problem) = Log::read(&dir.join(name));
        note.extend(problem);
        log
    };
    let (train_log, val_log) = (log("train_log.csv"), log("val_log.csv"));
    let probe_usage = or_note(
        cell_files::probe_usage(&dir.join("eval/probe_head_usage.csv")),
        &mut note,
    );
    let niah = or_note(cell_files::niah(&dir.join("eval/niah.csv")), &mut note);
    let prompts = or_note(cell_files::prompt_scores(&dir.join("eval")), &mut note);
    let mut row = Row {
        cell: c.id.clone(),
        stage: c.stage.clone(),
        kind: c.kind,
        label: c.label.clone(),
        varied: c.varied(),
        method: a.method,
        source: source.map(|s| s.id.clone()).unwrap_or_default(),
        source_method: source.map(|s| s.config.attention.method),
        window: a.window as f64,
        router: a.router,
        // As trained: a grid may set it from another cell's usage (`match_usage`).
        bernoulli_p: ev.config.attention.bernoulli_p,
        variant: (spec(a.method).variant)(a),
        head_budget: String::new(),
        heads,
        budget_tokens: budget.get(&c.id).copied().unwrap_or(f64::NAN),
        start_tokens: budget.get(&c.id).copied().unwrap_or(f64::NAN)
            - c.config.train.steps as f64 * tokens_per_step(c),
        tokens_per_step: tokens_per_step(c),
        model_key: format!(
            "{}\n{}",
            toml::to_string(&c.config.model).unwrap_or_default(),
            c.config.data.dir.display()
        ),
        report: ev.report,
        prune,
        tasks: task_metrics(&dir.join("eval/results.json")),
        tokens_per_s: train_log.as_ref().and_then(Log::median_rate),
        train_log,
        val_log,
        probe_usage,
        niah,
        train_tokens_per_s: None,
        grid_attention: a.clone(),
        attention: ev.config.attention.clone(),
        exclusive: ran_alone(dir),
        train_alone: false,
        note,
        prompt_scores: prompts.scores,
        probe_by_length: prompts.by_length,
        probe_ids: prompted(prompts.ids_by_length, &ev.config.eval),
        line: line_of(c, cells),
        rung: c.ladder.is_some(),
        also: Vec::new(),
        reads: read_lines(c, cells),
    };
    // As evaluated: a grid's random gates get their per-head rates when they run
    // (`match_usage`), which the name tells apart from one rate for every head.
    row.head_budget =
        (spec(a.method).head_budget)(&row.attention, &row.provenance(), heads, row.mu_f());
    Ok(row)
}

/// The lines of the cell `c` reads: its membership in the stage that names it
/// (`Cell::reads_stage`), else (an older cells.json) every stage that lists it.
fn read_lines(c: &Cell, cells: &[Cell]) -> Vec<String> {
    let Some(read) = &c.reads else {
        return Vec::new();
    };
    memberships(cells, read, c.reads_stage.as_ref())
        .into_iter()
        .map(|x| line_of(x, cells))
        .collect()
}

/// The entries of cell `id` in `cells` (a cell that several stages share is listed once per
/// stage): the one of `stage` where a stage is named and lists it, else every one.
fn memberships<'a>(cells: &'a [Cell], id: &str, stage: Option<&String>) -> Vec<&'a Cell> {
    let all: Vec<&Cell> = cells.iter().filter(|x| x.id == id).collect();
    let named: Vec<&Cell> = all
        .iter()
        .copied()
        .filter(|x| stage == Some(&x.stage))
        .collect();
    match named.is_empty() {
        true => all,
        false => named,
    }
}

/// Prompt identities with the settings that render a prompt around its answer (the haystack
/// and the chat template): two evaluations that differ in them ask different prompts with the
/// same sample indices and targets.
fn prompted(
    ids: BTreeMap<(String, u64), Vec<Option<String>>>,
    eval: &crate::config::EvalConfig,
) -> BTreeMap<(String, u64), Vec<Option<String>>> {
    let how = format!("{:?}|{}", eval.haystack, eval.chat);
    ids.into_iter()
        .map(|(k, v)| {
            (
                k,
                v.into_iter()
                    .map(|i| i.map(|i| format!("{i}|{how}")))
                    .collect(),
            )
        })
        .collect()
}

/// Settings of an evaluation that say how it ran, not what it evaluated: two evaluations
/// that differ only in these measure the same model the same way.
const RUN_ONLY: [&str; 8] = [
    "eval.tasks",
    "eval.lengths",
    "eval.samples",
    "eval.haystack",
    "eval.chat",
    "eval.max_batches",
    "eval.batch_size",
    "eval.timing",
];

/// The value of dotted setting `key` in `config`, a resolved config as TOML
/// (`attention.window`).
fn setting_in(config: &toml::Table, key: &str) -> Option<toml::Value> {
    let mut path = key.split('.');
    let mut v = config.get(path.next()?)?;
    for p in path {
        v = v.get(p)?;
    }
    Some(v.clone())
}

/// Whether setting `key = v` restates what `config` (as TOML) already runs: its own value, or
/// for `eval.seq_len` the training length it defaults to (0).
fn restates(config: &toml::Table, key: &str, v: &toml::Value) -> bool {
    let own = setting_in(config, key);
    own.as_ref() == Some(v)
        || (key == "eval.seq_len"
            && own.and_then(|o| o.as_integer()) == Some(0)
            && v.as_integer() == setting_in(config, "data.seq_len").and_then(|l| l.as_integer()))
}

/// `Row::line` of cell `c`. A train cell's: its stage (or the stage its stage is a lower rung
/// of) with that stage's varied settings but the seed, each as the cell has it (`aha
/// attention.window=256`), so a rung and the stage's cells of the same settings share a line.
/// An evaluation's or pruning's: the line of the train cell it acts on, then the settings it
/// changes (`l2a eval.gates=oracle`) and the threshold of any pruning on the way; of the
/// grid's pretrained model: `pretrained` and the settings it evaluates with. Settings that
/// only say how an evaluation ran (`RUN_ONLY`) or restate the model's own are left out.
fn line_of(c: &Cell, cells: &[Cell]) -> String {
    // The dependency as the stage it was expanded in lists it (a shared cell's membership
    // there), else its first entry.
    let dependency = |t: &Cell| {
        let d = t.depends_on.as_ref()?;
        memberships(cells, d, t.depends_on_stage.as_ref())
            .first()
            .copied()
    };
    let mut thresholds = Vec::new();
    let mut train = Some(c);
    while let Some(t) = train.filter(|t| t.kind != StageKind::Train) {
        thresholds.extend(t.threshold);
        train = dependency(t);
    }
    let shown = |k: &str, v: &toml::Value| format!("{k}={}", super::grid::value_str(v));
    // The train cell's resolved config, once, for the keys it leaves at the base's values.
    let resolved = train.map(|t| toml::Table::try_from(&t.config).unwrap_or_default());
    let mut parts: Vec<String> = Vec::new();
    match (train, &resolved) {
        (Some(t), Some(resolved)) => {
            let stage = t.ladder.as_deref().unwrap_or(&t.stage);
            let mut keys: Vec<&String> = cells
                .iter()
                .filter(|x| x.stage == stage)
                .flat_map(|x| x.assignment.keys())
                .filter(|k| k.as_str() != SEED_KEY)
                .collect();
            keys.sort();
            keys.dedup();
            parts.push(stage.to_string());
            for k in keys {
                match t
                    .settings
                    .get(k)
                    .cloned()
                    .or_else(|| setting_in(resolved, k))
                {
                    Some(v) => parts.push(shown(k, &v)),
                    None => parts.push(format!("{k}=?")),
                }
            }
        }
        _ => parts.push("pretrained".into()),
    }
    for (k, v) in &c.settings {
        let same = match &resolved {
            Some(resolved) => restates(resolved, k, v),
            // Its own config holds its own settings: only the length can restate (the data's).
            None => k == "eval.seq_len" && v.as_integer() == Some(c.config.data.seq_len as i64),
        };
        if !same && k != SEED_KEY && !RUN_ONLY.contains(&k.as_str()) {
            parts.push(shown(k, v));
        }
    }
    parts.extend(thresholds.iter().map(|t| format!("threshold={t}")));
    parts.join(" ")
}

/// What a file a row can do without holds, or nothing, its error noted.
fn or_note<T: Default>(read: Result<T>, note: &mut Vec<String>) -> T {
    read.unwrap_or_else(|e| {
        note.push(format!("{e:#}"));
        T::default()
    })
}

fn read_json(p: &Path) -> Option<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()
}

/// `<task>.<metric>` of a harness-shaped results file (standard errors left out).
fn task_metrics(path: &Path) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let Some(j) = read_json(path) else { return out };
    for (task, metrics) in j["results"].as_object().into_iter().flatten() {
        for (k, v) in metrics.as_object().into_iter().flatten() {
            let metric = k.split(',').next().unwrap_or(k);
            if let (Some(v), false) = (v.as_f64(), metric.ends_with("_stderr")) {
                out.insert(format!("{task}.{metric}"), v);
            }
        }
    }
    out
}
