//! The budget ladder: each line's loss, usage and probes against the training tokens behind
//! its models, where a grid trains the same set-up at several budgets (a stage and the lower
//! rungs that name it in `ladder`): the table `budget.csv` and the figures `budget_ladder` and
//! `budget_positions`. The grid's other train lines, each at its one budget, join the tables
//! (their probes tested against the start with the rest), not the figures.
//! A line is `Row::line`: a train stage with its settings, an evaluation of it with the
//! settings it changes, or the grid's pretrained model (0 tokens, the start of every line).

use super::grid::StageKind;
use super::rows::Row;
use crate::config::{name_of, Method};
use crate::util::stats::{
    binary, concordance, holm, mcnemar_exact, mean_interval, newcombe_paired, paired_bootstrap,
    pooled_interval, unpaired_difference, wilson, BOOTSTRAP_MIN_P,
};
use anyhow::Result;
use polars::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

/// A mean with its 95 % interval (NaN bounds for one measurement that has no count).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Estimate {
    pub(crate) mean: f64,
    pub(crate) low: f64,
    pub(crate) high: f64,
}

impl Estimate {
    /// The mean of replicates with its interval (`mean_interval`, inside `bounds`).
    fn of(xs: &[f64], bounds: Option<(f64, f64)>) -> Option<Self> {
        (!xs.is_empty()).then(|| {
            let (low, high) = mean_interval(xs, bounds);
            Estimate {
                mean: xs.iter().sum::<f64>() / xs.len() as f64,
                low,
                high,
            }
        })
    }

    /// A score pooled over replicates, each given as its prompts' values: the mean over the
    /// replicates' means, with Wilson's interval where one replicate scored 0/1 prompts (the
    /// prompts' sampling alone), else the two-level bootstrap over seeds and prompts.
    fn pooled(groups: &[Vec<f64>]) -> Option<Self> {
        let means: Vec<f64> = groups
            .iter()
            .filter(|g| !g.is_empty())
            .map(|g| g.iter().sum::<f64>() / g.len() as f64)
            .collect();
        if means.is_empty() {
            return None;
        }
        let binary = |g: &Vec<f64>| g.iter().all(|&x| x == 0.0 || x == 1.0);
        let (low, high) = match groups {
            [one] if binary(one) => wilson(one.iter().sum(), one.len() as f64),
            _ => pooled_interval(groups),
        };
        Some(Estimate {
            mean: means.iter().sum::<f64>() / means.len() as f64,
            low,
            high,
        })
    }
}

/// One line at one budget: its replicates pooled.
#[derive(Debug)]
pub(crate) struct Rung {
    pub(crate) line: String,
    pub(crate) method: Method,
    /// Training tokens behind its models (0: the pretrained model as it came).
    pub(crate) tokens: f64,
    pub(crate) replicates: usize,
    /// Its replicates are train cells (with their evaluations), not only evaluations.
    pub(crate) trained: bool,
    /// Its line is a ladder's (two budgets or more, or a lower rung among its cells), an
    /// evaluation of one, or the pretrained start: what the figures draw.
    pub(crate) ladder: bool,
    /// Length of the sequences its loss was measured on.
    pub(crate) eval_seq_len: usize,
    pub(crate) loss: Option<Estimate>,
    pub(crate) mu_f: Option<Estimate>,
    /// Per (task, prompt length), and per length over every task (task `ALL_TASKS`): the
    /// probes' exact match, with the prompts and replicates behind it.
    pub(crate) probes: BTreeMap<(String, u64), Probed>,
    /// Per (task, prompt length): each replicate's prompts, for paired comparisons.
    pub(crate) prompt_sets: BTreeMap<(String, u64), Vec<Prompts>>,
    /// Per bucket of positions (`from..to`): the loss there, where its evaluations split it
    /// (over the replicates that did: every replicate of a line is evaluated alike).
    pub(crate) by_position: BTreeMap<(usize, usize), Estimate>,
    /// The lines every one of its train replicates reads (`Row::reads`): the set-up it is a
    /// control of (empty for any other line).
    pub(crate) reads: Vec<String>,
}

/// A rung's probes of one task (or all) at one prompt length.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Probed {
    /// Exact match pooled over the replicates and their prompts.
    pub(crate) score: Estimate,
    /// Prompts a replicate (the most of any).
    pub(crate) prompts: usize,
    /// The models probed: fewer than the rung's replicates where some went unprobed.
    pub(crate) replicates: usize,
}

/// The task name of a rung's probes pooled over its tasks.
pub(crate) const ALL_TASKS: &str = "all";

/// The rungs of a grid with a ladder, in line then token order: each train line with two
/// budgets or more or a lower rung among its cells (a control run on a lower rung before its
/// top one), every other train line at its budget, the evaluations of those lines (at
/// whichever budgets they ran), and the pretrained model's evaluations. Empty when no train
/// line is a ladder's.
pub(crate) fn rungs(rows: &[Row]) -> Vec<Rung> {
    let mut budgets: BTreeMap<String, (BTreeSet<u64>, bool)> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.kind == StageKind::Train) {
        // Each line with the cell's rung flag in its own stage (a lower rung shared with a
        // stage of one budget makes no ladder of that stage).
        let places =
            std::iter::once((&r.line, r.rung)).chain(r.also.iter().map(|m| (&m.line, m.rung)));
        for (line, is_rung) in places {
            let (b, rung) = budgets.entry(line.clone()).or_default();
            b.insert(r.budget_tokens.to_bits());
            *rung |= is_rung;
        }
    }
    let ladders: Vec<&String> = budgets
        .iter()
        .filter_map(|(l, (b, rung))| (b.len() >= 2 || *rung).then_some(l))
        .collect();
    if ladders.is_empty() {
        return Vec::new();
    }
    // A line of `lines` or an evaluation of one (its name and then the settings the
    // evaluation changes).
    let of = |line: &str, lines: &[&String]| {
        lines
            .iter()
            .any(|l| line == l.as_str() || line.starts_with(&format!("{l} ")))
    };
    let trained: Vec<&String> = budgets.keys().collect();
    // The pretrained model's evaluations (no cell behind them) start every line.
    let mut groups: BTreeMap<(String, u64), Vec<&Row>> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.kind != StageKind::Prune) {
        let tokens = if pretrained(r) { 0.0 } else { r.budget_tokens };
        for line in lines(r).filter(|l| pretrained(r) || of(l, &trained)) {
            groups
                .entry((line.clone(), tokens.to_bits()))
                .or_default()
                .push(r);
        }
    }
    // The validation tokens the ladders' train cells measured their loss on, per sequence
    // length: another rung's loss (the start's, an evaluation's) is comparable with theirs
    // only on as many tokens.
    let mut scale: BTreeMap<usize, BTreeSet<u64>> = BTreeMap::new();
    for r in rows
        .iter()
        .filter(|r| r.kind == StageKind::Train && lines(r).any(|l| ladders.contains(&l)))
    {
        scale
            .entry(r.report.seq_len)
            .or_default()
            .insert(r.report.tokens);
    }
    let mut out: Vec<Rung> = groups
        .into_iter()
        .map(|((line, tokens), rows)| {
            let ladder = tokens == 0 || of(&line, &ladders);
            rung(line, f64::from_bits(tokens), ladder, &rows, &scale)
        })
        .collect();
    out.sort_by(|a, b| a.line.cmp(&b.line).then(a.tokens.total_cmp(&b.tokens)));
    out
}

/// The lines a row is a replicate of: its own, and its line in each other stage that shares
/// the cell (`Row::also`).
fn lines(r: &Row) -> impl Iterator<Item = &String> {
    let mut lines: Vec<&String> = vec![&r.line];
    for m in &r.also {
        // Two memberships on one line (a ladder's rung, an older cells.json) count once.
        if !lines.contains(&&m.line) {
            lines.push(&m.line);
        }
    }
    lines.into_iter()
}

/// Whether `r` evaluates the grid's pretrained model (no cell behind it): the start of every
/// line.
fn pretrained(r: &Row) -> bool {
    r.kind == StageKind::Eval && r.source.is_empty()
}

/// One model of a rung: the row that measured its loss and usage, and its probes' prompts.
#[derive(Default)]
struct Model<'a> {
    measured: Option<&'a Row>,
    prompts: BTreeMap<(String, u64), Prompts>,
}

/// One model's prompts of one task at one length: each one's score and what it was, and the
/// model (the train cell behind it; "" for the pretrained model).
#[derive(Clone, Debug, Default)]
pub(crate) struct Prompts {
    pub(crate) scores: Vec<f64>,
    pub(crate) ids: Vec<Option<String>>,
    pub(crate) model: String,
}

impl Prompts {
    /// Whether these are `start`'s prompts, one for one: every prompt named, none twice, the
    /// same ones in the same order.
    fn same_as(&self, start: &Prompts) -> bool {
        let named = |p: &Prompts| {
            let ids: Vec<&String> = p.ids.iter().flatten().collect();
            let unique: std::collections::BTreeSet<&&String> = ids.iter().collect();
            ids.len() == p.scores.len() && unique.len() == ids.len()
        };
        named(self) && named(start) && self.ids == start.ids
    }
}

/// The rung of `line` at `tokens` from its rows. Its replicates are the models they measure:
/// each train cell, or each model the evaluations act on (the cell behind them; the
/// pretrained model). Several evaluations of one model are one replicate: its prompts merged,
/// its loss and usage the train cell's own evaluation, else one without probes, else any;
/// among the pretrained model's evaluations, one over as many validation tokens as the
/// ladders' train cells at its length (`scale`) first, and a loss on other tokens left out (a
/// probe evaluation of a third of the tokens is not the start of a line measured on all of
/// them). A trained model's evaluations are lines of their own, read as they were measured.
/// `ladder`: whether the figures draw it (`Rung::ladder`).
fn rung(
    line: String,
    tokens: f64,
    ladder: bool,
    rows: &[&Row],
    scale: &BTreeMap<usize, BTreeSet<u64>>,
) -> Rung {
    // A loss measured on other validation tokens than the ladders' train cells at its length
    // (a probe cell's few batches, the start's evaluation) is not theirs to compare: an
    // evaluation's line that changes only what its probes see (oracle gates) would otherwise
    // read its fewer batches' loss as a gain.
    let comparable = |r: &Row| {
        scale
            .get(&r.report.seq_len)
            .is_none_or(|t| t.contains(&r.report.tokens))
    };
    let rank = |r: &Row| {
        let kind = match (r.kind, r.probe_by_length.is_empty()) {
            (StageKind::Train, _) => 0,
            (_, true) => 1,
            (_, false) => 2,
        };
        kind + if comparable(r) { 0 } else { 3 }
    };
    let mut models: BTreeMap<&str, Model> = BTreeMap::new();
    for &r in rows {
        let of = match r.kind {
            StageKind::Train => r.cell.as_str(),
            _ => r.source.as_str(),
        };
        let m = models.entry(of).or_default();
        if m.measured.is_none_or(|p| rank(r) < rank(p)) {
            m.measured = Some(r);
        }
        for (key, prompts) in &r.probe_by_length {
            let p = m.prompts.entry(key.clone()).or_default();
            p.model = of.to_string();
            p.scores.extend(prompts);
            p.ids
                .extend(r.probe_ids.get(key).into_iter().flatten().cloned());
        }
    }
    let measured: Vec<&Row> = models.values().filter_map(|m| m.measured).collect();
    let lossy: Vec<&Row> = measured.iter().copied().filter(|r| comparable(r)).collect();
    let losses: Vec<f64> = lossy.iter().map(|r| r.loss()).collect();
    let mut positions: BTreeMap<(usize, usize), Vec<f64>> = BTreeMap::new();
    for r in &lossy {
        for p in &r.report.by_position {
            positions.entry((p.from, p.to)).or_default().push(p.loss);
        }
    }
    let usage: Vec<f64> = measured.iter().filter_map(|r| r.mu_f()).collect();
    // Each model's prompts per (task, length), and per length over its tasks.
    let mut groups: BTreeMap<(String, u64), Vec<Vec<f64>>> = BTreeMap::new();
    let mut prompt_sets: BTreeMap<(String, u64), Vec<Prompts>> = BTreeMap::new();
    for m in models.values() {
        let mut all: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
        for ((task, len), prompts) in &m.prompts {
            groups
                .entry((task.clone(), *len))
                .or_default()
                .push(prompts.scores.clone());
            prompt_sets
                .entry((task.clone(), *len))
                .or_default()
                .push(prompts.clone());
            all.entry(*len).or_default().extend(&prompts.scores);
        }
        for (len, prompts) in all {
            groups
                .entry((ALL_TASKS.into(), len))
                .or_default()
                .push(prompts);
        }
    }
    let probes = groups
        .into_iter()
        .filter_map(|(key, groups)| {
            let prompts = groups.iter().map(Vec::len).max().unwrap_or(0);
            Estimate::pooled(&groups).map(|score| {
                let replicates = groups.len();
                (
                    key,
                    Probed {
                        score,
                        prompts,
                        replicates,
                    },
                )
            })
        })
        .collect();
    Rung {
        line,
        method: measured[0].method,
        tokens,
        replicates: models.len(),
        trained: rows.iter().any(|r| r.kind == StageKind::Train),
        ladder,
        eval_seq_len: measured[0].report.seq_len,
        loss: Estimate::of(&losses, None),
        mu_f: Estimate::of(&usage, Some((0.0, 1.0))),
        probes,
        prompt_sets,
        by_position: positions
            .into_iter()
            .filter_map(|(k, v)| Estimate::of(&v, None).map(|e| (k, e)))
            .collect(),
        reads: read_by_all(rows),
    }
}

/// The lines that every train row of a rung reads (a shared cell read by the first seed is
/// on two lines; the others' cells on one of them).
fn read_by_all(rows: &[&Row]) -> Vec<String> {
    let mut train = rows.iter().filter(|r| r.kind == StageKind::Train);
    let Some(first) = train.next() else {
        return Vec::new();
    };
    let mut lines = first.reads.clone();
    for r in train {
        lines.retain(|l| r.reads.contains(l));
    }
    lines
}

/// `budget.csv`: a row per rung and, for its probes, per task and prompt length (task
/// `all`: over its tasks; a rung without probes has one row, its task empty); None without a
/// ladder.
pub(crate) fn table(rows: &[Row]) -> Result<Option<DataFrame>> {
    let rungs = rungs(rows);
    if rungs.is_empty() {
        return Ok(None);
    }
    // (rung, its probes of one task at one length)
    type Probe<'a> = (&'a (String, u64), &'a Probed);
    let mut flat: Vec<(&Rung, Option<Probe>)> = Vec::new();
    for r in &rungs {
        match r.probes.is_empty() {
            true => flat.push((r, None)),
            false => flat.extend(r.probes.iter().map(|p| (r, Some(p)))),
        }
    }
    let est = |f: &dyn Fn(&Rung) -> Option<Estimate>, g: fn(&Estimate) -> f64| {
        flat.iter()
            .map(|(r, _)| f(r).as_ref().map(g))
            .collect::<Vec<Option<f64>>>()
    };
    let probe = |g: fn(&Estimate) -> f64| {
        flat.iter()
            .map(|(_, p)| p.map(|(_, probed)| g(&probed.score)))
            .collect::<Vec<Option<f64>>>()
    };
    let loss = |r: &Rung| r.loss;
    let mu_f = |r: &Rung| r.mu_f;
    let df = df!(
        "line" => flat.iter().map(|(r, _)| r.line.clone()).collect::<Vec<_>>(),
        "method" => flat.iter().map(|(r, _)| name_of(r.method)).collect::<Vec<_>>(),
        "budget_tokens" => flat.iter().map(|(r, _)| r.tokens).collect::<Vec<_>>(),
        "replicates" => flat.iter().map(|(r, _)| r.replicates as u64).collect::<Vec<_>>(),
        "eval_seq_len" => flat.iter().map(|(r, _)| r.eval_seq_len as u64).collect::<Vec<_>>(),
        "loss" => est(&loss, |e| e.mean),
        "loss_ci95_low" => est(&loss, |e| e.low),
        "loss_ci95_high" => est(&loss, |e| e.high),
        "mu_f" => est(&mu_f, |e| e.mean),
        "mu_f_ci95_low" => est(&mu_f, |e| e.low),
        "mu_f_ci95_high" => est(&mu_f, |e| e.high),
        "probe_task" => flat.iter().map(|(_, p)| p.map(|p| p.0 .0.clone())).collect::<Vec<_>>(),
        "probe_length" => flat.iter().map(|(_, p)| p.map(|p| p.0 .1)).collect::<Vec<_>>(),
        "probe_replicates" => flat.iter().map(|(_, p)| p.map(|p| p.1.replicates as u64)).collect::<Vec<_>>(),
        "probe_prompts" => flat.iter().map(|(_, p)| p.map(|p| p.1.prompts as u64)).collect::<Vec<_>>(),
        "probe_exact_match" => probe(|e| e.mean),
        "probe_ci95_low" => probe(|e| e.low),
        "probe_ci95_high" => probe(|e| e.high),
    )?;
    Ok(Some(df))
}

/// `budget_differences.csv`: each rung's probes against the pretrained model's on the same
/// task and prompt length (the rung less the start, named in `start`), so that a rung that
/// reads above or below the start gets a test, not a look at two intervals; each evaluation
/// with gates other than the model's own (`eval.gates`, the oracle's) against the same model
/// with its learned gates at the same budget (`start` names that line): what the router costs
/// the probes; and each trained line of another method against full attention trained on as
/// many tokens (`start` names it), the reference a method's probes are read against at equal
/// work; and each line built from another line's cells (`reads`: static heads ranked by it,
/// random gates drawn at its usage, AHA started from its ranking) against that line at its
/// budget (`start` names it; `read_line`), the comparison AHA's Table 5 makes. One replicate on the reference's own prompts (`Prompts::same_as`) is paired over
/// them: exact McNemar with Newcombe's interval for 0/1 scores, else the paired bootstrap.
/// Several replicates each paired with the reference's on the same prompts (the same model
/// with other gates; the same seed's prompts for the reference, whose replicates without a
/// partner are left out) take the paired bootstrap over the pairs and their prompts, its own
/// p (`compared_pairs`); the rest, the unpaired bootstrap over seeds and prompts
/// (`compared`). Holm's adjustment covers the table's rows that their test could make
/// differ (`min_p`, the smallest p it could give these prompts, below 0.05: Tarone's argument
/// that a row no outcome can reject adds nothing to the family but its count); the others are
/// "within noise" with no adjusted p. "differs" needs the p-value (Holm's, for
/// `verdict_holm`) below 0.05 and the 95 % interval clear of 0 (at the margin, five
/// discordant prompts all one way, Newcombe's asymptotic interval leaves 0 out where the exact
/// test does not reject: the verdict follows both). A key probed by several pretrained lines,
/// or by several full-attention lines at one budget none of which holds the others' models
/// (`reference_of`), has no row against them (which is meant is not known). None without a
/// ladder or a probed start.
pub(crate) fn differences(rows: &[Row]) -> Result<Option<DataFrame>> {
    let rungs = rungs(rows);
    let starts: Vec<&Rung> = rungs
        .iter()
        .filter(|r| !r.trained && r.tokens == 0.0)
        .collect();
    // The one pretrained line probed on `key`, with its one model's prompts.
    let start_of = |key: &(String, u64)| match starts
        .iter()
        .filter_map(|s| Some((*s, &s.prompt_sets.get(key)?[..])))
        .collect::<Vec<_>>()[..]
    {
        [(s, [p])] => Some((s, p)),
        _ => None,
    };
    struct Out<'a> {
        rung: &'a Rung,
        start: &'a Rung,
        key: &'a (String, u64),
        /// The line's replicates on `key`.
        sets: &'a [Prompts],
        /// `[difference, low, high, p, min_p]` (`compared`).
        test: [f64; 5],
        how: &'static str,
    }
    let mut out: Vec<Out> = Vec::new();
    let mut push = |rung, start, key, sets, (test, how)| {
        out.push(Out {
            rung,
            start,
            key,
            sets,
            test,
            how,
        })
    };
    for r in rungs.iter().filter(|r| r.tokens > 0.0) {
        for (key, sets) in &r.prompt_sets {
            let Some((start, base)) = start_of(key) else {
                continue;
            };
            push(
                r,
                start,
                key,
                sets,
                compared(sets, std::slice::from_ref(base)),
            );
        }
    }
    for r in rungs.iter().filter(|r| r.tokens > 0.0 && !r.trained) {
        let Some(own) = learned_line(&r.line) else {
            continue;
        };
        let Some(learned) = rungs.iter().find(|q| q.line == own && q.tokens == r.tokens) else {
            continue;
        };
        for (key, sets) in &r.prompt_sets {
            let Some(base) = learned.prompt_sets.get(key) else {
                continue;
            };
            let pairs = same_models(sets, base);
            if pairs.is_empty() {
                continue;
            }
            push(r, learned, key, sets, compared_pairs(&pairs, SAME_MODELS));
        }
    }
    // Each trained line of another method against full attention at its budget, and each
    // control against the line it reads there (static heads or random gates against the
    // routed model they copy; `read_line`).
    for r in rungs.iter().filter(|r| r.trained && r.tokens > 0.0) {
        for (key, sets) in &r.prompt_sets {
            let full = (r.method != Method::Full)
                .then(|| reference_of(&rungs, r.tokens, key))
                .flatten();
            let read = read_line(&rungs, r).filter(|q| q.prompt_sets.contains_key(key));
            for start in full.into_iter().chain(read) {
                let base = &start.prompt_sets[key];
                let pairs = same_prompts(sets, base);
                let test = match pairs.len() == sets.len() {
                    true => compared_pairs(&pairs, SAME_PROMPTS),
                    false => compared(sets, base),
                };
                push(r, start, key, sets, test);
            }
        }
    }
    if out.is_empty() {
        return Ok(None);
    }
    let adjusted = holm_within_reach(&out.iter().map(|o| o.test).collect::<Vec<_>>());
    let verdict = |p: f64, o: &Out| match p.is_nan() {
        true if o.test[4] >= 0.05 && !o.test[3].is_nan() => "within noise",
        true => "no test",
        false if p < 0.05 && (o.test[1] > 0.0 || o.test[2] < 0.0) => "differs",
        false => "within noise",
    };
    let col = |i: usize| out.iter().map(|o| o.test[i]).collect::<Vec<f64>>();
    let df = df!(
        "line" => out.iter().map(|o| o.rung.line.clone()).collect::<Vec<_>>(),
        "budget_tokens" => out.iter().map(|o| o.rung.tokens).collect::<Vec<_>>(),
        "start" => out.iter().map(|o| o.start.line.clone()).collect::<Vec<_>>(),
        "probe_task" => out.iter().map(|o| o.key.0.clone()).collect::<Vec<_>>(),
        "probe_length" => out.iter().map(|o| o.key.1).collect::<Vec<_>>(),
        "probe_replicates" => out.iter().map(|o| o.sets.len() as u64).collect::<Vec<_>>(),
        "probe_prompts" => out.iter().map(|o| o.sets.iter().map(|p| p.scores.len() as u64).max().unwrap_or(0)).collect::<Vec<_>>(),
        "difference" => col(0),
        "ci95_low" => col(1),
        "ci95_high" => col(2),
        "p" => col(3),
        "min_p" => col(4),
        "verdict" => out.iter().map(|o| verdict(o.test[3], o)).collect::<Vec<_>>(),
        "p_holm" => adjusted.clone(),
        "verdict_holm" => out.iter().zip(&adjusted).map(|(o, &p)| verdict(p, o)).collect::<Vec<_>>(),
        "test" => out.iter().map(|o| o.how).collect::<Vec<_>>(),
    )?;
    Ok(Some(df))
}

/// Holm's adjustment of the tests' p-values (`[.., p, min_p]`, as `compared` gives them)
/// over the family of those whose `min_p` is below 0.05; NaN for the others, which no outcome
/// of their prompts could make differ (so they are not counted against the rest).
fn holm_within_reach(tests: &[[f64; 5]]) -> Vec<f64> {
    let p: Vec<f64> = tests
        .iter()
        .map(|t| if t[4] < 0.05 { t[3] } else { f64::NAN })
        .collect();
    holm(&p)
}

/// Probes `sets` less the reference's `base` on one task and length, with how it was tested:
/// one replicate on the reference's one set of the same prompts paired over them (exact
/// McNemar with Newcombe's interval for 0/1 scores, else the paired bootstrap), anything else
/// unpaired over seeds and prompts. `[difference, low, high, p, min_p]`: `min_p` is the
/// smallest p the test could give these prompts (McNemar's with every discordant prompt one
/// way; for a bootstrap 1 where nothing differs, every pair tied or one score everywhere,
/// else the resolution of its p, `BOOTSTRAP_MIN_P`).
fn compared(sets: &[Prompts], base: &[Prompts]) -> ([f64; 5], &'static str) {
    match (sets, base) {
        ([one], [base]) if one.same_as(base) && binary(&one.scores) && binary(&base.scores) => {
            let pairs = one.scores.iter().copied().zip(base.scores.iter().copied());
            let [a, b, c, d] = concordance(&[pairs.collect()]);
            let (lo, hi) = newcombe_paired(a, b, c, d);
            let diff = (b as f64 - c as f64) / one.scores.len() as f64;
            (
                [diff, lo, hi, mcnemar_exact(b, c), mcnemar_exact(b + c, 0)],
                "paired over the same prompts: McNemar, Newcombe's interval",
            )
        }
        ([one], [base]) if one.same_as(base) => (
            paired_bootstrap_of(&[(one, base)]),
            "paired over the same prompts: bootstrap",
        ),
        _ => {
            let groups =
                |ps: &[Prompts]| -> Vec<Vec<f64>> { ps.iter().map(|p| p.scores.clone()).collect() };
            let (d, lo, hi, p) = unpaired_difference(&groups(sets), &groups(base));
            let mut all = sets.iter().chain(base).flat_map(|p| &p.scores);
            let first = all.next().copied();
            let constant = all.all(|&x| Some(x) == first);
            (
                [d, lo, hi, p, if constant { 1.0 } else { BOOTSTRAP_MIN_P }],
                "unpaired bootstrap over seeds and prompts",
            )
        }
    }
}

/// Each of `sets` beside the set of `base` that measured the same model (a model `base`
/// lacks is left out): the evaluations of one model with two kinds of gates.
fn same_models<'a>(sets: &'a [Prompts], base: &'a [Prompts]) -> Vec<(&'a Prompts, &'a Prompts)> {
    sets.iter()
        .filter_map(|s| base.iter().find(|b| b.model == s.model).map(|b| (s, b)))
        .collect()
}

/// The full-attention line trained on `tokens` and probed on `key`: the reference of a
/// method's probes at that budget. Of several, the one whose probed models hold every other's
/// (a stage of three seeds whose first is another line's cell); None where there is none, or
/// where two are probed on models apart (which is meant is not known).
fn reference_of<'a>(rungs: &'a [Rung], tokens: f64, key: &(String, u64)) -> Option<&'a Rung> {
    let probed: Vec<&Rung> = rungs
        .iter()
        .filter(|q| q.trained && q.method == Method::Full && q.tokens == tokens)
        .filter(|q| q.prompt_sets.contains_key(key))
        .collect();
    let models = |q: &Rung| -> BTreeSet<String> {
        q.prompt_sets[key].iter().map(|p| p.model.clone()).collect()
    };
    // Lines holding the same models are the same cells: any of them serves.
    probed
        .iter()
        .find(|q| probed.iter().all(|o| models(o).is_subset(&models(q))))
        .copied()
}

/// The trained line that control `r` reads at its budget (`Rung::reads`: the membership its
/// stage names), other than full attention's; of several (a sweep written before
/// `Cell::reads_stage`, whose shared first seed reads on two lines), the one with the most
/// replicates.
fn read_line<'a>(rungs: &'a [Rung], r: &Rung) -> Option<&'a Rung> {
    rungs
        .iter()
        .filter(|q| q.trained && q.tokens == r.tokens && q.method != Method::Full)
        .filter(|q| r.reads.contains(&q.line))
        .max_by_key(|q| q.replicates)
}

/// Each of `sets` beside the set of `base` on the same prompts (`Prompts::same_as`; a set
/// with none there is left out): two models' replicates of one seed's prompts.
fn same_prompts<'a>(sets: &'a [Prompts], base: &'a [Prompts]) -> Vec<(&'a Prompts, &'a Prompts)> {
    sets.iter()
        .filter_map(|s| base.iter().find(|b| s.same_as(b)).map(|b| (s, b)))
        .collect()
}

/// How `compared_pairs` names the paired bootstrap over pairs of one model's evaluations.
const SAME_MODELS: &str = "paired over the same models and prompts: bootstrap";
/// How `compared_pairs` names it over pairs of two models on one seed's prompts.
const SAME_PROMPTS: &str = "paired over each seed's prompts: bootstrap";

/// Probes less those they are paired with (`same_models`, `same_prompts`): several pairs,
/// each on one set of prompts, by the paired bootstrap over the pairs and their prompts (named
/// `several`); else as `compared` reads them.
fn compared_pairs(
    pairs: &[(&Prompts, &Prompts)],
    several: &'static str,
) -> ([f64; 5], &'static str) {
    if pairs.len() > 1 && pairs.iter().all(|(a, b)| a.same_as(b)) {
        return (paired_bootstrap_of(pairs), several);
    }
    let (sets, base): (Vec<Prompts>, Vec<Prompts>) = pairs
        .iter()
        .map(|(a, b)| ((*a).clone(), (*b).clone()))
        .unzip();
    compared(&sets, &base)
}

/// Pairs of sets on the same prompts by the paired bootstrap (`stats::paired_bootstrap`: its
/// interval and its own p, also for 0/1 scores, since several pairs are several models), as
/// `compared` gives it: `min_p` 1 where every pair of scores is tied, else the resolution of
/// its p.
fn paired_bootstrap_of(pairs: &[(&Prompts, &Prompts)]) -> [f64; 5] {
    let zipped: Vec<Vec<(f64, f64)>> = pairs
        .iter()
        .map(|(a, b)| {
            a.scores
                .iter()
                .copied()
                .zip(b.scores.iter().copied())
                .collect()
        })
        .collect();
    let (d, lo, hi, p) = paired_bootstrap(&zipped);
    let tied = zipped.iter().flatten().all(|(a, b)| a == b);
    [d, lo, hi, p, if tied { 1.0 } else { BOOTSTRAP_MIN_P }]
}

/// The line of the same model evaluated with its learned gates, for a line that evaluates it
/// with others (`... eval.gates=oracle`); None for any other line.
fn learned_line(line: &str) -> Option<String> {
    let parts: Vec<&str> = line.split(' ').collect();
    let kept: Vec<&str> = parts
        .iter()
        .copied()
        .filter(|p| !p.starts_with("eval.gates="))
        .collect();
    (kept.len() < parts.len()).then(|| kept.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sweep::figure::Figure;
    use crate::sweep::figures::figures;
    use crate::sweep::fixture::{csv, sweep_dir_with_ladders};
    use crate::sweep::rows::rows;

    /// Each line with two budgets is a ladder: its rungs in token order, a train cell's loss
    /// and usage, the probes of its evaluations merged per model and pooled per task and
    /// prompt length with Wilson's interval (one replicate of 0/1 prompts); lines of one
    /// budget without a lower rung among their cells join as one rung each, no ladder's (in
    /// the table, not the figure); the pretrained model's evaluations are one model at 0
    /// tokens, its loss the evaluation without probes; the table has a row per rung, task
    /// and length, the
    /// figure a panel per quantity and length, with AHA's paper usage as a reference line.
    #[test]
    fn ladders_pool_each_lines_rungs_and_probes_by_length() {
        let dir = sweep_dir_with_ladders("ladders");
        let all = rows(&dir).unwrap().rows;
        let every = rungs(&all);
        // SWA's and the static hybrid's lines have one budget and no lower rung: each is one
        // rung at its budget, for the tables, and no ladder's.
        for one in [
            "swa attention.method=swa",
            "hyb attention.method=static_hybrid",
        ] {
            let at: Vec<&Rung> = every.iter().filter(|r| r.line == one).collect();
            assert!(
                at.len() == 1 && at[0].trained && !at[0].ladder,
                "{every:#?}"
            );
        }
        let rungs: Vec<Rung> = every.into_iter().filter(|r| r.ladder).collect();
        let full: Vec<&Rung> = rungs.iter().filter(|r| r.line == "full").collect();
        let aha: Vec<&Rung> = rungs
            .iter()
            .filter(|r| r.line.starts_with("aha "))
            .collect();
        let base: Vec<&Rung> = rungs.iter().filter(|r| r.tokens == 0.0).collect();
        let ctl: Vec<&Rung> = rungs.iter().filter(|r| r.line == "ctl").collect();
        assert_eq!(
            (full.len(), aha.len(), base.len(), ctl.len(), rungs.len()),
            (2, 2, 1, 1, 6),
            "{rungs:#?}"
        );
        assert_eq!(ctl[0].loss.unwrap().mean, 2.05);
        assert!(
            aha[0].line.contains("attention.window=16"),
            "{}",
            aha[0].line
        );
        assert!(full[0].tokens < full[1].tokens && aha[0].tokens < aha[1].tokens);
        let loss = |r: &Rung| r.loss.unwrap();
        assert_eq!((loss(full[0]).mean, loss(full[1]).mean), (1.95, 1.8));
        assert!(full
            .iter()
            .all(|r| r.trained && r.replicates == 1 && loss(r).low.is_nan()));
        let usage: Vec<f64> = aha.iter().map(|r| r.mu_f.unwrap().mean).collect();
        assert_eq!(usage, [0.9, 0.6]);
        let at = |r: &Rung, task: &str, len: u64| r.probes[&(task.to_string(), len)];
        let Probed {
            score: e,
            prompts,
            replicates,
        } = at(full[1], ALL_TASKS, 8);
        assert_eq!(replicates, 1);
        assert_eq!((e.mean, prompts), (0.8, 5));
        assert_eq!((e.low, e.high), wilson(4.0, 5.0));
        assert_eq!(at(full[1], "niah_single", 16).score.mean, 0.5);
        assert_eq!(at(full[1], "niah_multikey", 8).score.mean, 1.0);
        assert_eq!(at(full[1], "niah_single", 8).score.mean, 2.0 / 3.0);
        assert_eq!(at(full[0], ALL_TASKS, 8).score, {
            let (low, high) = wilson(0.0, 2.0);
            Estimate {
                mean: 0.0,
                low,
                high,
            }
        });
        assert!(aha.iter().all(|r| r.probes.is_empty()));
        assert!(!base[0].trained && base[0].replicates == 1 && base[0].line == "pretrained");
        assert_eq!(loss(base[0]).mean, 2.2);
        assert_eq!(at(base[0], ALL_TASKS, 8).score.mean, 0.5);

        let out = dir.join("out");
        std::fs::create_dir_all(&out).unwrap();
        crate::sweep::tables::write_all(&dir, &out, false).unwrap();
        let table = csv(&out.join("budget.csv"));
        // full-0: four rows at 8 (every task among them), two at 16; its rung two at each;
        // AHA's two rungs; the control's one; the pretrained model's two; and a row for each
        // of the 13 lines at one budget, none probed.
        assert_eq!(table.len(), 1 + 6 + 4 + 2 + 1 + 2 + 13, "{table:?}");
        assert!(table
            .iter()
            .any(|r| r[0] == "swa attention.method=swa" && r[11].is_empty()));
        assert!(table.iter().any(|r| r[0] == "full"
            && r[11] == "all"
            && r[12] == "8"
            && r[13] == "1"
            && r[14] == "5"
            && r[15] == "0.8"));

        let figs = figures(&dir).unwrap();
        let Some((_, Figure::Panels { panels, .. })) =
            figs.iter().find(|(stem, _)| stem == "budget_ladder")
        else {
            panic!("no budget_ladder figure");
        };
        let titles: Vec<&str> = panels.iter().map(|p| p.title.as_str()).collect();
        assert_eq!(titles.len(), 4, "{titles:?}");
        assert!(titles[2].contains("probes at 8") && titles[3].contains("probes at 16"));
        // The lines at one budget are in the table, not the figure.
        let drawn: Vec<&str> = panels[0].series.iter().map(|s| s.name.as_str()).collect();
        assert!(
            drawn.contains(&"full") && !drawn.iter().any(|n| n.starts_with("swa")),
            "{drawn:?}"
        );
        assert!(panels[1]
            .series
            .iter()
            .any(|s| s.name.starts_with("AHA paper") && s.points[0].1 == 0.067));
        // The pretrained model's loss and probes are the start lines.
        let start = |p: usize| {
            panels[p]
                .series
                .iter()
                .find(|s| s.name.starts_with("pretrained"))
                .map(|s| s.points[0].1)
        };
        assert_eq!((start(0), start(2)), (Some(2.2), Some(0.5)));

        // Loss by position: a panel per budget of the lines split by position, each line's
        // buckets at their ends, the pretrained model's beside them in every panel.
        let Some((_, Figure::Panels { panels, .. })) =
            figs.iter().find(|(stem, _)| stem == "budget_positions")
        else {
            panic!("no budget_positions figure");
        };
        assert_eq!(panels.len(), 2, "a panel per budget");
        for p in panels {
            let names: Vec<&str> = p.series.iter().map(|s| s.name.as_str()).collect();
            assert_eq!(
                names,
                ["full", "pretrained, before training"],
                "{}",
                p.title
            );
            let base = &p.series[1].points;
            assert_eq!(base, &[(4.0, 2.2 + 0.3), (8.0, 2.2)]);
        }
        let full: Vec<(f64, f64)> = panels.iter().map(|p| p.series[0].points[1]).collect();
        assert_eq!(full, [(8.0, 1.95), (8.0, 1.8)]);
        assert!(panels[0].title.contains("after") && panels[0].series[0].points[0].1 > 1.95);
    }

    /// The pretrained model's loss starts a line only where it was measured on as many
    /// validation tokens as the ladders' train cells: its evaluation without probes on other
    /// tokens gives way to a probe evaluation on the same ones, and where none is, the rung
    /// has no loss (its probes stay) and the loss panel no start line. An evaluation's own
    /// line likewise.
    #[test]
    fn a_start_measured_on_other_tokens_is_left_out() {
        let dir = sweep_dir_with_ladders("ladders-scale");
        let retoken = |id: &str| {
            let eval = dir.join(id).join("eval/eval.json");
            let mut file: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&eval).unwrap()).unwrap();
            let tokens = file["report"]["tokens"].as_u64().unwrap();
            file["report"]["tokens"] = serde_json::json!(tokens / 3);
            std::fs::write(&eval, file.to_string()).unwrap();
        };
        let base = |dir: &std::path::Path| {
            let all = rows(dir).unwrap().rows;
            let rung = rungs(&all).into_iter().find(|r| r.tokens == 0.0).unwrap();
            (
                rung.loss.map(|e| e.mean),
                rung.probes.len(),
                rung.by_position.len(),
            )
        };
        retoken("pre-0");
        assert_eq!(base(&dir), (Some(2.3), 2, 0), "the probe evaluation's loss");
        retoken("prepr-0");
        let (loss, probes, _) = base(&dir);
        assert_eq!((loss, probes), (None, 2));
        let figs = figures(&dir).unwrap();
        let Some((_, Figure::Panels { panels, .. })) =
            figs.iter().find(|(stem, _)| stem == "budget_ladder")
        else {
            panic!("no budget_ladder figure");
        };
        let starts = |p: usize| {
            panels[p]
                .series
                .iter()
                .any(|s| s.name.starts_with("pretrained"))
        };
        assert!(!starts(0) && starts(2));

        // So with an evaluation's own line: oracle gates on full attention's model, whose
        // loss its fewer batches measured with the model's own gates.
        let path = dir.join("cells.json");
        let mut cells: Vec<crate::sweep::Cell> =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for c in cells.iter_mut().filter(|c| c.id == "probefull2-0") {
            c.settings.insert("eval.gates".into(), "oracle".into());
        }
        std::fs::write(&path, serde_json::to_string(&cells).unwrap()).unwrap();
        let oracle = || {
            let all = rows(&dir).unwrap().rows;
            let line = rungs(&all)
                .into_iter()
                .find(|r| r.line == "full eval.gates=oracle");
            line.map(|r| (r.loss.map(|e| e.mean), r.probes.len()))
        };
        assert_eq!(oracle(), Some((Some(1.81), 2)));
        retoken("probefull2-0");
        assert_eq!(oracle(), Some((None, 2)));
    }

    /// A text column of a table, and a number column.
    fn texts(df: &DataFrame, c: &str) -> Vec<String> {
        let s = df.column(c).unwrap().str().unwrap().clone();
        s.into_no_null_iter().map(String::from).collect()
    }

    fn numbers(df: &DataFrame, c: &str) -> Vec<f64> {
        let s = df.column(c).unwrap().f64().unwrap().clone();
        s.into_no_null_iter().collect()
    }

    /// Each rung's probes against the start's on the same task and length: one replicate on
    /// the start's own prompts is paired (exact McNemar, Newcombe's interval), one on other
    /// prompts (as many, but other targets; or unnamed) or on more of them is compared
    /// unpaired, keys the start lacks are left out, and Holm's adjustment covers the rows
    /// whose test could differ.
    #[test]
    fn rungs_are_tested_against_the_start_on_its_prompts() {
        let dir = sweep_dir_with_ladders("ladders-diff");
        let table = |dir: &std::path::Path| {
            let df = differences(&rows(dir).unwrap().rows)
                .unwrap()
                .expect("a table");
            let (text, num) = (|c| texts(&df, c), |c| numbers(&df, c));
            (
                text("test"),
                num("difference"),
                num("ci95_low"),
                num("ci95_high"),
                num("p"),
                num("p_holm"),
                text("verdict_holm"),
                text("start"),
            )
        };
        // Full attention's two rungs at niah_single, 8 tokens (the start's only key): the
        // lower rung on the start's two prompts ([0, 0] against [0, 1]), the top rung on three.
        let (test, d, lo, hi, p, holm_p, verdict, start) = table(&dir);
        assert_eq!(test.len(), 2, "{test:?}");
        assert!(
            test[0].starts_with("paired") && test[1].starts_with("unpaired"),
            "{test:?}"
        );
        assert_eq!(
            (d[0], p[0]),
            (-0.5, 1.0),
            "one discordant prompt: McNemar's p is 1"
        );
        assert_eq!((lo[0], hi[0]), newcombe_paired(0, 0, 1, 1));
        assert!(lo[0] < 0.0 && hi[0] > 0.0);
        assert!((d[1] - (2.0 / 3.0 - 0.5)).abs() < 1e-12, "{}", d[1]);
        // One discordant prompt can give no p below 1: out of Holm's family; the unpaired
        // row is its only member, so Holm leaves its p as it is.
        assert!(holm_p[0].is_nan() && holm_p[1] == p[1], "{holm_p:?} {p:?}");
        assert!(verdict.iter().all(|v| v == "within noise"));
        assert!(start.iter().all(|s| s == "pretrained"));
        // The lower rung's two prompts with other targets, then unnamed: no longer paired.
        let file = dir.join("proberung-0/eval/probe_samples.jsonl");
        let text = std::fs::read_to_string(&file).unwrap();
        std::fs::write(&file, text.replace("niah_single-8-", "other-")).unwrap();
        assert!(table(&dir).0[0].starts_with("unpaired"));
        let unnamed: Vec<String> = text
            .lines()
            .map(|l| {
                let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
                v.as_object_mut().unwrap().remove("target");
                v.to_string()
            })
            .collect();
        std::fs::write(&file, unnamed.join("\n")).unwrap();
        assert!(table(&dir).0[0].starts_with("unpaired"));
    }

    /// `budget_differences.csv` of the ladder fixture with one more probe cell, `id`: the
    /// lower rung's probe cell copied and changed by `edit` (given the grid's cells), its every
    /// prompt of niah_single at 8 and 16 tokens scored 1.
    fn probed_beside_the_lower_rung(
        dir: &std::path::Path,
        id: &str,
        edit: impl FnOnce(&mut crate::sweep::grid::Cell, &[crate::sweep::grid::Cell]),
    ) -> DataFrame {
        let path = dir.join("cells.json");
        let mut cells: Vec<crate::sweep::grid::Cell> =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut probe = cells
            .iter()
            .find(|c| c.id == "proberung-0")
            .unwrap()
            .clone();
        probe.id = id.into();
        probe.index = cells.len();
        edit(&mut probe, &cells);
        cells.push(probe);
        std::fs::write(&path, serde_json::to_string(&cells).unwrap()).unwrap();
        let (from, to) = (dir.join("proberung-0"), dir.join(id));
        std::fs::create_dir_all(to.join("eval")).unwrap();
        for f in ["status.json", "eval/eval.json"] {
            std::fs::copy(from.join(f), to.join(f)).unwrap();
        }
        let lines: Vec<String> = [(8, 1), (8, 2), (16, 1), (16, 2)]
            .iter()
            .map(|&(length, n)| {
                serde_json::json!({ "task": "niah_single", "length": length, "exact_match": 1.0,
                    "depth": 0.5, "sample": n - 1, "target": format!("niah_single-{length}-{n}") })
                .to_string()
            })
            .collect();
        std::fs::write(to.join("eval/probe_samples.jsonl"), lines.join("\n")).unwrap();
        differences(&rows(dir).unwrap().rows)
            .unwrap()
            .expect("a table")
    }

    /// An evaluation with the oracle's gates is tested against the same model with its learned
    /// gates at the same budget, paired over the same prompts, beside the rows against the
    /// start.
    #[test]
    fn other_gates_are_tested_against_the_models_own() {
        let dir = sweep_dir_with_ladders("ladders-oracle");
        // The learned gates' prompts at 8 tokens score 0, 0; the oracle's 1, 1; at 16 both 1, 1.
        let df = probed_beside_the_lower_rung(&dir, "proberungor-0", |oracle, _| {
            oracle
                .settings
                .insert("eval.gates".into(), toml::Value::String("oracle".into()));
        });
        let (text, num) = (|c| texts(&df, c), |c| numbers(&df, c));
        let (line, start, test) = (text("line"), text("start"), text("test"));
        let (d, p, holm_p) = (num("difference"), num("p"), num("p_holm"));
        let lengths: Vec<u64> = df
            .column("probe_length")
            .unwrap()
            .u64()
            .unwrap()
            .into_no_null_iter()
            .collect();
        let gated: Vec<usize> = (0..line.len())
            .filter(|&i| line[i] == "full eval.gates=oracle" && start[i] == "full")
            .collect();
        assert_eq!(gated.len(), 2, "{line:?} {start:?}");
        for &i in &gated {
            assert!(test[i].starts_with("paired"), "{}", test[i]);
            match lengths[i] {
                // Two discordant prompts, both one way: exact McNemar's p is 2 x 0.5^2.
                8 => assert!(
                    d[i] == 1.0 && (p[i] - 0.5).abs() < 1e-12,
                    "{} {}",
                    d[i],
                    p[i]
                ),
                _ => assert!(
                    d[i] == 0.0 && (p[i] - 1.0).abs() < 1e-12,
                    "{} {}",
                    d[i],
                    p[i]
                ),
            }
        }
        // The oracle's rows against the start are there too.
        assert!(line
            .iter()
            .zip(&start)
            .any(|(l, s)| l == "full eval.gates=oracle" && s == "pretrained"));
        // Two discordant prompts can give no p below 0.5: the 8-token row is out of Holm's
        // family, within noise with no adjusted p.
        let eight = *gated.iter().find(|&&i| lengths[i] == 8).unwrap();
        let (min_p, verdict) = (num("min_p"), text("verdict_holm"));
        assert!((min_p[eight] - 0.5).abs() < 1e-12, "{}", min_p[eight]);
        assert!(
            holm_p[eight].is_nan() && verdict[eight] == "within noise",
            "{holm_p:?}"
        );
        assert_eq!(learned_line("aha attention.window=256"), None);
        assert_eq!(
            learned_line("aha attention.window=256 eval.gates=oracle").as_deref(),
            Some("aha attention.window=256")
        );
    }

    /// A trained line of another method is tested against full attention trained on as many
    /// tokens, paired over the prompts they share.
    #[test]
    fn methods_are_tested_against_full_attention_at_their_budget() {
        let dir = sweep_dir_with_ladders("ladders-reference");
        // Full attention's lower rung scores 0, 0 at 8 tokens and 1, 1 at 16; AHA 1, 1 and 1, 1.
        let df = probed_beside_the_lower_rung(&dir, "probeaha-0", |probe, cells| {
            let aha = cells.iter().find(|c| c.id == "aharung-16").unwrap();
            probe.depends_on = Some(aha.id.clone());
            probe.assignment = aha.assignment.clone();
            probe.settings = aha.settings.clone();
            probe.config = aha.config.clone();
        });
        let (text, num) = (|c| texts(&df, c), |c| numbers(&df, c));
        let (line, start, test) = (text("line"), text("start"), text("test"));
        let (d, min_p, holm_p) = (num("difference"), num("min_p"), num("p_holm"));
        let against: Vec<usize> = (0..line.len())
            .filter(|&i| line[i].starts_with("aha ") && start[i] == "full")
            .collect();
        assert_eq!(against.len(), 2, "{line:?} {start:?}");
        for &i in &against {
            assert!(test[i].contains("McNemar"), "{}", test[i]);
            assert!(
                holm_p[i].is_nan(),
                "two prompts cannot differ: {}",
                min_p[i]
            );
        }
        assert!(d[against[0]] == 1.0 && (min_p[against[0]] - 0.5).abs() < 1e-12);
        assert_eq!((d[against[1]], min_p[against[1]]), (0.0, 1.0));
        // Full attention's own rungs have no row against themselves.
        assert!(!(0..line.len()).any(|i| line[i] == "full" && start[i] == "full"));
    }

    /// A control is tested against the line it reads at its budget (Table 5's comparison),
    /// paired over the prompts they share; one that reads full attention has no second row
    /// beside its row against the reference.
    #[test]
    fn controls_are_tested_against_the_line_they_read() {
        let dir = sweep_dir_with_ladders("ladders-reads");
        let path = dir.join("cells.json");
        let reads = |of: &str| {
            let mut cells: Vec<crate::sweep::grid::Cell> =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            for c in cells.iter_mut().filter(|c| c.id == "ctlrung-0") {
                c.reads = Some(of.into());
            }
            std::fs::write(&path, serde_json::to_string(&cells).unwrap()).unwrap();
        };
        reads("aharung-16");
        let probe_of = |train: &'static str| {
            move |probe: &mut crate::sweep::grid::Cell, cells: &[crate::sweep::grid::Cell]| {
                let t = cells.iter().find(|c| c.id == train).unwrap();
                probe.depends_on = Some(t.id.clone());
                probe.assignment = t.assignment.clone();
                probe.settings = t.settings.clone();
                probe.config = t.config.clone();
            }
        };
        probed_beside_the_lower_rung(&dir, "probeaha-0", probe_of("aharung-16"));
        probed_beside_the_lower_rung(&dir, "probectl-0", probe_of("ctlrung-0"));
        // The control misses both prompts at 8 tokens where AHA finds them.
        let samples = dir.join("probectl-0/eval/probe_samples.jsonl");
        let text = std::fs::read_to_string(&samples).unwrap();
        let missed: Vec<String> = text
            .lines()
            .map(|l| match l.contains("\"length\":8") {
                true => l.replace("\"exact_match\":1.0", "\"exact_match\":0.0"),
                false => l.to_string(),
            })
            .collect();
        std::fs::write(&samples, missed.join("\n")).unwrap();
        let against = |df: &DataFrame, start: &str| -> Vec<(u64, f64, String)> {
            let (line, from, test) = (texts(df, "line"), texts(df, "start"), texts(df, "test"));
            let d = numbers(df, "difference");
            let lengths = df.column("probe_length").unwrap().u64().unwrap();
            (0..line.len())
                .filter(|&i| line[i] == "ctl" && from[i].starts_with(start))
                .map(|i| (lengths.get(i).unwrap(), d[i], test[i].clone()))
                .collect()
        };
        let df = differences(&rows(&dir).unwrap().rows).unwrap().unwrap();
        let rows_vs_aha = against(&df, "aha");
        assert_eq!(rows_vs_aha.len(), 2, "{rows_vs_aha:?}");
        for (length, d, test) in &rows_vs_aha {
            assert!(test.contains("McNemar"), "{test}");
            assert_eq!(*d, if *length == 8 { -1.0 } else { 0.0 });
        }
        // A read cell that a second stage shares (its probes that stage's): the control's line
        // is tested against the membership its stage names (`reads_stage`), not the other.
        let mut cells: Vec<crate::sweep::grid::Cell> =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut shared = cells.iter().find(|c| c.id == "aharung-16").unwrap().clone();
        (shared.index, shared.stage, shared.ladder) = (cells.len(), "twin".into(), None);
        cells.push(shared);
        for c in cells.iter_mut().filter(|c| c.id == "probeaha-0") {
            c.depends_on_stage = Some("twin".into());
        }
        let name = |cells: &mut Vec<crate::sweep::grid::Cell>, stage: &str| {
            for c in cells.iter_mut().filter(|c| c.id == "ctlrung-0") {
                c.reads_stage = Some(stage.into());
            }
            std::fs::write(&path, serde_json::to_string(&cells).unwrap()).unwrap();
            differences(&rows(&dir).unwrap().rows).unwrap().unwrap()
        };
        let df = name(&mut cells, "twin");
        assert_eq!(against(&df, "twin").len(), 2);
        assert!(against(&df, "aha").is_empty());
        let df = name(&mut cells, "aharung");
        assert!(against(&df, "twin").is_empty());
        // Reading full attention: its row against the reference, once.
        reads("fullrung-0");
        let df = differences(&rows(&dir).unwrap().rows).unwrap().unwrap();
        assert!(against(&df, "aha").is_empty());
        assert_eq!(against(&df, "full").len(), 2);
    }

    /// Against full attention: each seed's replicate is paired with the reference's on the
    /// same prompts and read by the bootstrap's own p; a seed without a partner sends the row
    /// to the unpaired bootstrap; two full-attention lines at one budget leave no reference.
    #[test]
    fn references_pair_by_seed_and_must_be_one() {
        let set = |seed: u32, scores: &[f64]| Prompts {
            scores: scores.to_vec(),
            ids: (0..scores.len())
                .map(|i| Some(format!("s{seed}-p{i}")))
                .collect(),
            model: format!("m{seed}"),
        };
        let aha = [set(1, &[1.0, 0.0, 1.0]), set(2, &[1.0, 1.0, 0.0])];
        let full = [
            set(2, &[1.0, 1.0, 1.0]),
            set(1, &[1.0, 1.0, 1.0]),
            set(3, &[0.0]),
        ];
        let pairs = same_prompts(&aha, &full);
        assert_eq!(pairs.len(), 2);
        assert!(pairs.iter().all(|(a, b)| a.ids == b.ids));
        let (test, how) = compared_pairs(&pairs, SAME_PROMPTS);
        assert_eq!(how, SAME_PROMPTS);
        assert!(
            (test[0] + 1.0 / 3.0).abs() < 1e-12 && test[4] == BOOTSTRAP_MIN_P,
            "{test:?}"
        );
        assert!(same_prompts(&aha, &full[2..]).is_empty());
        let rung = |line: &str, method: Method, tokens: f64| Rung {
            line: line.into(),
            method,
            tokens,
            replicates: 1,
            trained: true,
            ladder: true,
            eval_seq_len: 8,
            loss: None,
            mu_f: None,
            probes: BTreeMap::new(),
            prompt_sets: [(("niah".to_string(), 8), vec![set(1, &[1.0])])].into(),
            by_position: BTreeMap::new(),
            reads: Vec::new(),
        };
        let key = ("niah".to_string(), 8);
        let one = [
            rung("full", Method::Full, 2.0),
            rung("aha", Method::Aha, 2.0),
        ];
        assert_eq!(
            reference_of(&one, 2.0, &key).map(|r| r.line.as_str()),
            Some("full")
        );
        assert!(reference_of(&one, 3.0, &key).is_none());
        // Two full-attention lines probed on models apart: neither is the reference.
        let mut apart = rung("full w", Method::Full, 2.0);
        apart.prompt_sets = [(key.clone(), vec![set(2, &[1.0])])].into();
        let two = [rung("full", Method::Full, 2.0), apart];
        assert!(reference_of(&two, 2.0, &key).is_none());
        // A line whose models hold the other's (its seeds, the first of them shared) is.
        let mut seeds = rung("full seeds", Method::Full, 2.0);
        seeds.prompt_sets = [(key.clone(), vec![set(1, &[1.0]), set(2, &[0.0])])].into();
        let held = [rung("full", Method::Full, 2.0), seeds];
        assert_eq!(
            reference_of(&held, 2.0, &key).map(|r| r.line.as_str()),
            Some("full seeds")
        );
    }

    /// Holm's family holds the rows whose test could give p below 0.05: a row no outcome can
    /// reject keeps no adjusted p and does not raise the others'.
    #[test]
    fn holm_counts_only_the_rows_that_could_differ() {
        let t = |p: f64, min_p: f64| [0.0, 0.0, 0.0, p, min_p];
        let adjusted =
            holm_within_reach(&[t(0.01, 0.001), t(0.02, 0.001), t(0.5, 0.5), t(1.0, 1.0)]);
        assert_eq!(adjusted[..2], [0.02, 0.02]);
        assert!(adjusted[2].is_nan() && adjusted[3].is_nan());
        // Six discordant prompts all one way are the fewest McNemar can reject on.
        assert!(mcnemar_exact(6, 0) < 0.05 && mcnemar_exact(5, 0) >= 0.05);
        let one = |scores: &[f64]| Prompts {
            scores: scores.to_vec(),
            ids: (0..scores.len()).map(|i| Some(format!("p{i}"))).collect(),
            model: "m".into(),
        };
        let (tied, split) = (one(&[1.0, 0.5]), one(&[0.5, 1.0]));
        assert_eq!(compared(&[tied.clone()], &[tied.clone()]).0[4], 1.0);
        assert_eq!(compared(&[tied.clone()], &[split]).0[4], BOOTSTRAP_MIN_P);
        let zero = Prompts {
            ids: vec![None; 2],
            ..one(&[0.0, 0.0])
        };
        let (unpaired, how) = compared(&[zero.clone()], &[zero]);
        assert!(how.starts_with("unpaired") && unpaired[4] == 1.0, "{how}");
    }

    /// Other gates are read against the same models only: a model the learned side lacks is
    /// left out, one model is McNemar's, several on the same prompts the paired bootstrap.
    #[test]
    fn other_gates_pair_with_the_same_models() {
        let set = |model: &str, scores: &[f64]| Prompts {
            scores: scores.to_vec(),
            ids: (0..scores.len()).map(|i| Some(format!("p{i}"))).collect(),
            model: model.into(),
        };
        let oracle = [set("a", &[1.0, 1.0, 1.0]), set("b", &[1.0, 0.0, 1.0])];
        let learned = [set("b", &[0.0, 0.0, 1.0]), set("c", &[0.0, 0.0, 0.0])];
        let pairs = same_models(&oracle, &learned);
        assert_eq!(pairs.len(), 1);
        assert_eq!(
            (pairs[0].0.model.as_str(), pairs[0].1.model.as_str()),
            ("b", "b")
        );
        let (test, how) = compared_pairs(&pairs, SAME_MODELS);
        assert!(how.contains("McNemar"), "{how}");
        assert!((test[0] - 1.0 / 3.0).abs() < 1e-12);
        let learned = [set("a", &[0.0, 1.0, 1.0]), set("b", &[0.0, 0.0, 1.0])];
        let pairs = same_models(&oracle, &learned);
        let (test, how) = compared_pairs(&pairs, SAME_MODELS);
        assert_eq!(how, SAME_MODELS);
        // Two discordant prompts of six over the two models, both one way: the bootstrap's own
        // p (not McNemar's over every pair, 0.5, which would take the models for prompts), its
        // floor the bootstrap's resolution.
        assert!(
            test[4] == BOOTSTRAP_MIN_P && test[3] > 0.05 && test[3] != 0.5,
            "{test:?}"
        );
        assert!((test[0] - 1.0 / 3.0).abs() < 1e-12, "{}", test[0]);
        assert!(same_models(&oracle, &[set("c", &[0.0])]).is_empty());
    }

    /// Replicates pool as the mean of their means, the interval from seeds and prompts
    /// inside [0, 1]; a replicate's fractional scores are bootstrapped, not given Wilson's.
    #[test]
    fn pooled_replicates_stay_inside_the_range() {
        let e = Estimate::pooled(&[vec![1.0, 1.0, 0.0, 1.0], vec![0.0, 1.0]]).unwrap();
        assert_eq!(e.mean, (0.75 + 0.5) / 2.0);
        assert!(0.0 <= e.low && e.low <= e.mean && e.mean <= e.high && e.high <= 1.0);
        let f = Estimate::pooled(&[vec![0.5, 0.25]]).unwrap();
        assert!(f.low >= 0.25 && f.high <= 0.5, "{f:?}");
        assert!(Estimate::pooled(&[vec![]]).is_none());
    }

    /// A cell that several stages share (one id, run once) is a replicate of each: the first
    /// stage's row names the others (`Row::also`), the replicate tables count it in every
    /// stage (read from the cells, and from `tidy.csv` alone), and an evaluation of it listed
    /// in a later stage joins that stage's line through the membership it depends on.
    #[test]
    fn a_shared_cell_counts_in_every_stage_that_lists_it() {
        use crate::sweep::Cell;
        let dir = sweep_dir_with_ladders("shared");
        let path = dir.join("cells.json");
        let mut cells: Vec<Cell> =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let member = |cells: &[Cell], id: &str, stage: &str, seed: i64, of: Option<&str>| {
            let mut c = cells.iter().find(|c| c.id == id).unwrap().clone();
            c.index = cells.len();
            c.stage = stage.into();
            c.assignment = [("train.seed".to_string(), toml::Value::from(seed))].into();
            c.depends_on_stage = of.map(String::from);
            c.ladder = None;
            c
        };
        for (id, stage, seed, of) in [
            ("full-0", "regime", 1, None),
            ("fullrung-0", "regime", 2, None),
            ("probefull-0", "proberegime", 1, Some("regime")),
            ("fullrung-0", "onebudget", 1, None),
        ] {
            let c = member(&cells, id, stage, seed, of);
            cells.push(c);
        }
        std::fs::write(&path, serde_json::to_string(&cells).unwrap()).unwrap();

        let all = rows(&dir).unwrap().rows;
        let row = |id: &str| all.iter().find(|r| r.cell == id).unwrap();
        assert_eq!(all.iter().filter(|r| r.cell == "full-0").count(), 1);
        let also: Vec<(&str, &str)> = row("full-0")
            .also
            .iter()
            .map(|m| (m.stage.as_str(), m.line.as_str()))
            .collect();
        assert_eq!(also, [("regime", "regime")]);
        let rung_also: Vec<(&str, bool)> = row("fullrung-0")
            .also
            .iter()
            .map(|m| (m.stage.as_str(), m.rung))
            .collect();
        assert_eq!(rung_also, [("regime", false), ("onebudget", false)]);
        assert_eq!(row("probefull-0").also[0].line, "regime");
        assert_eq!(row("probefull-0").line, "full");
        let every = rungs(&all);
        let regime: Vec<&Rung> = every.iter().filter(|r| r.line == "regime").collect();
        assert_eq!(regime.len(), 2, "{every:#?}");
        let top = regime[1];
        assert_eq!(top.loss.unwrap().mean, 1.8);
        assert_eq!(
            top.probes[&("niah_single".to_string(), 8)].score.mean,
            2.0 / 3.0
        );
        // A lower rung listed again by a stage of one budget makes no ladder of that stage:
        // the rung flag is its own stage's.
        let one = every.iter().find(|r| r.line == "onebudget").unwrap();
        assert!(!one.ladder, "{one:?}");
        // Full attention's own line keeps the cell.
        assert!(every
            .iter()
            .any(|r| r.line == "full" && r.loss.is_some_and(|l| l.mean == 1.8)));
        // The figures draw the regime once with both its cells, and no point of its one
        // shared cell beside it (`by_setting`).
        let settings = crate::sweep::pareto::by_setting(&all);
        let holding = |id: &str| -> Vec<Vec<String>> {
            let cells = |g: &Vec<&Row>| g.iter().map(|r| r.cell.clone()).collect();
            let has = |g: &&(&Row, Vec<&Row>)| g.1.iter().any(|r| r.cell == id);
            settings.iter().filter(has).map(|(_, g)| cells(g)).collect()
        };
        assert_eq!(holding("full-0"), [["full-0", "fullrung-0"]]);
        assert_eq!(holding("fullrung-0"), [["full-0", "fullrung-0"]]);

        let out = dir.join("out");
        std::fs::create_dir_all(&out).unwrap();
        crate::sweep::tables::write_all(&dir, &out, false).unwrap();
        let regime_loss = |table: &[Vec<String>]| -> Vec<String> {
            table
                .iter()
                .find(|r| r[0] == "regime" && r[1] == "loss")
                .cloned()
                .unwrap_or_else(|| panic!("{table:?}"))
        };
        let replicates = csv(&out.join("replicates.csv"));
        let row = regime_loss(&replicates);
        assert_eq!((row[4].as_str(), row[5].as_str()), ("2", "1.875"));
        // The regime shares full-0 with full attention's own stage: not two samples, so that
        // pair is not tested, while the regime against a stage apart from it is.
        let across = csv(&out.join("stage_differences.csv"));
        let pair = |a: &str, b: &str| {
            across
                .iter()
                .any(|r| (r[1] == a && r[3] == b) || (r[1] == b && r[3] == a))
        };
        assert!(
            !pair("full", "regime") && pair("swa", "regime"),
            "{across:?}"
        );
        // From tidy.csv and cells.json alone (a results folder without its cells).
        let bare = dir.join("bare");
        std::fs::create_dir_all(&bare).unwrap();
        std::fs::copy(&path, bare.join("cells.json")).unwrap();
        std::fs::copy(out.join("tidy.csv"), bare.join("tidy.csv")).unwrap();
        crate::sweep::tables::write_all(&bare, &bare, false).unwrap();
        let row = regime_loss(&csv(&bare.join("replicates.csv")));
        assert_eq!((row[4].as_str(), row[5].as_str()), ("2", "1.875"));
    }
}
