//! The budget ladder (`budget::rungs`, its ladders' rungs): validation loss, the share of
//! full attention and the probes' exact match at each prompt length, each against the
//! training tokens behind the model, a line per set-up, with the pretrained model and each method's paper usage
//! (`Report::PaperUsage`) as reference lines.

use super::series::{reference_look, with_line};
use crate::model::attention::{spec, Report};
use crate::sweep::budget::{self, Estimate, Rung, ALL_TASKS};
use crate::sweep::figure::{series, short_count, sorted, Figure, Panel, Series, XAxis};
use crate::sweep::rows::Row;
use std::collections::{BTreeMap, BTreeSet};

/// The figure `budget_ladder`, where some line of the sweep has two budgets or more.
pub(super) fn budget_ladder(all: &[Row], figs: &mut Vec<(String, Figure)>) {
    let rungs = ladders(all);
    let trained: Vec<&Rung> = rungs.iter().filter(|r| r.trained).collect();
    let Some(seq_len) = trained.first().map(|r| r.eval_seq_len) else {
        return;
    };
    let base: Vec<&Rung> = rungs.iter().filter(|r| r.tokens == 0.0).collect();
    let tokens = "training tokens";
    let mut panels = Vec::new();
    // Loss, where the lines' own evaluations measured it (their length).
    let base_loss = base_at(&base, seq_len).and_then(|r| r.loss).map(|e| e.mean);
    panels.push(Panel {
        title: format!("validation loss at {seq_len} tokens"),
        x: tokens.into(),
        y: "loss (nats/token)".into(),
        series: with_line(
            lines(&trained, |r| r.loss),
            "pretrained, before training",
            base_loss,
            6,
        ),
        x_axis: XAxis::LogCounts,
    });
    // Usage of the routed lines, beside what each method's paper reports.
    let routed: Vec<&Rung> = trained
        .iter()
        .copied()
        .filter(|r| r.mu_f.is_some())
        .collect();
    if !routed.is_empty() {
        let mut usage = lines(&routed, |r| r.mu_f);
        let mut methods = Vec::new();
        for r in &routed {
            if !methods.contains(&r.method) {
                methods.push(r.method);
            }
        }
        for (i, m) in methods.into_iter().enumerate() {
            for report in spec(m).reports {
                if let Report::PaperUsage { mu_f, source } = report {
                    usage = with_line(usage, source, Some(*mu_f), [12, 9][i % 2]);
                }
            }
        }
        panels.push(Panel {
            title: "share of full attention".into(),
            x: tokens.into(),
            y: "mu_f".into(),
            series: usage,
            x_axis: XAxis::LogCounts,
        });
    }
    // The probes at each prompt length, every line probed at two budgets or more.
    let lengths: BTreeSet<u64> = rungs
        .iter()
        .flat_map(|r| r.probes.keys().map(|k| k.1))
        .collect();
    for len in lengths {
        let key = (ALL_TASKS.to_string(), len);
        let at = |r: &Rung| r.probes.get(&key).map(|p| p.score);
        let probed: Vec<&Rung> = rungs
            .iter()
            .filter(|r| r.tokens > 0.0 && at(r).is_some())
            .collect();
        let base_at = base.iter().find_map(|r| at(r)).map(|e| e.mean);
        panels.push(Panel {
            title: format!("probes at {len} tokens, every task"),
            x: tokens.into(),
            y: "exact match".into(),
            series: with_line(
                lines(&probed, at),
                "pretrained, before training",
                base_at,
                6,
            ),
            x_axis: XAxis::LogCounts,
        });
    }
    figs.push((
        "budget_ladder".into(),
        Figure::Panels {
            title: "Each set-up against its training budget (means of replicates, 95 % intervals)"
                .into(),
            panels,
        },
    ));
}

/// The pretrained model's rung measured on `seq_len`-token sequences: its evaluation without
/// probes (the loss of the most tokens), else any.
fn base_at<'a>(base: &[&'a Rung], seq_len: usize) -> Option<&'a Rung> {
    let at = |r: &&&Rung| r.eval_seq_len == seq_len;
    base.iter()
        .filter(at)
        .find(|r| r.probes.is_empty())
        .or_else(|| base.iter().find(at))
        .copied()
}

/// The figure `budget_positions`, where a ladder's evaluations split their loss by position:
/// a panel per training budget, the loss in each bucket of positions (drawn at the bucket's
/// end) of every set-up at that budget, the pretrained model's beside them.
pub(super) fn budget_positions(all: &[Row], figs: &mut Vec<(String, Figure)>) {
    let rungs = ladders(all);
    let Some(seq_len) = rungs.iter().find(|r| r.trained).map(|r| r.eval_seq_len) else {
        return;
    };
    // Rungs measured on the trained lines' sequences, each by position.
    let split: Vec<&Rung> = rungs
        .iter()
        .filter(|r| r.eval_seq_len == seq_len && !r.by_position.is_empty())
        .collect();
    let curve = |r: &Rung, name: String| {
        let points: Vec<(f64, Estimate)> = r
            .by_position
            .iter()
            .map(|(&(_, to), e)| (to as f64, *e))
            .collect();
        with_intervals(name, &points)
    };
    let pretrained: Vec<&Rung> = split.iter().copied().filter(|r| r.tokens == 0.0).collect();
    let base: Option<Series> = base_at(&pretrained, seq_len).map(|r| {
        let mut s = curve(r, "pretrained, before training".into());
        s.look = reference_look(6);
        s
    });
    let budgets: BTreeSet<u64> = split
        .iter()
        .filter(|r| r.tokens > 0.0)
        .map(|r| r.tokens.to_bits())
        .collect();
    let panels: Vec<Panel> = budgets
        .into_iter()
        .map(|bits| {
            let tokens = f64::from_bits(bits);
            let mut lines: Vec<Series> = split
                .iter()
                .filter(|r| r.tokens == tokens)
                .map(|r| curve(r, r.line.clone()))
                .collect();
            lines = sorted(lines);
            lines.extend(base.clone());
            Panel {
                title: format!("after {} training tokens", short_count(tokens)),
                x: "positions up to".into(),
                y: "loss (nats/token)".into(),
                series: lines,
                x_axis: XAxis::LogSwept,
            }
        })
        .collect();
    if panels.is_empty() {
        return;
    }
    figs.push((
        "budget_positions".into(),
        Figure::Panels {
            title: format!(
                "Loss by position in {seq_len}-token sequences at each budget (means of \
                 replicates, 95 % intervals)"
            ),
            panels,
        },
    ));
}

/// A series per line of `rungs` through its rungs' `value`, with its intervals.
fn lines(rungs: &[&Rung], value: impl Fn(&Rung) -> Option<Estimate>) -> Vec<Series> {
    let mut by_line: BTreeMap<&str, Vec<(f64, Estimate)>> = BTreeMap::new();
    for r in rungs {
        if let Some(e) = value(r) {
            by_line.entry(&r.line).or_default().push((r.tokens, e));
        }
    }
    sorted(
        by_line
            .into_iter()
            .map(|(name, mut points)| {
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                with_intervals(name.to_string(), &points)
            })
            .collect(),
    )
}

/// The rungs of the ladders, their evaluations and the start: a line at one budget alone
/// (a control) is a point with nothing to join, read in `budget.csv`.
fn ladders(all: &[Row]) -> Vec<Rung> {
    budget::rungs(all)
        .into_iter()
        .filter(|r| r.ladder)
        .collect()
}

/// A line through the means of `points`, each with its interval.
fn with_intervals(name: String, points: &[(f64, Estimate)]) -> Series {
    let mut s = series(
        name,
        points.iter().map(|(x, e)| (*x, e.mean)).collect(),
        true,
    );
    s.errors = points.iter().map(|(_, e)| (e.low, e.high)).collect();
    s
}
