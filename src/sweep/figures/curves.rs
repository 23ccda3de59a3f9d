//! Curves over training, dependency distance, context length and a method's own setting:
//! validation loss while training (PPA Fig. 2), loss by dependency distance, inference time
//! against length (L2A Figs. 14-15), and quality against a setting (`Report::Curve`: PPA Fig.
//! 3 and Table 1).

use super::series::{
    full_reference, grouped, legend, legend_name, replicate_means, setting_legend, with_line,
    with_reference, UNIT,
};
use crate::model::attention::{MethodSpec, Report, SettingCurve};
use crate::run::report::Timing;
use crate::sweep::figure::{series, short_count, sorted, Figure, Panel, Series, XAxis};
use crate::sweep::pareto;
use crate::sweep::rows::Row;
use crate::sweep::tables;
use crate::util::stats::summarize;
use std::collections::BTreeSet;

/// Validation loss during training (PPA Fig. 2), continuations on their own axes too.
pub(super) fn loss_curves(train: &[&Row], figs: &mut Vec<(String, Figure)>) {
    let curves: Vec<(bool, String, Vec<(f64, f64)>)> = train
        .iter()
        .filter_map(|r| {
            let log = r.val_log.as_ref()?.select(&["step", "val_loss"])?;
            // At the tokens behind the model, so a continuation starts where its source ended.
            let at = |step: f64| (r.start_tokens + step * r.tokens_per_step) / 1e6;
            let pts: Vec<(f64, f64)> = log.iter().map(|x| (at(x[0]), x[1])).collect();
            let name = setting_legend(r);
            (pts.len() > 1).then_some((r.start_tokens > 0.0, name, pts))
        })
        .collect();
    let continued_names: BTreeSet<String> =
        curves.iter().filter(|c| c.0).map(|c| c.1.clone()).collect();
    let curves: Vec<(bool, Series)> =
        replicate_means(curves.into_iter().map(|c| (c.1, c.2)).collect())
            .into_iter()
            .map(|s| (continued_names.contains(&s.name), s))
            .collect();
    if curves.is_empty() {
        return;
    }
    let x = "training tokens (millions, with those of the cell continued from)";
    let title = "Validation loss during training";
    let continued: Vec<String> = curves
        .iter()
        .filter(|c| c.0)
        .map(|c| c.1.name.clone())
        .collect();
    let all = sorted(curves.into_iter().map(|c| c.1).collect());
    let fig = if continued.is_empty() || continued.len() == all.len() {
        Figure::Lines {
            title: title.into(),
            x: x.into(),
            y: "validation loss".into(),
            series: all,
            x_axis: XAxis::Linear,
        }
    } else {
        // The continuations on their own axes too (PPA Fig. 2: the curves ordered by p),
        // where beside the base's descent they would be a knot. The cells from scratch stay
        // in that panel without points, so each cell keeps its colour and marker.
        let zoomed = all
            .iter()
            .map(|s| {
                let keep = continued.contains(&s.name);
                series(
                    s.name.clone(),
                    if keep { s.points.clone() } else { vec![] },
                    true,
                )
            })
            .collect();
        let panel = |title: &str, series| Panel {
            title: title.into(),
            x: x.into(),
            y: "validation loss".into(),
            series,
            x_axis: XAxis::Linear,
        };
        Figure::Panels {
            title: title.into(),
            panels: vec![panel("every cell", all), panel("continuations", zoomed)],
        }
    };
    figs.push(("loss_curves".into(), fig));
}

/// Loss by dependency distance on the synthetic corpus, every evaluated cell.
pub(super) fn bucket_loss(all: &[Row], figs: &mut Vec<(String, Figure)>) {
    let buckets: Vec<&Row> = all
        .iter()
        .filter(|r| r.kind != crate::sweep::grid::StageKind::Prune && r.report.buckets.len() > 1)
        .collect();
    if buckets.is_empty() {
        return;
    }
    // Recall buckets only: distances 1 (local), 2-3, 4-7, ... at their smallest distance.
    let recall = |r: &Row| -> Vec<(f64, f64)> {
        r.report
            .buckets
            .iter()
            .filter(|b| b.min_distance >= 1 && b.min_distance < u32::MAX && b.tokens > 0)
            .map(|b| (b.min_distance as f64, b.loss))
            .collect()
    };
    figs.push((
        "bucket_loss".into(),
        Figure::Lines {
            title: "Loss by dependency distance (synthetic corpus)".into(),
            x: "dependency distance (bucket's smallest: 1, 2-3, 4-7, ...)".into(),
            y: "validation loss on the bucket's tokens".into(),
            series: sorted(
                buckets
                    .iter()
                    .map(|r| series(legend_name(r), recall(r), true))
                    .filter(|s| !s.points.is_empty())
                    .collect(),
            ),
            x_axis: XAxis::LogSwept,
        },
    ));
}

/// L2A Figs. 14-15: forward and prefill time and decoding speed against length, one line per
/// setting, from the cells that ran alone on the GPU (`timing.csv`).
pub(super) fn prefill_time(all: &[Row], figs: &mut Vec<(String, Figure)>) {
    let timed = tables::timed_alone(all);
    // Against length means at two lengths or more (one length is `pareto_prefill`'s axis).
    let lengths: BTreeSet<usize> = timed.iter().map(|(_, t)| t.seq_len).collect();
    if lengths.len() < 2 {
        return;
    }
    // One line per model: its setting without the length it was timed at.
    let name = |r: &Row| {
        legend(
            &r.stage,
            r.setting()
                .filter(|(k, _)| *k != "eval.seq_len" && *k != "eval.batch_size"),
        )
    };
    // Seeds of one setting timed at one length are averaged into one point.
    let lines = |f: fn(&Timing) -> f64| -> Vec<Series> {
        replicate_means(
            timed
                .iter()
                .map(|(r, t)| (name(r), vec![(t.seq_len as f64, f(t))]))
                .collect(),
        )
    };
    let x_axis = XAxis::LogSwept;
    let panel = |title: &str, y: &str, f: fn(&Timing) -> f64| Panel {
        title: title.into(),
        x: "context length (tokens), log scale".into(),
        y: y.into(),
        series: lines(f),
        x_axis,
    };
    figs.push((
        "prefill_time".into(),
        Figure::Panels {
            title: "Inference time against length, each model alone on the GPU".into(),
            panels: vec![
                panel(
                    "one forward, no cache (the fused kernels)",
                    "forward time (ms)",
                    |t| t.forward_ms,
                ),
                panel(
                    "prefill into the key-value cache",
                    "prefill time (ms)",
                    |t| t.prefill_ms,
                ),
                panel("greedy decoding over the cache", "decoded tokens/s", |t| {
                    t.decode_tokens_per_s
                }),
            ],
        },
    ));
}

/// The method's attention and prefill time against the curve's setting: only cells timed
/// alone on the GPU (`exclusive`), since a timing beside other cells measures their load as
/// much as the setting. None where no cell was.
fn timed_against(method: &MethodSpec, curve: &SettingCurve, all: &[Row]) -> Option<Vec<Series>> {
    let timed: Vec<&Row> = tables::timed_alone(all)
        .into_iter()
        .filter(|(r, _)| r.method == method.method)
        .map(|(r, _)| r)
        .collect();
    if timed.is_empty() {
        return None;
    }
    let line = |what: &'static str, f: fn(&Timing) -> f64| {
        grouped(
            &timed,
            curve.key,
            move |r| {
                let len = r.report.timing.as_ref().map_or(0, |t| t.seq_len);
                format!("{what}, L={len} window={}", r.window)
            },
            move |r| {
                Some((
                    (curve.value)(&r.grid_attention),
                    f(r.report.timing.as_ref()?),
                ))
            },
            None,
        )
    };
    let mut series = line("attention layers", |t| t.attention_ms);
    series.extend(line("prefill", |t| t.prefill_ms));
    Some(series)
}

/// A method's quality against one of its own settings (PPA Fig. 3 and Table 1: final loss
/// against p; SwiAttn's full ratio against gamma_base), beside the probes' accuracy (with
/// chance and full attention as reference lines), on the synthetic corpus the recall of
/// dependencies at least w back, and the attention and prefill time of its cells timed alone
/// on the GPU.
pub(super) fn setting_curve(
    method: &MethodSpec,
    curve: &SettingCurve,
    all: &[Row],
    train: &[&Row],
    figs: &mut Vec<(String, Figure)>,
) {
    let of_method = |r: &&Row| r.method == method.method;
    let trained: Vec<&Row> = train.iter().copied().filter(of_method).collect();
    if trained.is_empty() {
        return;
    }
    let x = |r: &Row| (curve.value)(&r.grid_attention);
    // A curve needs the setting at two values at least.
    let values: BTreeSet<u64> = trained.iter().map(|r| x(r).to_bits()).collect();
    if values.len() < 2 {
        return;
    }
    // Cells of several budgets (a scan on a lower rung beside the top one's sweep) are lines
    // of their own, each named by its tokens; full attention's reference is one budget's.
    let budgets: BTreeSet<u64> = trained.iter().map(|r| r.budget_tokens.to_bits()).collect();
    let one_budget = budgets.len() == 1;
    let by_window = |rows: &[&Row], f: &dyn Fn(&Row) -> Option<f64>, bounds| {
        grouped(
            rows,
            curve.key,
            |r| match one_budget {
                true => format!("window={}", r.window),
                false => format!(
                    "window={}, {} tokens",
                    r.window,
                    short_count(r.budget_tokens)
                ),
            },
            |r| Some((x(r), f(r)?)),
            bounds,
        )
    };
    let reference = |rows: &[&Row], f: &dyn Fn(&Row) -> Option<f64>| {
        one_budget
            .then(|| full_reference(rows.iter().copied(), &trained, f))
            .flatten()
    };
    let panel = |title: &str, y: &str, series| Panel {
        title: title.into(),
        x: curve.axis.into(),
        y: y.into(),
        series,
        x_axis: match curve.log {
            true => XAxis::LogSwept,
            false => XAxis::LinearSwept,
        },
    };
    let mut panels = vec![panel(
        "validation loss",
        "loss",
        with_reference(
            by_window(&trained, &|r| Some(r.loss()), None),
            reference(train, &|r| Some(r.loss())),
        ),
    )];
    // A routed method's share of full attention, beside its paper's value.
    let usage = by_window(&trained, &|r| r.mu_f(), UNIT);
    if usage.iter().any(|s| !s.points.is_empty()) {
        let paper = method.reports.iter().find_map(|r| match r {
            Report::PaperUsage { mu_f, source } => Some((*mu_f, *source)),
            _ => None,
        });
        let usage = match paper {
            Some((mu_f, source)) => with_line(usage, source, Some(mu_f), 12),
            None => usage,
        };
        panels.push(panel("share of full attention", "mu_f", usage));
    }
    let probed: Vec<&Row> = all
        .iter()
        .filter(of_method)
        .filter(|r| pareto::probe_exact_match(r).is_some())
        .collect();
    if !probed.is_empty() {
        // Full attention's probes: those of full attention trained as long where the sweep
        // has it (not the untrained base), else the method's own at the setting where it is
        // full attention (PPA's p = 1: the same pattern).
        let all: Vec<&Row> = all.iter().collect();
        let full = reference(&all, &pareto::probe_exact_match).or_else(|| {
            let at_full: Vec<f64> = probed
                .iter()
                .filter(|r| curve.full_at == Some(x(r)))
                .filter_map(|r| pareto::probe_exact_match(r))
                .collect();
            (!at_full.is_empty()).then(|| summarize(&at_full).mean)
        });
        let lines = with_line(
            by_window(&probed, &pareto::probe_exact_match, UNIT),
            "full attention, trained as long",
            full,
            6,
        );
        // A needle of digits is not guessed: chance is 0.
        let lines = with_line(lines, "chance", Some(0.0), 8);
        panels.push(panel("probes (RULER NIAH)", "exact-match accuracy", lines));
    }
    let far = by_window(&trained, &|r| r.far()?.1, UNIT);
    if far.iter().any(|s| !s.points.is_empty()) {
        // The synthetic corpus's long-range task (PPA Table 1's accuracy).
        panels.push(panel(
            "recall of dependencies >= w back",
            "exact-match accuracy",
            far,
        ));
    }
    if let Some(series) = timed_against(method, curve, all) {
        panels.push(panel("one sequence, alone on the GPU", "time (ms)", series));
    }
    let fig = match panels.len() {
        1 => {
            let p = panels.remove(0);
            Figure::Lines {
                title: format!(
                    "{}: final validation loss against {}",
                    method.label, curve.symbol
                ),
                x: p.x,
                y: "validation loss".into(),
                series: p.series,
                x_axis: p.x_axis,
            }
        }
        _ => Figure::Panels {
            title: format!("{} against {}", method.label, curve.symbol),
            panels,
        },
    };
    figs.push((curve.stem.into(), fig));
}
