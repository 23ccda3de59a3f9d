//! Figures of a sweep directory, each as PNG and SVG. Text is drawn with a font compiled into
//! the binary (DejaVu Sans), so plotting needs no system fonts and works headless.
//!
//! | figure | paper item |
//! |---|---|
//! | `mu_f_vs_window` | AHA Table 1/2: full-attention usage against the window |
//! | `head_usage_<cell>` | AHA Fig. 3: layer x head usage heatmap with a colour bar |
//! | `head_usage_sorted` | AHA Fig. 4: every head's usage, sorted |
//! | `lambda_ablation` | AHA Table 4: usage against lambda |
//! | `threshold_sweep` | L2A Fig. 13: quality against attention work as tau varies |
//! | `layer_sparsity_<cell>` | L2A Fig. 3 / SwiAttn Fig. 5: sparsity per layer |
//! | `ppa_eval_loss`, `ppa_s_curve` | PPA Fig. 2/3 and Table 1: loss curves by p, final loss against p |
//! | `niah_heatmap_<cell>`, `full_ratio_vs_depth` | SwiAttn Fig. 3 and 6, from a cell's `eval/niah.csv` |
//! | `pareto` | all methods: quality against attention work, with the Pareto front |

use crate::config::{Method, Router};
use crate::sweep::StageKind;
use crate::tables::{name_of, rows, Row};
use anyhow::{anyhow, Result};
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

static FONT: &[u8] = include_bytes!("fonts/DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";
pub const SIZE: (u32, u32) = (900, 560);

fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_err() {
            panic!("the embedded font does not load");
        }
    });
}

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing failed: {e:?}")
}

/// One line (or point set) of a chart.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub line: bool,
    /// Text drawn beside each point (same length as `points`), e.g. tau values.
    pub labels: Vec<String>,
}

/// What a figure is drawn from; `draw` renders it on any plotters backend.
pub enum Figure {
    /// x-y chart; `log_x` plots x on a log10 axis.
    Lines {
        title: String,
        x: String,
        y: String,
        series: Vec<Series>,
        log_x: bool,
    },
    /// Rows by columns of values with a colour bar.
    Heatmap {
        title: String,
        x: String,
        y: String,
        values: Vec<Vec<f64>>,
        range: (f64, f64),
    },
    /// One bar per category.
    Bars {
        title: String,
        x: String,
        y: String,
        bars: Vec<(String, f64)>,
    },
}

fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let pad = if hi > lo {
        (hi - lo) * 0.06
    } else {
        lo.abs().max(1.0) * 0.1
    };
    (lo - pad, hi + pad)
}

/// Viridis-like ramp from dark blue (0) through teal to yellow (1).
fn colour(t: f64) -> RGBColor {
    let stops = [
        (68.0, 1.0, 84.0),
        (59.0, 82.0, 139.0),
        (33.0, 145.0, 140.0),
        (94.0, 201.0, 98.0),
        (253.0, 231.0, 37.0),
    ];
    let t = t.clamp(0.0, 1.0) * (stops.len() - 1) as f64;
    let i = (t.floor() as usize).min(stops.len() - 2);
    let f = t - i as f64;
    let mix = |a: f64, b: f64| (a + (b - a) * f).round() as u8;
    RGBColor(
        mix(stops[i].0, stops[i + 1].0),
        mix(stops[i].1, stops[i + 1].1),
        mix(stops[i].2, stops[i + 1].2),
    )
}

/// The index of the unit cell whose centre a tick at `v` marks ("" for ticks on cell edges),
/// so categorical axes label cells, not their boundaries.
fn cell_index(v: f64) -> String {
    let i = v.floor();
    if (v - i - 0.5).abs() < 0.26 {
        format!("{}", i as i64)
    } else {
        String::new()
    }
}

fn fmt_tick(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 1e4 || v.abs() < 1e-2 {
        format!("{v:.1e}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// An x-y chart on a linear or logarithmic x axis.
fn draw_lines<DB: DrawingBackend, X: AsRangedCoord<Value = f64>>(
    root: &DrawingArea<DB, Shift>,
    xr: X,
    yr: std::ops::Range<f64>,
    title: &str,
    x: &str,
    y: &str,
    series: &[Series],
) -> Result<()>
where
    X::CoordDescType: ValueFormatter<f64>,
{
    let text = |size: u32| (FAMILY, size).into_font();
    let mut chart = ChartBuilder::on(root)
        .caption(title, text(22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(xr, yr)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x)
        .y_desc(y)
        .axis_desc_style(text(16))
        .label_style(text(15))
        .x_label_formatter(&|v| fmt_tick(*v))
        .y_label_formatter(&|v| fmt_tick(*v))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(err)?;
    for (i, s) in series.iter().enumerate() {
        let c = Palette99::pick(i).to_rgba();
        let drawn = if s.line {
            chart
                .draw_series(LineSeries::new(s.points.clone(), c.stroke_width(2)))
                .map_err(err)?
        } else {
            chart
                .draw_series(s.points.iter().map(|&p| Circle::new(p, 0, c)))
                .map_err(err)?
        };
        drawn
            .label(s.name.as_str())
            .legend(move |(a, b)| Circle::new((a + 8, b), 5, c.filled()));
        chart
            .draw_series(s.points.iter().map(|&p| Circle::new(p, 4, c.filled())))
            .map_err(err)?;
        chart
            .draw_series(
                s.points
                    .iter()
                    .zip(&s.labels)
                    .map(|(&p, l)| Text::new(l.clone(), p, text(13))),
            )
            .map_err(err)?;
    }
    if series.len() > 1 || series.iter().any(|s| !s.name.is_empty()) {
        chart
            .configure_series_labels()
            .label_font(text(14))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(err)?;
    }
    Ok(())
}

impl Figure {
    pub fn title(&self) -> &str {
        match self {
            Figure::Lines { title, .. }
            | Figure::Heatmap { title, .. }
            | Figure::Bars { title, .. } => title,
        }
    }

    pub fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        register_font();
        root.fill(&WHITE).map_err(err)?;
        let text = |size: u32| (FAMILY, size).into_font();
        match self {
            Figure::Lines {
                title,
                x,
                y,
                series,
                log_x,
            } => {
                let (y0, y1) = bounds(series.iter().flat_map(|s| s.points.iter().map(|p| p.1)));
                if *log_x {
                    let (lo, hi) = series
                        .iter()
                        .flat_map(|s| s.points.iter().map(|p| p.0))
                        .filter(|v| *v > 0.0)
                        .fold((f64::INFINITY, 0f64), |(a, b), v| (a.min(v), b.max(v)));
                    let (lo, hi) = if lo.is_finite() {
                        (lo / 1.25, hi * 1.25)
                    } else {
                        (1.0, 10.0)
                    };
                    draw_lines(root, (lo..hi).log_scale(), y0..y1, title, x, y, series)?;
                } else {
                    let (x0, x1) = bounds(series.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
                    draw_lines(root, x0..x1, y0..y1, title, x, y, series)?;
                }
            }
            Figure::Heatmap {
                title,
                x,
                y,
                values,
                range,
            } => {
                let (w, _) = root.dim_in_pixel();
                let (main, bar) = root.split_horizontally(w.saturating_sub(110));
                let rows = values.len() as f64;
                let cols = values.first().map_or(0, |r| r.len()) as f64;
                let mut chart = ChartBuilder::on(&main)
                    .caption(title, text(22))
                    .margin(16)
                    .x_label_area_size(48)
                    .y_label_area_size(60)
                    .build_cartesian_2d(0f64..cols, 0f64..rows)
                    .map_err(err)?;
                chart
                    .configure_mesh()
                    .x_desc(x.as_str())
                    .y_desc(y.as_str())
                    .axis_desc_style(text(16))
                    .label_style(text(15))
                    .disable_mesh()
                    .x_labels(2 * values.first().map_or(1, |r| r.len()).min(32) + 1)
                    .y_labels(2 * values.len().min(32) + 1)
                    .x_label_formatter(&|v| cell_index(*v))
                    .y_label_formatter(&|v| cell_index(*v))
                    .draw()
                    .map_err(err)?;
                let span = (range.1 - range.0).max(1e-12);
                chart
                    .draw_series(values.iter().enumerate().flat_map(|(r, row)| {
                        row.iter().enumerate().map(move |(c, v)| {
                            let (c, r) = (c as f64, r as f64);
                            Rectangle::new(
                                [(c, r), (c + 1.0, r + 1.0)],
                                colour((v - range.0) / span).filled(),
                            )
                        })
                    }))
                    .map_err(err)?;
                let mut cb = ChartBuilder::on(&bar)
                    .margin_top(56)
                    .margin_bottom(64)
                    .margin_right(8)
                    .y_label_area_size(56)
                    .build_cartesian_2d(0f64..1.0, range.0..range.1)
                    .map_err(err)?;
                cb.configure_mesh()
                    .disable_mesh()
                    .disable_x_axis()
                    .label_style(text(12))
                    .y_label_formatter(&|v| fmt_tick(*v))
                    .draw()
                    .map_err(err)?;
                let steps = 64;
                cb.draw_series((0..steps).map(|i| {
                    let a = range.0 + span * i as f64 / steps as f64;
                    let b = range.0 + span * (i + 1) as f64 / steps as f64;
                    Rectangle::new(
                        [(0.0, a), (1.0, b)],
                        colour(i as f64 / (steps - 1) as f64).filled(),
                    )
                }))
                .map_err(err)?;
            }
            Figure::Bars { title, x, y, bars } => {
                let (_, y1) = bounds(bars.iter().map(|b| b.1).chain([0.0]));
                let n = bars.len() as f64;
                let mut chart = ChartBuilder::on(root)
                    .caption(title, text(22))
                    .margin(16)
                    .x_label_area_size(48)
                    .y_label_area_size(72)
                    .build_cartesian_2d(0f64..n, 0f64..y1)
                    .map_err(err)?;
                let names: Vec<String> = bars.iter().map(|b| b.0.clone()).collect();
                chart
                    .configure_mesh()
                    .x_desc(x.as_str())
                    .y_desc(y.as_str())
                    .axis_desc_style(text(16))
                    .label_style(text(15))
                    .disable_x_mesh()
                    .x_labels(bars.len().min(40) * 2 + 1)
                    .x_label_formatter(&|v| {
                        cell_index(*v)
                            .parse::<usize>()
                            .ok()
                            .and_then(|i| names.get(i).cloned())
                            .unwrap_or_default()
                    })
                    .y_label_formatter(&|v| fmt_tick(*v))
                    .draw()
                    .map_err(err)?;
                let c = Palette99::pick(0).to_rgba();
                chart
                    .draw_series(bars.iter().enumerate().map(|(i, b)| {
                        Rectangle::new([(i as f64 + 0.15, 0.0), (i as f64 + 0.85, b.1)], c.filled())
                    }))
                    .map_err(err)?;
            }
        }
        root.present().map_err(err)?;
        Ok(())
    }

    /// Writes `<stem>.png` and `<stem>.svg`.
    pub fn save(&self, stem: &Path) -> Result<Vec<PathBuf>> {
        let png = stem.with_extension("png");
        let svg = stem.with_extension("svg");
        crate::atomic::write_with(&png, |tmp| {
            self.draw(&BitMapBackend::new(tmp, SIZE).into_drawing_area())
        })?;
        crate::atomic::write_with(&svg, |tmp| {
            self.draw(&SVGBackend::new(tmp, SIZE).into_drawing_area())
        })?;
        Ok(vec![png, svg])
    }
}

fn series(name: String, mut points: Vec<(f64, f64)>, line: bool) -> Series {
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    Series {
        name,
        points,
        line,
        labels: vec![],
    }
}

/// Groups rows by a key into named series of (x, y).
fn grouped(
    rows: &[&Row],
    key: impl Fn(&Row) -> String,
    xy: impl Fn(&Row) -> Option<(f64, f64)>,
) -> Vec<Series> {
    let mut groups: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in rows {
        if let Some(p) = xy(r) {
            groups.entry(key(r)).or_default().push(p);
        }
    }
    groups
        .into_iter()
        .map(|(k, v)| series(k, v, true))
        .collect()
}

/// Points no other point beats on both attention work (attended pairs over full causal pairs) and loss.
pub fn pareto_front(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut sorted: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|p| p.0.is_finite() && p.1.is_finite())
        .collect();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let mut front: Vec<(f64, f64)> = Vec::new();
    for p in sorted {
        if front.last().is_none_or(|l| p.1 < l.1) {
            front.push(p);
        }
    }
    front
}

/// NIAH figures of one cell from its `eval/niah.csv` (columns depth, length, accuracy and
/// optionally full_ratio), as the evaluation suite writes it.
fn niah_figures(path: &Path, label: &str) -> Result<Vec<(String, Figure)>> {
    let mut rdr = csv::Reader::from_path(path)?;
    let headers = rdr.headers()?.clone();
    let idx = |n: &str| headers.iter().position(|h| h == n);
    let (Some(d), Some(l), Some(a)) = (idx("depth"), idx("length"), idx("accuracy")) else {
        anyhow::bail!("{} needs columns depth, length, accuracy", path.display());
    };
    let fr = idx("full_ratio");
    let mut cells: Vec<(f64, f64, f64, Option<f64>)> = Vec::new();
    for rec in rdr.records() {
        let rec = rec?;
        let num = |i: usize| {
            rec.get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(f64::NAN)
        };
        cells.push((num(d), num(l), num(a), fr.map(num)));
    }
    let mut depths: Vec<f64> = cells.iter().map(|c| c.0).collect();
    let mut lengths: Vec<f64> = cells.iter().map(|c| c.1).collect();
    for v in [&mut depths, &mut lengths] {
        v.sort_by(f64::total_cmp);
        v.dedup();
    }
    let mut grid = vec![vec![f64::NAN; lengths.len()]; depths.len()];
    for c in &cells {
        let (i, j) = (
            depths.iter().position(|&x| x == c.0).unwrap(),
            lengths.iter().position(|&x| x == c.1).unwrap(),
        );
        grid[i][j] = c.2;
    }
    let mut out = vec![(
        "niah_heatmap".to_string(),
        Figure::Heatmap {
            title: format!("NIAH accuracy: {label}"),
            x: format!(
                "context length (columns: {})",
                lengths
                    .iter()
                    .map(|v| fmt_tick(*v))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            y: "needle depth (row index, top = deepest)".into(),
            values: grid,
            range: (0.0, 1.0),
        },
    )];
    if fr.is_some() {
        let pts: Vec<(f64, f64)> = depths
            .iter()
            .map(|&dep| {
                let v: Vec<f64> = cells
                    .iter()
                    .filter(|c| c.0 == dep)
                    .filter_map(|c| c.3)
                    .collect();
                (dep, v.iter().sum::<f64>() / v.len().max(1) as f64)
            })
            .collect();
        out.push((
            "full_ratio_vs_depth".to_string(),
            Figure::Lines {
                title: format!("Full-attention ratio on answer tokens: {label}"),
                x: "needle depth".into(),
                y: "full-attention ratio".into(),
                series: vec![series(label.to_string(), pts, true)],
                log_x: false,
            },
        ));
    }
    Ok(out)
}

/// Every figure the sweep directory's cells can fill, as (file stem, figure).
pub fn figures(sweep: &Path) -> Result<Vec<(String, Figure)>> {
    let all = rows(sweep)?;
    let train: Vec<&Row> = all.iter().filter(|r| r.kind == StageKind::Train).collect();
    let aha: Vec<&Row> = train
        .iter()
        .copied()
        .filter(|r| r.method == Method::Aha && r.router == Router::Learned)
        .collect();
    let mut figs: Vec<(String, Figure)> = Vec::new();

    let routed_by_window: Vec<&Row> = train
        .iter()
        .copied()
        .filter(|r| r.mu_f().is_some() && r.router == Router::Learned)
        .collect();
    if routed_by_window
        .iter()
        .map(|r| r.window as i64)
        .collect::<std::collections::BTreeSet<_>>()
        .len()
        > 1
    {
        figs.push((
            "mu_f_vs_window".into(),
            Figure::Lines {
                title: "Full-attention usage against window".into(),
                x: "window w (tokens, log scale)".into(),
                y: "full-attention usage mu_f".into(),
                series: grouped(
                    &routed_by_window,
                    |r| format!("{} lambda={}", name_of(r.method), r.lambda),
                    |r| r.mu_f().map(|m| (r.window, m)),
                ),
                log_x: true,
            },
        ));
    }
    let mut sorted_usage = Vec::new();
    for r in &aha {
        let Some(g) = r.gates() else { continue };
        let m = g.per_head.clone();
        if m.is_empty() {
            continue;
        }
        let mut all_heads: Vec<f64> = m.iter().flatten().copied().collect();
        all_heads.sort_by(|a, b| b.total_cmp(a));
        sorted_usage.push(series(
            r.label.clone(),
            all_heads
                .iter()
                .enumerate()
                .map(|(i, v)| (i as f64 + 1.0, *v))
                .collect(),
            true,
        ));
        figs.push((
            format!("head_usage_{}", r.cell),
            Figure::Heatmap {
                title: format!("Head usage mu_f: {}", r.label),
                x: "head".into(),
                y: "layer".into(),
                values: m,
                range: (0.0, 1.0),
            },
        ));
    }
    if !sorted_usage.is_empty() {
        figs.push((
            "head_usage_sorted".into(),
            Figure::Lines {
                title: "Heads sorted by full-attention usage".into(),
                x: "head rank".into(),
                y: "mu_f".into(),
                series: sorted_usage,
                log_x: false,
            },
        ));
    }
    let lambdas: std::collections::BTreeSet<u64> = aha.iter().map(|r| r.lambda.to_bits()).collect();
    if lambdas.len() > 1 {
        figs.push((
            "lambda_ablation".into(),
            Figure::Lines {
                title: "Full-attention usage against lambda".into(),
                x: "lambda (log scale)".into(),
                y: "full-attention usage mu_f".into(),
                series: grouped(
                    &aha,
                    |r| format!("w={}", r.window),
                    |r| r.mu_f().map(|m| (r.lambda, m)),
                ),
                log_x: true,
            },
        ));
    }
    let tau: Vec<&Row> = all
        .iter()
        .filter(|r| r.method == Method::L2a && r.kind == StageKind::Eval && r.mu_f().is_some())
        .collect();
    if !tau.is_empty() {
        let mut groups: BTreeMap<String, Series> = BTreeMap::new();
        for r in &tau {
            let s = groups
                .entry(format!("w={}", r.window))
                .or_insert_with(|| Series {
                    name: format!("L2A w={}", r.window),
                    points: vec![],
                    line: true,
                    labels: vec![],
                });
            s.points.push((r.pairs_vs_full(), r.loss()));
            s.labels.push(format!("tau={}", r.tau));
        }
        let series: Vec<Series> = groups
            .into_values()
            .map(|mut s| {
                let mut idx: Vec<usize> = (0..s.points.len()).collect();
                idx.sort_by(|&a, &b| s.points[a].0.total_cmp(&s.points[b].0));
                s.points = idx.iter().map(|&i| s.points[i]).collect();
                s.labels = idx.iter().map(|&i| s.labels[i].clone()).collect();
                s
            })
            .collect();
        figs.push((
            "threshold_sweep".into(),
            Figure::Lines {
                title: "Test-time threshold: quality against attention work".into(),
                x: "attended pairs / full causal".into(),
                y: "validation loss".into(),
                series,
                log_x: false,
            },
        ));
    }
    for r in all
        .iter()
        .filter(|r| matches!(r.method, Method::L2a | Method::Swiattn) && r.kind == StageKind::Train)
    {
        let Some(g) = r.gates() else { continue };
        let per_layer = &g.per_layer;
        figs.push((
            format!("layer_sparsity_{}", r.cell),
            Figure::Bars {
                title: format!("Sparsity per layer: {} {}", name_of(r.method), r.label),
                x: "layer".into(),
                y: "sparsity 1 - mu_f".into(),
                bars: per_layer
                    .iter()
                    .enumerate()
                    .map(|(l, m)| (l.to_string(), 1.0 - m))
                    .collect(),
            },
        ));
    }
    let ppa: Vec<&Row> = train
        .iter()
        .copied()
        .filter(|r| r.method == Method::Ppa)
        .collect();
    if !ppa.is_empty() {
        let curves: Vec<Series> = ppa
            .iter()
            .filter_map(|r| {
                let mut rdr =
                    csv::Reader::from_path(sweep.join(&r.cell).join("val_log.csv")).ok()?;
                let pts: Vec<(f64, f64)> = rdr
                    .records()
                    .filter_map(|x| x.ok())
                    .filter_map(|x| Some((x.get(0)?.parse().ok()?, x.get(1)?.parse().ok()?)))
                    .collect();
                Some(series(format!("p={}", r.ppa_power), pts, true))
            })
            .collect();
        if !curves.is_empty() {
            figs.push((
                "ppa_eval_loss".into(),
                Figure::Lines {
                    title: "PPA: validation loss by p".into(),
                    x: "step".into(),
                    y: "validation loss".into(),
                    series: curves,
                    log_x: false,
                },
            ));
        }
        figs.push((
            "ppa_s_curve".into(),
            Figure::Lines {
                title: "PPA: final validation loss against p".into(),
                x: "power p".into(),
                y: "validation loss".into(),
                series: grouped(
                    &ppa,
                    |r| format!("w={}", r.window),
                    |r| Some((r.ppa_power, r.loss())),
                ),
                log_x: false,
            },
        ));
    }
    for r in &all {
        let p = sweep.join(&r.cell).join("eval/niah.csv");
        if p.is_file() {
            for (stem, f) in niah_figures(&p, &format!("{} {}", name_of(r.method), r.label))? {
                figs.push((format!("{stem}_{}", r.cell), f));
            }
        }
    }
    // One budget: the cells continued from the most common source (a base trained for
    // longer or shorter is not comparable).
    let mut sources: BTreeMap<&str, usize> = BTreeMap::new();
    for r in all.iter().filter(|r| r.kind == StageKind::Train) {
        *sources.entry(r.source.as_str()).or_default() += 1;
    }
    let budget = sources
        .iter()
        .max_by_key(|(_, n)| **n)
        .map(|(s, _)| *s)
        .unwrap_or("");
    let quality: Vec<&Row> = all
        .iter()
        .filter(|r| {
            r.kind != StageKind::Prune && r.pairs_vs_full().is_finite() && r.source == budget
        })
        .collect();
    if quality.len() > 1 {
        let front = pareto_front(
            &quality
                .iter()
                .map(|r| (r.pairs_vs_full(), r.loss()))
                .collect::<Vec<_>>(),
        );
        // The front first, so every method's points are drawn over it.
        let mut series = vec![Series {
            name: "Pareto front".into(),
            points: front,
            line: true,
            labels: vec![],
        }];
        for mut s in grouped(
            &quality,
            |r| name_of(r.method),
            |r| Some((r.pairs_vs_full(), r.loss())),
        ) {
            s.line = false;
            series.push(s);
        }
        figs.push((
            "pareto".into(),
            Figure::Lines {
                title: "Quality against attention work, all methods".into(),
                x: "attended pairs / full causal".into(),
                y: "validation loss".into(),
                series,
                log_x: false,
            },
        ));
    }
    Ok(figs)
}

/// Renders every figure of `sweep` into `out/figures/` and writes the tables into `out`.
pub fn write_all(sweep: &Path, out: &Path) -> Result<Vec<PathBuf>> {
    let mut written = crate::tables::write_all(sweep, out)?;
    let dir = out.join("figures");
    crate::atomic::ensure_writable_dir(&dir)?;
    for (stem, fig) in figures(sweep)? {
        written.extend(fig.save(&dir.join(stem))?);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Renders into memory: (pixels that are not the white background, the SVG text).
    fn render(f: &Figure) -> (usize, String) {
        let mut buf = vec![0u8; (SIZE.0 * SIZE.1 * 3) as usize];
        f.draw(&BitMapBackend::with_buffer(&mut buf, SIZE).into_drawing_area())
            .unwrap();
        let ink = buf.chunks(3).filter(|p| p != &[255, 255, 255]).count();
        let mut svg = String::new();
        f.draw(&SVGBackend::with_string(&mut svg, SIZE).into_drawing_area())
            .unwrap();
        (ink, svg)
    }

    fn fixtures() -> Vec<Figure> {
        vec![
            Figure::Lines {
                title: "usage".into(),
                x: "window w".into(),
                y: "mu_f".into(),
                series: vec![series(
                    "lambda=0.01".into(),
                    vec![(4.0, 0.9), (8.0, 0.7), (16.0, 0.6), (32.0, 0.4)],
                    true,
                )],
                log_x: true,
            },
            Figure::Heatmap {
                title: "heads".into(),
                x: "head".into(),
                y: "layer".into(),
                values: vec![vec![0.1, 0.9], vec![0.5, 0.3]],
                range: (0.0, 1.0),
            },
            Figure::Bars {
                title: "sparsity".into(),
                x: "layer".into(),
                y: "sparsity".into(),
                bars: vec![("0".into(), 0.2), ("1".into(), 0.96)],
            },
        ]
    }

    #[test]
    fn figures_render_with_ink_and_axis_labels() {
        for f in fixtures() {
            let (ink, svg) = render(&f);
            assert!(ink > 5_000, "{}: only {ink} drawn pixels", f.title());
            let (x, y) = match &f {
                Figure::Lines { x, y, .. }
                | Figure::Heatmap { x, y, .. }
                | Figure::Bars { x, y, .. } => (x, y),
            };
            for label in [x, y, &f.title().to_string()] {
                assert!(
                    svg.contains(label.as_str()),
                    "{}: axis text {label:?} missing",
                    f.title()
                );
            }
        }
    }

    #[test]
    fn saved_png_has_the_right_size() {
        let dir = std::env::temp_dir().join(format!("attnsweep-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = fixtures().remove(0).save(&dir.join("f")).unwrap();
        let png = std::fs::read(&files[0]).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        let be = |o: usize| u32::from_be_bytes(png[o..o + 4].try_into().unwrap());
        assert_eq!((be(16), be(20)), SIZE);
        assert!(std::fs::read_to_string(&files[1])
            .unwrap()
            .starts_with("<svg"));
    }

    #[test]
    fn every_figure_of_a_fixture_sweep_renders() {
        let dir = crate::tables::fixture::sweep_dir("plots");
        let figs = figures(&dir).unwrap();
        let stems: Vec<&str> = figs.iter().map(|(s, _)| s.as_str()).collect();
        for want in [
            "mu_f_vs_window",
            "head_usage_aha-4",
            "head_usage_sorted",
            "lambda_ablation",
            "threshold_sweep",
            "layer_sparsity_l2a-0",
            "layer_sparsity_swi-0",
            "ppa_eval_loss",
            "ppa_s_curve",
            "pareto",
        ] {
            assert!(stems.contains(&want), "{want} missing from {stems:?}");
        }
        for (stem, f) in &figs {
            let (ink, svg) = render(f);
            assert!(ink > 5_000, "{stem}: only {ink} drawn pixels");
            assert!(svg.contains(f.title()), "{stem}: title missing");
        }
        let written = write_all(&dir, &dir).unwrap();
        assert!(written.iter().any(|p| p.ends_with("figures/pareto.png")));
    }

    #[test]
    fn pareto_front_keeps_only_undominated_points() {
        let pts = [
            (1.0, 2.0),
            (0.5, 2.5),
            (0.2, 3.0),
            (0.6, 2.8),
            (0.9, 2.1),
            (1.0, 1.9),
        ];
        assert_eq!(
            pareto_front(&pts),
            vec![(0.2, 3.0), (0.5, 2.5), (0.9, 2.1), (1.0, 1.9)]
        );
    }

    #[test]
    fn niah_csv_gives_heatmap_and_depth_curve() {
        let dir = std::env::temp_dir().join(format!("attnsweep-niah-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("niah.csv");
        std::fs::write(&p, "depth,length,accuracy,full_ratio\n0.0,64,1.0,0.2\n0.5,64,0.5,0.4\n0.0,128,0.8,0.3\n0.5,128,0.2,0.5\n").unwrap();
        let figs = niah_figures(&p, "m").unwrap();
        assert_eq!(figs.len(), 2);
        match &figs[0].1 {
            Figure::Heatmap { values, .. } => {
                assert_eq!(values, &vec![vec![1.0, 0.8], vec![0.5, 0.2]])
            }
            _ => panic!("heatmap expected"),
        }
        match &figs[1].1 {
            Figure::Lines { series, .. } => {
                assert_eq!(series[0].points, vec![(0.0, 0.25), (0.5, 0.45)])
            }
            _ => panic!("lines expected"),
        }
        for (_, f) in &figs {
            assert!(render(f).0 > 5_000);
        }
    }
}
