//! `bench train`'s figure: tokens/s (with its 95 % interval where a case ran several times)
//! and peak memory against the length, a line per (implementation, method, case).

use super::row::{method_rank, reads_power, Case, TrainRow, OURS};
use crate::sweep::{Figure, Look, Panel, Series, XAxis};

/// Tokens/s and peak memory against the length for `model`'s rows that ran, a line per
/// (implementation, method, case): None where none ran. A method (with its case) keeps one
/// colour; ours is drawn solid with filled circles, the compiled peer dashed with hollow
/// squares, the eager one dashed with crosses.
pub(super) fn figure(rows: &[TrainRow], model: &str) -> Option<Figure> {
    type Line = (String, String, Case);
    let mut lines: Vec<Line> = rows
        .iter()
        .filter(|r| r.model == model && r.step_ms.is_some())
        .map(|r| (r.imp.clone(), r.method.clone(), r.case()))
        .collect();
    // Ours first, then the peers; methods in the order `all_methods` names them.
    let imp_rank = |imp: &str| {
        [OURS, "torch_compile", "torch_eager"]
            .iter()
            .position(|i| *i == imp)
            .unwrap_or(3)
    };
    lines.sort_by(|a, b| {
        (imp_rank(&a.0), method_rank(&a.1), &a.2)
            .partial_cmp(&(imp_rank(&b.0), method_rank(&b.1), &b.2))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    lines.dedup();
    if lines.is_empty() {
        return None;
    }
    // Where every line with a window has the same one (or usage), the names leave it out.
    let distinct = |f: fn(&Case) -> Option<String>| {
        let mut v: Vec<String> = lines.iter().filter_map(|l| f(&l.2)).collect();
        v.sort();
        v.dedup();
        v.len() > 1
    };
    // PPA's rows of a CSV written before the `ppa_power` column have no power: "p=?", told
    // apart from a power measured since.
    let mut powers: Vec<&Option<String>> = lines
        .iter()
        .filter(|l| reads_power(&l.1))
        .map(|l| &l.2 .2)
        .collect();
    powers.sort();
    powers.dedup();
    let (name_windows, name_usages, name_powers) = (
        distinct(|c| c.0.map(|w| w.to_string())),
        distinct(|c| c.1.clone()),
        powers.len() > 1,
    );
    // A colour per (method, case), in the order of the methods.
    let mut kinds: Vec<(usize, &Case)> = lines.iter().map(|l| (method_rank(&l.1), &l.2)).collect();
    kinds.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    kinds.dedup();
    let look = |imp: &str, method: &str, case: &Case| Look::Chosen {
        colour: kinds
            .iter()
            .position(|k| *k == (method_rank(method), case))
            .unwrap_or(0),
        shape: match imp {
            OURS => 0,
            "torch_compile" => 2,
            _ => 4,
        },
        hollow: imp != OURS,
        dashed: imp != OURS,
    };
    // A value and its 95 % interval (NaN where the row is one run).
    type Value = fn(&TrainRow) -> Option<(f64, (f64, f64))>;
    let panel = |title: &str, y: &str, value: Value| Panel {
        title: title.into(),
        x: "sequence length L (tokens)".into(),
        y: y.into(),
        series: lines
            .iter()
            .filter_map(|(imp, method, case)| {
                let mut points: Vec<(f64, (f64, (f64, f64)), String)> = rows
                    .iter()
                    .filter(|r| {
                        r.model == model
                            && &r.imp == imp
                            && &r.method == method
                            && &r.case() == case
                    })
                    .filter_map(|r| value(r).map(|v| (r.len as f64, v, set_up(r))))
                    .collect();
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                let errors: Vec<(f64, f64)> = points.iter().map(|p| p.1 .1).collect();
                // A line joins lengths run one way only; where the tokens a step or the
                // checkpointing change with the length the points stand alone, each named by
                // its set-up.
                let one_set_up = points.windows(2).all(|p| p[0].2 == p[1].2);
                let mut name = format!("{imp} {method}");
                if let (true, Some(w)) = (name_windows, case.0) {
                    name += &format!(" w={w}");
                }
                if let (true, Some(u)) = (name_usages, &case.1) {
                    name += &format!(" u={u}");
                }
                if name_powers && reads_power(method) {
                    name += &format!(" p={}", case.2.as_deref().unwrap_or("?"));
                }
                (!points.is_empty()).then(|| Series {
                    name,
                    labels: match one_set_up {
                        true => vec![],
                        false => points.iter().map(|p| p.2.clone()).collect(),
                    },
                    points: points.iter().map(|p| (p.0, p.1 .0)).collect(),
                    line: one_set_up,
                    // Bars only where some point is a mean of runs.
                    errors: match errors.iter().any(|e| e.0.is_finite()) {
                        true => errors,
                        false => vec![],
                    },
                    look: look(imp, method, case),
                })
            })
            .collect(),
        x_axis: XAxis::LogSwept,
    };
    Some(Figure::Panels {
        // A run without peers (`--no-peers`) compares our methods with each other alone.
        title: match lines.iter().any(|(imp, _, _)| *imp != OURS) {
            true => format!("Training steps of {model}: ours beside plain PyTorch"),
            false => format!("Training steps of {model}: our methods"),
        },
        panels: vec![
            panel("throughput", "tokens/s", |r| {
                r.tokens_per_s().map(|t| (t, r.tokens_per_s_interval()))
            }),
            panel("peak memory", "peak GPU memory (GiB)", |r| {
                r.peak_gib.map(|p| (p, (f64::NAN, f64::NAN)))
            }),
        ],
    })
}

/// A row's set-up as a short point label: its tokens a step (batch x L; the batch itself
/// shrinks as L grows at equal tokens) and its checkpointing (the part of `setup` before the
/// loss's chunks), e.g. "16K tok, ckpt none" for batch 2 at 8,192 with "checkpointing none".
fn set_up(r: &TrainRow) -> String {
    let checkpointing = r.setup.split(';').next().unwrap_or_default().trim();
    let mode = checkpointing
        .strip_prefix("checkpointing ")
        .unwrap_or_else(|| checkpointing.trim_end_matches(" checkpointing"));
    format!("{}K tok, ckpt {mode}", r.batch * r.len / 1024)
}
