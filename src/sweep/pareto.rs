//! The comparison no single paper makes: every method continued from one base for one token
//! budget, read on four costs at once (attention work counted, training time measured,
//! decode memory, prefill time measured with the model alone on the GPU), each with the Pareto fronts of validation loss and of long-context
//! accuracy against it. `pareto.csv` and the `pareto*` figures are drawn from the same rows
//! and fronts defined here.

use super::rows::{setting_text_of, Row};
use crate::config::{name_of, AttentionConfig, Router};
use crate::model::attention::{spec, Gates};
use crate::run::report::{PrecisionRecall, Timing};
use crate::sweep::StageKind;
use crate::util::stats::below;
use anyhow::Result;
use polars::prelude::*;
use std::collections::BTreeMap;

/// A cost the methods are compared on; lower is cheaper.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cost {
    /// Attended (query, key) pairs over full causal attention's, as executed.
    Work,
    /// Seconds of training per million tokens, measured (the training that made the model),
    /// where that training had its device to itself.
    TrainTime,
    /// Key-value cache bytes one sequence of the evaluated length holds when decoding.
    DecodeMemory,
    /// Milliseconds to prefill one sequence of the evaluated length into the key-value
    /// cache, timed by an evaluation with nothing else on the GPU (an `exclusive` stage's).
    Prefill,
}

impl Cost {
    pub(crate) const ALL: [Cost; 4] = [
        Cost::Work,
        Cost::TrainTime,
        Cost::DecodeMemory,
        Cost::Prefill,
    ];

    pub(crate) fn of(self, r: &Row) -> Option<f64> {
        let v = match self {
            Cost::Work => r.pairs_vs_full(),
            // A rate measured while another cell shared the device is no cell's own.
            Cost::TrainTime => 1e6 / r.train_tokens_per_s.filter(|_| r.train_alone)?,
            Cost::DecodeMemory => r.report.kv_cache_bytes_total / 1e6,
            // One sequence, as timed alone: a batch's time is not comparable with it.
            Cost::Prefill => {
                let t = r
                    .report
                    .timing
                    .as_ref()
                    .filter(|t| r.exclusive && t.batch == 1)?;
                t.prefill_ms
            }
        };
        v.is_finite().then_some(v)
    }

    pub(crate) fn axis(self) -> &'static str {
        match self {
            Cost::Work => "attended pairs / full causal",
            Cost::TrainTime => "training seconds per million tokens (measured)",
            Cost::DecodeMemory => "KV cache per sequence, MB",
            Cost::Prefill => "prefill of one sequence, ms (the model alone on the GPU)",
        }
    }

    /// The column of `pareto.csv` marking the front on this cost, and the figure's stem.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Cost::Work => "work",
            Cost::TrainTime => "time",
            Cost::DecodeMemory => "memory",
            Cost::Prefill => "prefill",
        }
    }
}

/// The rows one comparison holds: the largest group of cells of one model and data with one
/// total training budget (a base's continuations, re-evaluations and prunings of them), so
/// that no method is ahead for having trained longer, evaluated at one length. The base
/// itself, trained for less, anything evaluated from it (SWA zero-shot) and evaluations at
/// another length fall outside. An evaluation of a cell's model with the same attention (one
/// that only adds probes or times it alone on the GPU) is a second measurement of that model,
/// not a model of its own: its task metrics join the cell's row, and its timing replaces the
/// cell's where it ran alone at the cell's length.
pub(crate) fn comparable(rows: &[Row]) -> Vec<Row> {
    let mut kept: Vec<Row> = group(rows).into_iter().cloned().collect();
    let mut i = 0;
    while i < kept.len() {
        let r = &kept[i];
        let same_model = kept.iter().position(|s| {
            r.kind == StageKind::Eval && s.cell == r.source && s.attention == r.attention
        });
        match same_model {
            Some(j) => {
                let extra = kept.remove(i);
                let j = if j > i { j - 1 } else { j };
                for (k, v) in extra.tasks {
                    kept[j].tasks.entry(k).or_insert(v);
                }
                if extra.exclusive && extra.report.timing.is_some() {
                    kept[j].report.timing = extra.report.timing;
                    kept[j].exclusive = true;
                }
            }
            None => i += 1,
        }
    }
    kept
}

fn group(rows: &[Row]) -> Vec<&Row> {
    let key = |r: &Row| {
        (
            r.model_key.clone(),
            r.budget_tokens.to_bits(),
            r.report.seq_len,
        )
    };
    let mut groups: BTreeMap<(String, u64, usize), usize> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.budget_tokens.is_finite()) {
        *groups.entry(key(r)).or_default() += 1;
    }
    let Some(best) = groups
        .iter()
        .max_by_key(|(k, n)| (**n, k.1))
        .map(|(k, _)| k.clone())
    else {
        return Vec::new();
    };
    rows.iter()
        .filter(|r| key(r) == best && r.loss().is_finite())
        .collect()
}

/// `rows` by setting (a stage's cells that differ only in their seed), in the order each first
/// appears: a cell of the setting's own stage, which names it, and its cells. A cell that
/// several stages share counts in each (`Row::also`), and a setting whose cells all count in
/// another with more (a lambda's first seed that is also the regime's first), or in an earlier
/// one with as many, is drawn once, as that one: not as a point of one replicate beside the
/// mean of all. Settings that share only some cells are both kept.
pub(crate) fn by_setting<'a>(
    rows: impl IntoIterator<Item = &'a Row>,
) -> Vec<(&'a Row, Vec<&'a Row>)> {
    let mut groups: Vec<(&str, String, Vec<&Row>)> = Vec::new();
    for r in rows {
        let places = std::iter::once((r.stage.as_str(), r.setting_text()));
        let others = r
            .also
            .iter()
            .map(|m| (m.stage.as_str(), setting_text_of(&m.varied)));
        for (stage, setting) in places.chain(others) {
            match groups
                .iter_mut()
                .find(|(g, s, _)| *g == stage && *s == setting)
            {
                Some((_, _, rs)) => rs.push(r),
                None => groups.push((stage, setting, vec![r])),
            }
        }
    }
    let within = |g: &[&Row], h: &[&Row]| g.iter().all(|r| h.iter().any(|x| x.cell == r.cell));
    let kept: Vec<bool> = groups
        .iter()
        .enumerate()
        .map(|(i, (_, _, g))| {
            !groups.iter().enumerate().any(|(j, (_, _, h))| {
                j != i && within(g, h) && (h.len() > g.len() || (h.len() == g.len() && j < i))
            })
        })
        .collect();
    // Each named by a cell whose own stage is the group's where it has one (not a shared
    // cell's first stage), so that what reads the setting's stage reads the right one.
    groups
        .into_iter()
        .zip(kept)
        .filter(|(_, k)| *k)
        .map(|((stage, _, g), _)| (*g.iter().find(|r| r.stage == stage).unwrap_or(&g[0]), g))
        .collect()
}

/// For each (cost, loss) point, whether no other point is at least as good on both and better
/// on one. Points with a missing or non-finite value are never on the front. Values apart only
/// by rounding are equal (`stats::below`): such a tie dominates nothing.
pub(crate) fn on_front(points: &[Option<(f64, f64)>]) -> Vec<bool> {
    let ok = |p: &Option<(f64, f64)>| p.filter(|(x, y)| x.is_finite() && y.is_finite());
    points
        .iter()
        .map(|p| {
            let Some((x, y)) = ok(p) else { return false };
            !points
                .iter()
                .filter_map(ok)
                .any(|(a, b)| !below(x, a) && !below(y, b) && (below(a, x) || below(b, y)))
        })
        .collect()
}

/// A method as a reader names it (`MethodSpec::label`); Bernoulli gates are a method of their
/// own (the routed method's paths, gates drawn at random).
pub(crate) fn family(r: &Row) -> String {
    let name = spec(r.method).label;
    match r.router == Router::Bernoulli && spec(r.method).gates != Gates::None {
        true => format!("{name} with Bernoulli gates"),
        false => name.into(),
    }
}

/// What sets a cell apart within its family: its window and the method's own settings
/// (`MethodSpec::describe`), or the usage its Bernoulli gates were drawn at.
pub(crate) fn settings(r: &Row) -> String {
    let method = spec(r.method);
    let w = format!("w{}", r.window);
    let mut parts: Vec<String> = match (method.windowed, r.router) {
        (false, _) => vec![],
        (true, Router::Bernoulli) => vec![w, format!("p {:.3}", r.bernoulli_p)],
        (true, Router::Learned) => {
            [vec![w], (method.describe)(&r.attention, r.heads, r.mu_f())].concat()
        }
    };
    if method.zero_shot && r.kind == StageKind::Eval {
        parts.push("zero-shot".into());
    }
    if let Some(p) = &r.prune {
        parts.push(format!("pruned at {}", p.threshold));
    }
    parts.join(" ")
}

/// Mean exact match over the long-context probe tasks the cell was evaluated on.
pub(crate) fn probe_exact_match(r: &Row) -> Option<f64> {
    let v: Vec<f64> = r
        .tasks
        .iter()
        .filter(|(k, _)| k.ends_with(".exact_match"))
        .map(|(_, v)| *v)
        .collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// The distance from which the synthetic corpus's answers count as long-range in one
/// comparison: its shortest window, so every cell is scored on the same answers (a cell's own
/// `far` starts at its own window, which would score a wider window on fewer, harder ones).
pub(crate) fn reach<'a>(rows: impl IntoIterator<Item = &'a Row>) -> f64 {
    rows.into_iter()
        .filter(|r| spec(r.method).windowed)
        .map(|r| r.window)
        .fold(f64::INFINITY, f64::min)
        .min(AttentionConfig::default().window as f64)
}

/// Long-context quality and its name: the probes' mean exact match where the cell ran them,
/// else the synthetic corpus's exact-match accuracy on answers at least `reach` back.
pub(crate) fn accuracy(r: &Row, reach: f64) -> Option<(f64, String)> {
    match probe_exact_match(r) {
        Some(v) => Some((v, "probe exact match".into())),
        None => r
            .beyond(reach)
            .and_then(|f| f.1)
            .map(|v| (v, format!("accuracy on answers {reach} or more back"))),
    }
}

/// `pareto.csv`: one row per comparable cell with every cost and quality measured, and for
/// each cost whether the cell is on the loss front; None when there is nothing to compare.
pub(crate) fn table(rows: &[Row]) -> Result<Option<DataFrame>> {
    let rows = comparable(rows);
    let mut rows: Vec<&Row> = rows.iter().collect();
    if rows.len() < 2 {
        return Ok(None);
    }
    rows.sort_by(|a, b| {
        a.pairs_vs_full()
            .total_cmp(&b.pairs_vs_full())
            .then(a.loss().total_cmp(&b.loss()))
    });
    let full = rows
        .iter()
        .find(|r| r.is_reference() && r.kind == StageKind::Train);
    let reach = reach(rows.iter().copied());
    let s = |f: &dyn Fn(&Row) -> String| rows.iter().map(|r| f(r)).collect::<Vec<_>>();
    let o = |f: &dyn Fn(&Row) -> Option<f64>| rows.iter().map(|r| f(r)).collect::<Vec<_>>();
    let timing = |f: fn(&Timing) -> f64| o(&|r| r.report.timing.as_ref().map(f));
    let need = |f: fn(&PrecisionRecall) -> Option<f64>| {
        o(&|r| {
            r.gates()
                .and_then(|g| g.need.as_ref())
                .and_then(|n| f(&n.all_gates))
        })
    };
    let mut df = df!(
        "name" => s(&|r| format!("{} {}", family(r), settings(r)).trim().to_string()),
        "family" => s(&family),
        "kind" => s(&|r| name_of(r.kind)),
        "window" => o(&|r| spec(r.method).windowed.then_some(r.window)),
        "loss" => o(&|r| Some(r.loss())),
        "perplexity" => o(&|r| Some(r.report.perplexity)),
        "retain_pct" => o(&|r| full.map(|f| 100.0 * f.report.perplexity / r.report.perplexity)),
        "probe_exact_match" => o(&probe_exact_match),
        "far_accuracy" => o(&|r| r.beyond(reach).and_then(|f| f.1)),
        "far_from" => o(&|r| r.beyond(reach).map(|_| reach)),
        "pairs_vs_full" => o(&|r| Some(r.pairs_vs_full())),
        "attention_flops_per_token" => o(&|r| {
            Some(r.report.attention.flops / r.report.tokens.max(1) as f64)
        }),
        "train_tokens_per_s" => o(&|r| r.train_tokens_per_s),
        "train_s_per_mtok" => o(&|r| Cost::TrainTime.of(r)),
        "forward_ms" => timing(|t| t.forward_ms),
        "attention_ms" => timing(|t| t.attention_ms),
        "prefill_ms" => timing(|t| t.prefill_ms),
        "decode_tokens_per_s" => timing(|t| t.decode_tokens_per_s),
        "kv_cache_mb" => o(&|r| Cost::DecodeMemory.of(r)),
        "decode_cache_mb" => timing(|t| t.decode_cache_bytes / 1e6),
        // Whether the timings above were taken with the model alone on the GPU.
        "timed_alone" => rows.iter().map(|r| r.exclusive).collect::<Vec<bool>>(),
        "mu_f" => o(&|r| r.mu_f()),
        "gate_precision" => need(|p| p.precision),
        "gate_recall" => need(|p| p.recall),
    )?;
    // Fronts of loss (lower is better) and of long-context accuracy (higher is better).
    for cost in Cost::ALL {
        let points: Vec<Option<(f64, f64)>> = rows
            .iter()
            .map(|r| cost.of(r).map(|x| (x, r.loss())))
            .collect();
        df.with_column(Column::new(
            format!("front_{}", cost.name()).into(),
            on_front(&points),
        ))?;
        if rows.iter().any(|r| accuracy(r, reach).is_some()) {
            let points: Vec<Option<(f64, f64)>> = rows
                .iter()
                .map(|r| Some((cost.of(r)?, -accuracy(r, reach)?.0)))
                .collect();
            df.with_column(Column::new(
                format!("accuracy_front_{}", cost.name()).into(),
                on_front(&points),
            ))?;
        }
    }
    df.with_column(Column::new(
        "cell".into(),
        rows.iter().map(|r| r.cell.clone()).collect::<Vec<_>>(),
    ))?;
    Ok(Some(df))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sweep::fixture;
    use crate::sweep::rows::{rows, Membership};

    /// A setting's cells count in each stage that lists them: two stages of the same cells
    /// are drawn once (the earlier), one within a larger is drawn as the larger, and two that
    /// share only some cells are both kept, each with all of its own.
    #[test]
    fn settings_share_cells_by_membership() {
        let base = rows(&fixture::sweep_dir("by-setting")).unwrap().rows[0].clone();
        let cell = |id: &str, stage: &str, seed: &str, also: &[&str]| {
            let mut r = base.clone();
            r.cell = id.into();
            r.stage = stage.into();
            r.varied = vec![("train.seed".into(), seed.into())];
            r.also = also
                .iter()
                .map(|s| Membership {
                    stage: s.to_string(),
                    varied: r.varied.clone(),
                    line: s.to_string(),
                    rung: false,
                })
                .collect();
            r
        };
        let grouping = |rows: &[Row]| -> Vec<(String, Vec<String>)> {
            by_setting(rows)
                .into_iter()
                .map(|(named, g)| {
                    (
                        named.stage.clone(),
                        g.iter().map(|r| r.cell.clone()).collect(),
                    )
                })
                .collect()
        };
        let equal = [cell("a", "x", "1", &["y"]), cell("b", "x", "2", &["y"])];
        assert_eq!(
            grouping(&equal),
            [("x".into(), vec!["a".into(), "b".into()])]
        );
        let within = [
            cell("a", "x", "1", &["y"]),
            cell("b", "y", "2", &[]),
            cell("c", "y", "3", &[]),
        ];
        let whole = vec!["a".to_string(), "b".into(), "c".into()];
        assert_eq!(grouping(&within), [("y".to_string(), whole)]);
        let partial = [
            cell("a", "x", "1", &[]),
            cell("b", "x", "2", &["y"]),
            cell("c", "y", "3", &[]),
        ];
        assert_eq!(
            grouping(&partial),
            [
                ("x".to_string(), vec!["a".to_string(), "b".into()]),
                ("y".to_string(), vec!["b".to_string(), "c".into()]),
            ]
        );
    }

    #[test]
    fn front_keeps_only_undominated_points() {
        let pts = [
            Some((0.2, 3.0)),
            Some((0.5, 2.0)),
            Some((0.5, 2.5)), // worse than (0.5, 2.0) at the same cost
            Some((0.8, 2.2)), // costs more and is worse than (0.5, 2.0)
            Some((1.0, 1.9)),
            None,
            Some((f64::NAN, 1.0)),
            Some((0.2, 3.0)), // a tie dominates neither copy
        ];
        assert_eq!(
            on_front(&pts),
            [true, true, false, false, true, false, false, true]
        );
        // A score apart only by rounding is the same score: the point paying more for it is
        // off the front, and the two tied points both stay on it.
        let rounded = [Some((0.98, -0.4075)), Some((1.0, -0.40750000000000003))];
        assert_eq!(on_front(&rounded), [true, false]);
        let tied = [Some((0.5, 1.0)), Some((0.5, 1.0 + 1e-15))];
        assert_eq!(on_front(&tied), [true, true]);
    }
}
