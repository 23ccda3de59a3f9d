//! Figures of a sweep directory, each as PNG and SVG. Text is drawn with a font compiled into
//! the binary (DejaVu Sans), so plotting needs no system fonts and works headless.
//!
//! | figure | paper item |
//! |---|---|
//! | `mu_f_vs_window` | AHA Table 1/2: full-attention usage and validation loss against the window |
//! | `head_usage_<cell>` | AHA Fig. 3: layer x head usage heatmap with a colour bar |
//! | `head_usage_<cell>_<task>` | AHA Fig. 3 per task, from a cell's `eval/probe_head_usage.csv` |
//! | `head_usage_sorted` | AHA Fig. 4: every head's usage, sorted |
//! | `lambda_ablation` | AHA Table 4: usage and validation loss against lambda |
//! | `threshold_sweep` | L2A Fig. 13: quality against attention work as tau varies |
//! | `layer_sparsity_<cell>` | L2A Fig. 3 / SwiAttn Fig. 5: sparsity per layer |
//! | `loss_curves` | validation loss during training, every train cell (PPA Fig. 2: curves by p) |
//! | `router_curves` | every learned router's gate usage and training loss over its steps (L2A router collapse) |
//! | `ppa_s_curve` | PPA Fig. 3 and Table 1: final loss against p, and on the synthetic corpus the accuracy on dependencies at least w back |
//! | `bucket_loss` | loss by dependency distance on the synthetic corpus, every evaluated cell |
//! | `niah_heatmap_<cell>`, `full_ratio_vs_depth` | SwiAttn Fig. 3 and 6, from a cell's `eval/niah.csv` |
//! | `pareto`, `pareto_time`, `pareto_memory` | every method of one budget: loss against attention work, measured training time and decode memory, each with its Pareto front |

use crate::config::{Method, Router};
use crate::model::attention::{spec, Gates};
use crate::sweep::StageKind;
use crate::sweep::tables::{log_columns, name_of, rows, Row};
use anyhow::{anyhow, Result};
use plotters::coord::combinators::LogCoord;
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::coord::types::RangedCoordf64;
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

/// One x-y chart of a [`Figure::Panels`].
pub struct Panel {
    pub title: String,
    pub x: String,
    pub y: String,
    pub series: Vec<Series>,
    pub x_axis: XAxis,
}

/// How a chart's x axis is scaled and where its ticks go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XAxis {
    /// Linear, ticks at round numbers: measured values (steps, attention work).
    Linear,
    /// Linear, ticks at the values a sweep set (PPA's p, needle depth) when there are few.
    LinearSwept,
    /// Log scale, ticks at the values a sweep set (windows, lambdas, distances).
    LogSwept,
}

/// What a figure is drawn from; `draw` renders it on any plotters backend.
pub enum Figure {
    /// x-y chart.
    Lines {
        title: String,
        x: String,
        y: String,
        series: Vec<Series>,
        x_axis: XAxis,
    },
    /// Rows by columns of values with a colour bar.
    Heatmap {
        title: String,
        x: String,
        y: String,
        values: Vec<Vec<f64>>,
        range: (f64, f64),
        /// Labels of the columns and rows (the swept values); empty: their indices.
        x_ticks: Vec<String>,
        y_ticks: Vec<String>,
    },
    /// Charts side by side over the same series (e.g. usage and quality against the same
    /// swept value), with one legend.
    Panels { title: String, panels: Vec<Panel> },
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

/// The label of the unit cell whose centre a tick at `v` marks ("" for ticks on cell edges),
/// so categorical axes label cells, not their boundaries: `ticks[i]`, or the index `i` when
/// there are no ticks.
fn cell_label(v: f64, ticks: &[String]) -> String {
    let i = v.floor();
    if (v - i - 0.5).abs() < 0.26 {
        ticks
            .get(i as usize)
            .cloned()
            .unwrap_or_else(|| format!("{}", i as i64))
    } else {
        String::new()
    }
}

/// Line and marker colours: Okabe and Ito's colour-blind-safe palette without its yellow,
/// which is hard to see on white.
const PALETTE: [RGBColor; 7] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(230, 159, 0),
    RGBColor(0, 0, 0),
];

/// Width of the legend panel beside a chart: room for the 30 characters a label keeps.
const LEGEND_W: u32 = 300;

/// Distinct x values up to which the x axis is labelled at exactly those values (a sweep's
/// windows, powers, lambdas) rather than at round numbers.
const SWEPT_TICKS: usize = 12;

/// The marker of series `i`: colours cycle through 7, shapes through 5 (35 distinct), and
/// every other series is hollow and larger, so coinciding points of two series both show.
fn marker<'a, DB: DrawingBackend + 'a, C: Clone + 'a>(i: usize, p: C) -> DynElement<'a, DB, C> {
    let c = PALETTE[i % PALETTE.len()];
    let hollow = i % 2 == 1;
    let size = if hollow { 7 } else { 5 };
    let style = if hollow {
        c.stroke_width(2)
    } else {
        c.filled()
    };
    let at = EmptyElement::at(p);
    match i % 5 {
        0 => (at + Circle::new((0, 0), size, style)).into_dyn(),
        1 => (at + TriangleMarker::new((0, 0), size + 1, style)).into_dyn(),
        2 => (at + Rectangle::new([(-size, -size), (size, size)], style)).into_dyn(),
        3 => {
            let d = size + 2;
            let corners = vec![(0, -d), (d, 0), (0, d), (-d, 0), (0, -d)];
            if hollow {
                (at + PathElement::new(corners, style)).into_dyn()
            } else {
                (at + Polygon::new(corners, style)).into_dyn()
            }
        }
        _ => (at + Cross::new((0, 0), size, c.stroke_width(2))).into_dyn(),
    }
}

/// Tick labels for values `step` apart: as many decimals as tell neighbours apart, so a
/// narrow range never repeats a label.
fn tick_format(step: f64) -> impl Fn(&f64) -> String {
    let decimals = if step > 0.0 && step.is_finite() {
        (-step.log10()).ceil().clamp(0.0, 8.0) as usize
    } else {
        3
    };
    move |v: &f64| {
        if *v == 0.0 {
            "0".into()
        } else if v.abs() >= 1e5 || (v.abs() < 1e-3 && decimals > 4) {
            let s = format!("{v:.1e}");
            s.replace(".0e", "e")
        } else {
            let s = format!("{v:.decimals$}");
            if s.contains('.') {
                s.trim_end_matches('0').trim_end_matches('.').to_string()
            } else {
                s
            }
        }
    }
}

/// An axis labelled at given values (the swept ones) rather than at round numbers.
struct Swept<R> {
    axis: R,
    at: Vec<f64>,
}

impl<R: Ranged<ValueType = f64>> Ranged for Swept<R> {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        self.axis.map(v, limit)
    }

    fn key_points<Hint: KeyPointHint>(&self, _hint: Hint) -> Vec<f64> {
        self.at.clone()
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.axis.range()
    }

    fn axis_pixel_range(&self, limit: (i32, i32)) -> std::ops::Range<i32> {
        self.axis.axis_pixel_range(limit)
    }
}

/// The x values of every series, when there are few enough to label each one; vertical
/// markers (a series at one x, such as a window's reach) are not swept values.
fn swept_values(series: &[Series]) -> Option<Vec<f64>> {
    let mut xs: Vec<f64> = series
        .iter()
        .filter(|s| s.points.iter().any(|p| p.0 != s.points[0].0))
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .filter(|v| v.is_finite())
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    (xs.len() >= 2 && xs.len() <= SWEPT_TICKS).then_some(xs)
}

/// The largest power of ten, down to 1e-8, on whose decimal grid every value lies, so
/// labels with its decimals print each value exactly.
fn exact_step(xs: &[f64]) -> f64 {
    (0..=8)
        .map(|d| (d, 10f64.powi(-d)))
        .find(|&(d, _)| {
            xs.iter().all(|x| {
                let shown: f64 = format!("{x:.*}", d as usize).parse().unwrap_or(f64::NAN);
                (shown - x).abs() <= 1e-9 * x.abs().max(1e-12)
            })
        })
        .map_or(1e-8, |(_, step)| step)
}

/// The smallest gap between neighbouring values.
fn min_gap(xs: &[f64]) -> f64 {
    xs.windows(2)
        .map(|w| w[1] - w[0])
        .fold(f64::INFINITY, f64::min)
}

/// An x-y chart (no legend: see `draw_legend`) on a linear or logarithmic x axis, its x axis
/// labelled at the swept values when there are few.
fn draw_lines<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    x: &str,
    y: &str,
    series: &[Series],
    x_axis: XAxis,
) -> Result<()> {
    let text = |size: u32| (FAMILY, size).into_font();
    let (y0, y1) = bounds(series.iter().flat_map(|s| s.points.iter().map(|p| p.1)));
    let swept = match x_axis {
        XAxis::Linear => None,
        XAxis::LinearSwept | XAxis::LogSwept => swept_values(series),
    };
    let x_step = match &swept {
        // Each swept value printed exactly (0.125, not 0.1), and neighbours apart.
        Some(xs) => min_gap(xs).min(exact_step(xs)),
        None => {
            let (a, b) = bounds(series.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
            (b - a) / 10.0
        }
    };
    let y_fmt = tick_format((y1 - y0) / 10.0);
    let x_fmt = tick_format(x_step);
    let mut builder = ChartBuilder::on(root);
    builder
        .caption(title, text(20))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72);
    // One body for the four axis kinds; only the coordinate type differs.
    macro_rules! body {
        ($xr:expr) => {{
            let mut chart = builder.build_cartesian_2d($xr, y0..y1).map_err(err)?;
            chart
                .configure_mesh()
                .x_desc(x)
                .y_desc(y)
                .axis_desc_style(text(16))
                .label_style(text(14))
                .x_label_formatter(&x_fmt)
                .y_label_formatter(&y_fmt)
                .light_line_style(WHITE.mix(0.0))
                .draw()
                .map_err(err)?;
            for (i, s) in series.iter().enumerate() {
                let c = PALETTE[i % PALETTE.len()];
                if s.line {
                    chart
                        .draw_series(LineSeries::new(s.points.clone(), c.stroke_width(2)))
                        .map_err(err)?;
                }
                // One draw per marker: the shapes differ in type.
                for &p in &s.points {
                    chart.plotting_area().draw(&marker(i, p)).map_err(err)?;
                }
                chart
                    .draw_series(
                        s.points
                            .iter()
                            .zip(&s.labels)
                            .map(|(&p, l)| Text::new(l.clone(), p, text(13))),
                    )
                    .map_err(err)?;
            }
        }};
    }
    let finite_x = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .filter(|v| v.is_finite());
    if x_axis == XAxis::LogSwept {
        let (lo, hi) = finite_x
            .filter(|v| *v > 0.0)
            .fold((f64::INFINITY, 0f64), |(a, b), v| (a.min(v), b.max(v)));
        let (lo, hi) = if lo.is_finite() {
            (lo / 1.3, hi * 1.3)
        } else {
            (1.0, 10.0)
        };
        let axis: LogCoord<f64> = (lo..hi).log_scale().into();
        match swept {
            Some(at) => body!(Swept { axis, at }),
            None => body!(axis),
        }
    } else {
        let (x0, x1) = bounds(finite_x);
        let axis: RangedCoordf64 = (x0..x1).into();
        match swept {
            Some(at) => body!(Swept { axis, at }),
            None => body!(axis),
        }
    }
    Ok(())
}

/// The legend of `series` in its own panel (beside the data, never over it), in the series'
/// order, each with its line and marker.
fn draw_legend<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, series: &[Series]) -> Result<()> {
    let text = (FAMILY, 14).into_font();
    let (_, h) = area.dim_in_pixel();
    let row = 22i32;
    let fits = ((h as i32 - 70) / row).max(1) as usize;
    for (i, s) in series.iter().enumerate().take(fits) {
        let y = 60 + i as i32 * row;
        let c = PALETTE[i % PALETTE.len()];
        if s.line {
            area.draw(&PathElement::new(vec![(4, y), (36, y)], c.stroke_width(2)))
                .map_err(err)?;
        }
        area.draw(&marker::<DB, (i32, i32)>(i, (20, y)))
            .map_err(err)?;
        let name: String = s.name.chars().take(30).collect();
        area.draw(&Text::new(name, (44, y - 8), text.clone()))
            .map_err(err)?;
    }
    if series.len() > fits {
        let y = 60 + fits as i32 * row;
        area.draw(&Text::new(
            format!("... and {} more", series.len() - fits),
            (44, y - 8),
            text,
        ))
        .map_err(err)?;
    }
    Ok(())
}

/// Whether a chart of `series` needs a legend.
fn has_legend(series: &[Series]) -> bool {
    series.len() > 1 || series.iter().any(|s| !s.name.is_empty())
}

impl Figure {
    pub fn title(&self) -> &str {
        match self {
            Figure::Lines { title, .. }
            | Figure::Heatmap { title, .. }
            | Figure::Panels { title, .. }
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
                x_axis,
            } => {
                if has_legend(series) {
                    let (w, _) = root.dim_in_pixel();
                    let (chart, legend) = root.split_horizontally(w.saturating_sub(LEGEND_W));
                    draw_lines(&chart, title, x, y, series, *x_axis)?;
                    draw_legend(&legend, series)?;
                } else {
                    draw_lines(root, title, x, y, series, *x_axis)?;
                }
            }
            Figure::Panels { title, panels } => {
                // Side by side over the same series, so one legend (the first panel's) serves.
                let (w, _) = root.dim_in_pixel();
                let (body, legend) = root.split_horizontally(w.saturating_sub(LEGEND_W));
                let body = body.titled(title, text(22)).map_err(err)?;
                let areas = body.split_evenly((1, panels.len().max(1)));
                for (area, p) in areas.iter().zip(panels) {
                    draw_lines(area, &p.title, &p.x, &p.y, &p.series, p.x_axis)?;
                }
                if let Some(first) = panels.first() {
                    if has_legend(&first.series) {
                        draw_legend(&legend, &first.series)?;
                    }
                }
            }
            Figure::Heatmap {
                title,
                x,
                y,
                values,
                range,
                x_ticks,
                y_ticks,
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
                    .x_label_formatter(&|v| cell_label(*v, x_ticks))
                    .y_label_formatter(&|v| cell_label(*v, y_ticks))
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
                    .y_label_formatter(&tick_format(span / 10.0))
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
                        cell_label(*v, &[])
                            .parse::<usize>()
                            .ok()
                            .and_then(|i| names.get(i).cloned())
                            .unwrap_or_default()
                    })
                    .y_label_formatter(&tick_format(y1 / 10.0))
                    .draw()
                    .map_err(err)?;
                let c = PALETTE[0];
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

    /// Pixels of the figure: panels side by side widen it.
    pub fn size(&self) -> (u32, u32) {
        match self {
            Figure::Panels { panels, .. } => (LEGEND_W + 560 * panels.len() as u32, SIZE.1),
            _ => SIZE,
        }
    }

    /// Writes `<stem>.png` and `<stem>.svg`.
    pub fn save(&self, stem: &Path) -> Result<Vec<PathBuf>> {
        let png = stem.with_extension("png");
        let svg = stem.with_extension("svg");
        let size = self.size();
        crate::util::atomic::write_with(&png, |tmp| {
            self.draw(&BitMapBackend::new(tmp, size).into_drawing_area())
        })?;
        crate::util::atomic::write_with(&svg, |tmp| {
            self.draw(&SVGBackend::new(tmp, size).into_drawing_area())
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
    sorted(
        groups
            .into_iter()
            .map(|(k, v)| series(k, v, true))
            .collect(),
    )
}

/// `a` before `b` in reading order: numbers inside names compare by value ("w=16" before
/// "w=128", "lambda=0.0003" before "lambda=0.001").
fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    /// Bytes of the number `s` starts with: digits, a fraction, an exponent (`1e-4`).
    fn number_len(s: &str) -> usize {
        let b = s.as_bytes();
        let digits = |from: usize| {
            b.get(from..)
                .map_or(0, |r| r.iter().take_while(|c| c.is_ascii_digit()).count())
        };
        let mut n = digits(0);
        if n == 0 {
            return 0;
        }
        if b.get(n) == Some(&b'.') && digits(n + 1) > 0 {
            n += 1 + digits(n + 1);
        }
        if matches!(b.get(n), Some(b'e' | b'E')) {
            let sign = usize::from(matches!(b.get(n + 1), Some(b'-' | b'+')));
            let d = digits(n + 1 + sign);
            if d > 0 {
                n += 1 + sign + d;
            }
        }
        n
    }
    /// The name as runs of text (Err) and numbers (Ok).
    fn parts(mut s: &str) -> Vec<Result<f64, &str>> {
        let mut out = Vec::new();
        while !s.is_empty() {
            let n = number_len(s);
            let cut = if n > 0 {
                n
            } else {
                s.find(|c: char| c.is_ascii_digit()).unwrap_or(s.len())
            };
            let (head, tail) = s.split_at(cut);
            out.push(if n > 0 {
                head.parse::<f64>().map_err(|_| head)
            } else {
                Err(head)
            });
            s = tail;
        }
        out
    }
    let (pa, pb) = (parts(a), parts(b));
    for (x, y) in pa.iter().zip(&pb) {
        let o = match (x, y) {
            (Ok(u), Ok(v)) => u.total_cmp(v),
            (Err(u), Err(v)) => u.cmp(v),
            (Ok(_), Err(_)) => std::cmp::Ordering::Less,
            (Err(_), Ok(_)) => std::cmp::Ordering::Greater,
        };
        if o != std::cmp::Ordering::Equal {
            return o;
        }
    }
    pa.len().cmp(&pb.len())
}

/// Series in reading order of their names (the legend's order).
fn sorted(mut series: Vec<Series>) -> Vec<Series> {
    series.sort_by(|a, b| natural_cmp(&a.name, &b.name));
    series
}

/// A cell's name in a legend: its stage and the settings its stage sweeps, without the
/// sections' prefixes (`aha window=16`).
fn legend_name(r: &Row) -> String {
    let settings = r
        .label
        .split_whitespace()
        .map(|kv| match kv.split_once('=') {
            Some((key, v)) => format!("{}={v}", key.rsplit('.').next().unwrap_or(key)),
            None => kv.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ");
    format!("{} {settings}", r.stage).trim().to_string()
}

/// Usage (mu_f) and validation loss against the same swept value, side by side.
fn usage_and_loss(title: &str, x: &str, usage: Vec<Series>, loss: Vec<Series>) -> Figure {
    let x_axis = XAxis::LogSwept;
    Figure::Panels {
        title: title.into(),
        panels: vec![
            Panel {
                title: "full-attention usage".into(),
                x: format!("{x}, log scale"),
                y: "mu_f".into(),
                series: usage,
                x_axis,
            },
            Panel {
                title: "quality".into(),
                x: format!("{x}, log scale"),
                y: "validation loss".into(),
                series: loss,
                x_axis,
            },
        ],
    }
}

/// AHA Fig. 3: a layer x head map of full-attention usage.
fn usage_map(title: String, values: Vec<Vec<f64>>) -> Figure {
    Figure::Heatmap {
        title,
        x: "head".into(),
        y: "layer".into(),
        values,
        range: (0.0, 1.0),
        x_ticks: vec![],
        y_ticks: vec![],
    }
}

/// A usage map per probe task of one cell, from its `eval/probe_head_usage.csv` (columns
/// task, layer, head, mu_f), as (task, figure).
fn probe_usage_maps(path: &Path, label: &str) -> Result<Vec<(String, Figure)>> {
    let mut by_task: BTreeMap<String, Vec<Vec<f64>>> = BTreeMap::new();
    let mut rdr = csv::Reader::from_path(path)?;
    for (i, rec) in rdr.records().enumerate() {
        let rec = rec?;
        let bad = || {
            anyhow!(
                "{}: row {} needs task,layer,head,mu_f",
                path.display(),
                i + 2
            )
        };
        let index = |k: usize| {
            rec.get(k)
                .and_then(|v| v.parse::<usize>().ok())
                .ok_or_else(bad)
        };
        let (layer, head) = (index(1)?, index(2)?);
        let mu: f64 = rec.get(3).and_then(|v| v.parse().ok()).ok_or_else(bad)?;
        anyhow::ensure!(
            mu.is_finite(),
            "{}: row {} gives mu_f {mu}",
            path.display(),
            i + 2
        );
        let m = by_task
            .entry(rec.get(0).ok_or_else(bad)?.to_string())
            .or_default();
        if m.len() <= layer {
            m.resize(layer + 1, vec![]);
        }
        if m[layer].len() <= head {
            m[layer].resize(head + 1, f64::NAN);
        }
        m[layer][head] = mu;
    }
    Ok(by_task
        .into_iter()
        .map(|(task, m)| {
            let title = format!("Head usage mu_f on {task} prompts: {label}");
            (task, usage_map(title, m))
        })
        .collect())
}

/// NIAH figures of cell `cell` (described by `label`) from its `eval/niah.csv` (columns depth,
/// length, accuracy and optionally full_ratio), as the evaluation suite writes it; `window`,
/// where the method has one, is marked on the full-ratio figure.
fn niah_figures(
    path: &Path,
    cell: &str,
    label: &str,
    window: Option<f64>,
) -> Result<Vec<(String, Figure)>> {
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
            x: "context length (tokens)".into(),
            y: "needle depth (0: start of the prompt, 1: its end)".into(),
            x_ticks: lengths.iter().map(tick_format(1.0)).collect(),
            y_ticks: depths
                .iter()
                .map(tick_format(min_gap(&depths).min(exact_step(&depths))))
                .collect(),
            values: grid,
            range: (0.0, 1.0),
        },
    )];
    if fr.is_some() {
        // One curve per length, and where a window reaches: a needle at depth d lies about
        // (1 - d) * length tokens before the answer, inside the window from d = 1 - w / length.
        let mut lines: Vec<Series> = lengths
            .iter()
            .map(|&len| {
                let pts = cells
                    .iter()
                    .filter(|c| c.1 == len)
                    .filter_map(|c| Some((c.0, c.3?)))
                    .filter(|p| p.1.is_finite())
                    .collect();
                series(format!("L={}", tick_format(1.0)(&len)), pts, true)
            })
            .collect();
        if let Some(w) = window {
            for &len in &lengths {
                let at = (1.0 - w / len).clamp(0.0, 1.0);
                lines.push(series(
                    format!("window reach, L={}", tick_format(1.0)(&len)),
                    vec![(at, 0.0), (at, 1.0)],
                    true,
                ));
            }
        }
        out.push((
            "full_ratio_vs_depth".to_string(),
            Figure::Lines {
                title: format!("Full ratio on answer tokens: {cell}"),
                x: "needle depth (0: start of the prompt, 1: its end)".into(),
                y: "full-attention ratio".into(),
                series: lines,
                x_axis: XAxis::LinearSwept,
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
        let key = |r: &Row| format!("{} lambda={}", name_of(r.method), r.lambda);
        figs.push((
            "mu_f_vs_window".into(),
            usage_and_loss(
                "Full-attention usage and quality against window",
                "window w (tokens)",
                grouped(&routed_by_window, key, |r| r.mu_f().map(|m| (r.window, m))),
                grouped(&routed_by_window, key, |r| Some((r.window, r.loss()))),
            ),
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
            usage_map(format!("Head usage mu_f: {}", r.label), m),
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
                x_axis: XAxis::Linear,
            },
        ));
    }
    let lambdas: std::collections::BTreeSet<u64> = aha.iter().map(|r| r.lambda.to_bits()).collect();
    if lambdas.len() > 1 {
        let key = |r: &Row| format!("w={}", r.window);
        figs.push((
            "lambda_ablation".into(),
            usage_and_loss(
                "Full-attention usage and quality against lambda",
                "lambda",
                grouped(&aha, key, |r| r.mu_f().map(|m| (r.lambda, m))),
                grouped(&aha, key, |r| Some((r.lambda, r.loss()))),
            ),
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
                x_axis: XAxis::Linear,
            },
        ));
    }
    for r in all
        .iter()
        .filter(|r| spec(r.method).gates == Gates::PerToken && r.kind == StageKind::Train)
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
    let curves: Vec<(bool, Series)> = train
        .iter()
        .filter_map(|r| {
            let log = log_columns(
                &sweep.join(&r.cell).join("val_log.csv"),
                &["step", "val_loss"],
            )?;
            // At the tokens behind the model, so a continuation starts where its source ended.
            let at = |step: f64| (r.start_tokens + step * r.tokens_per_step) / 1e6;
            let pts: Vec<(f64, f64)> = log.iter().map(|x| (at(x[0]), x[1])).collect();
            (pts.len() > 1).then(|| (r.start_tokens > 0.0, series(legend_name(r), pts, true)))
        })
        .collect();
    if !curves.is_empty() {
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
    // The router's learning curve (L2A Sec. 3.3: collapse): every learned router's gate
    // usage and training loss over its own steps, from `train_log.csv`.
    let logs: Vec<(&Row, Vec<Vec<f64>>)> = train
        .iter()
        .filter(|r| r.router == Router::Learned && r.mu_f().is_some())
        .filter_map(|r| {
            let path = sweep.join(&r.cell).join("train_log.csv");
            let pts = log_columns(&path, &["step", "loss", "mu_f"])?;
            (pts.len() > 1).then_some((*r, pts))
        })
        .collect();
    if !logs.is_empty() {
        let panel = |y: &str, col: usize| Panel {
            title: y.into(),
            x: "training step".into(),
            y: y.into(),
            series: sorted(
                logs.iter()
                    .map(|(r, pts)| {
                        series(
                            legend_name(r),
                            pts.iter().map(|p| (p[0], p[col])).collect(),
                            true,
                        )
                    })
                    .collect(),
            ),
            x_axis: XAxis::Linear,
        };
        figs.push((
            "router_curves".into(),
            Figure::Panels {
                title: "Routers while training".into(),
                panels: vec![panel("gates open (mu_f)", 2), panel("training loss", 1)],
            },
        ));
    }
    let buckets: Vec<&Row> = all
        .iter()
        .filter(|r| r.kind != StageKind::Prune && r.report.buckets.len() > 1)
        .collect();
    if !buckets.is_empty() {
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
    let ppa: Vec<&Row> = train
        .iter()
        .copied()
        .filter(|r| r.method == Method::Ppa)
        .collect();
    if !ppa.is_empty() {
        let by_window = |f: fn(&Row) -> Option<f64>| {
            grouped(
                &ppa,
                |r| format!("w={}", r.window),
                move |r| Some((r.ppa_power, f(r)?)),
            )
        };
        let loss = by_window(|r| Some(r.loss()));
        let accuracy = by_window(|r| r.far()?.1);
        let fig = if accuracy.iter().all(|s| s.points.is_empty()) {
            Figure::Lines {
                title: "PPA: final validation loss against p".into(),
                x: "power p".into(),
                y: "validation loss".into(),
                series: loss,
                x_axis: XAxis::LinearSwept,
            }
        } else {
            // The synthetic corpus's long-range task beside the loss (PPA Table 1's accuracy).
            let panel = |title: &str, y: &str, series| Panel {
                title: title.into(),
                x: "power p".into(),
                y: y.into(),
                series,
                x_axis: XAxis::LinearSwept,
            };
            Figure::Panels {
                title: "PPA against p".into(),
                panels: vec![
                    panel("validation loss", "loss", loss),
                    panel(
                        "recall of dependencies >= w back",
                        "exact-match accuracy",
                        accuracy,
                    ),
                ],
            }
        };
        figs.push(("ppa_s_curve".into(), fig));
    }
    for r in &all {
        let p = sweep.join(&r.cell).join("eval/probe_head_usage.csv");
        if p.is_file() {
            for (task, f) in probe_usage_maps(&p, &format!("{} {}", name_of(r.method), r.label))? {
                figs.push((format!("head_usage_{}_{task}", r.cell), f));
            }
        }
        let p = sweep.join(&r.cell).join("eval/niah.csv");
        if p.is_file() {
            // Full attention has no window to mark.
            let window = spec(r.method).windowed.then_some(r.window);
            let label = format!("{} {}", name_of(r.method), r.label);
            for (stem, f) in niah_figures(&p, &r.cell, &label, window)? {
                figs.push((format!("{stem}_{}", r.cell), f));
            }
        }
    }
    figs.extend(pareto_figures(&all));
    Ok(figs)
}

/// Per cost of `pareto::Cost`, over the comparable cells: validation loss against it, and
/// beside it long-context accuracy where the cells measured one (`pareto::accuracy`), each
/// panel with its Pareto front drawn first, so every method's markers sit over it, and the
/// front's points labelled with their settings.
fn pareto_figures(all: &[Row]) -> Vec<(String, Figure)> {
    use crate::sweep::pareto::{accuracy, Cost};
    let rows = crate::sweep::pareto::comparable(all);
    let reach = crate::sweep::pareto::reach(&rows);
    let accuracy_name = rows.iter().find_map(|r| accuracy(r, reach).map(|a| a.1));
    let mut figs = Vec::new();
    for cost in Cost::ALL {
        let mut panels = Vec::new();
        let loss = |r: &Row| Some(r.loss());
        let acc = |r: &Row| accuracy(r, reach).map(|a| a.0);
        let qualities: Vec<(&str, &dyn Fn(&Row) -> Option<f64>, bool)> = match &accuracy_name {
            Some(name) => vec![
                ("validation loss", &loss, false),
                (name.as_str(), &acc, true),
            ],
            None => vec![("validation loss", &loss, false)],
        };
        for (y, quality, higher_better) in qualities {
            let points: Vec<(&Row, (f64, f64))> = rows
                .iter()
                .filter_map(|r| Some((r, (cost.of(r)?, quality(r)?))))
                .collect();
            if points.len() < 2 {
                continue;
            }
            let sign = if higher_better { -1.0 } else { 1.0 };
            let on = crate::sweep::pareto::on_front(
                &points
                    .iter()
                    .map(|(_, (x, y))| Some((*x, sign * y)))
                    .collect::<Vec<_>>(),
            );
            let front: Vec<(f64, f64)> = points
                .iter()
                .zip(&on)
                .filter(|(_, on)| **on)
                .map(|(p, _)| p.1)
                .collect();
            let mut families: BTreeMap<String, Series> = BTreeMap::new();
            for ((r, p), on) in points.iter().zip(&on) {
                let s = families
                    .entry(crate::sweep::pareto::family(r))
                    .or_insert_with_key(|name| Series {
                        name: name.clone(),
                        points: vec![],
                        line: false,
                        labels: vec![],
                    });
                s.points.push(*p);
                // Settings beside the front's points only: the cells off it crowd together,
                // and the legend names every method (pareto.csv has each cell's settings).
                s.labels.push(match (on, crate::sweep::pareto::settings(r)) {
                    (false, _) => String::new(),
                    (true, settings) if settings.is_empty() => crate::sweep::pareto::family(r),
                    (true, settings) => settings,
                });
            }
            let mut series = vec![self::series("Pareto front".into(), front, true)];
            series.extend(sorted(families.into_values().collect()));
            panels.push(Panel {
                title: format!(
                    "{y} (front: {})",
                    if higher_better { "higher" } else { "lower" }
                ),
                x: cost.axis().into(),
                y: y.into(),
                series,
                x_axis: XAxis::Linear,
            });
        }
        if panels.is_empty() {
            continue;
        }
        let stem = match cost {
            Cost::Work => "pareto".to_string(),
            c => format!("pareto_{}", c.name()),
        };
        let title = format!("Every method against {}", cost.axis());
        let fig = match panels.len() {
            1 => {
                let p = panels.remove(0);
                Figure::Lines {
                    title,
                    x: p.x,
                    y: p.y,
                    series: p.series,
                    x_axis: p.x_axis,
                }
            }
            _ => Figure::Panels { title, panels },
        };
        figs.push((stem, fig));
    }
    figs
}

/// Renders every figure of `sweep` into `out/figures/` and writes the tables into `out`.
pub fn write_all(sweep: &Path, out: &Path) -> Result<Vec<PathBuf>> {
    let mut written = crate::sweep::tables::write_all(sweep, out)?;
    let dir = out.join("figures");
    crate::util::atomic::ensure_writable_dir(&dir)?;
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
        let size = f.size();
        let mut buf = vec![0u8; (size.0 * size.1 * 3) as usize];
        f.draw(&BitMapBackend::with_buffer(&mut buf, size).into_drawing_area())
            .unwrap();
        let ink = buf.chunks(3).filter(|p| p != &[255, 255, 255]).count();
        let mut svg = String::new();
        f.draw(&SVGBackend::with_string(&mut svg, size).into_drawing_area())
            .unwrap();
        (ink, svg)
    }

    /// The text of the SVG's `<text>` elements, in order.
    fn texts(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| {
                Some(
                    t.split_once('>')?
                        .1
                        .split_once("</text>")?
                        .0
                        .trim()
                        .to_string(),
                )
            })
            .collect()
    }

    #[test]
    fn swept_values_label_the_axis_and_the_legend_sits_beside_the_data_in_order() {
        let f = Figure::Lines {
            title: "usage".into(),
            x: "window w".into(),
            y: "mu_f".into(),
            series: grouped_fixture(),
            x_axis: XAxis::LogSwept,
        };
        let (_, svg) = render(&f);
        let t = texts(&svg);
        for w in ["4", "8", "16", "32", "64", "128"] {
            assert!(t.iter().any(|x| x == w), "tick {w} missing: {t:?}");
        }
        // The legend lists w=16 before w=128 (by value, not as text), and lies right of the
        // plotting area: every legend text starts beyond the chart's width.
        let pos = |name: &str| t.iter().position(|x| x == name).unwrap();
        assert!(pos("lambda=0.0003") < pos("lambda=0.001"), "{t:?}");
        let x_of = |name: &str| -> f64 {
            let at = svg.find(&format!("\n{name}\n</text>")).unwrap();
            let open = svg[..at].rfind("<text").unwrap();
            let attrs = &svg[open..at];
            let x = attrs
                .split("x=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap();
            x.parse().unwrap()
        };
        assert!(x_of("lambda=0.001") > (SIZE.0 - LEGEND_W) as f64);
    }

    fn grouped_fixture() -> Vec<Series> {
        sorted(vec![
            series(
                "lambda=0.001".into(),
                vec![(4.0, 0.9), (16.0, 0.6), (64.0, 0.3)],
                true,
            ),
            series(
                "lambda=0.0003".into(),
                vec![(8.0, 0.95), (32.0, 0.7), (128.0, 0.5)],
                true,
            ),
        ])
    }

    /// Swept ticks show the swept values themselves: PPA's eighths, lambdas, windows.
    #[test]
    fn swept_ticks_print_each_value_exactly() {
        let label = |xs: &[f64]| {
            let f = tick_format(min_gap(xs).min(exact_step(xs)));
            xs.iter().map(|x| f(x)).collect::<Vec<String>>()
        };
        let p: Vec<f64> = (0..=8).map(|i| i as f64 / 8.0).collect();
        assert_eq!(
            label(&p),
            ["0", "0.125", "0.25", "0.375", "0.5", "0.625", "0.75", "0.875", "1"]
        );
        assert_eq!(label(&[16.0, 64.0, 256.0]), ["16", "64", "256"]);
        assert_eq!(label(&[1e-4, 3e-4, 1e-3]), ["0.0001", "0.0003", "0.001"]);
    }

    #[test]
    fn narrow_ranges_never_repeat_a_tick_label() {
        let f = tick_format((2.3459 - 2.3451) / 10.0);
        let labels: Vec<String> = (0..9).map(|i| f(&(2.3451 + 1e-4 * i as f64))).collect();
        let mut unique = labels.clone();
        unique.dedup();
        assert_eq!(unique.len(), labels.len(), "{labels:?}");
        assert_eq!(tick_format(1.0)(&16.0), "16");
        assert_eq!(tick_format(0.1)(&0.5), "0.5");
    }

    #[test]
    fn names_sort_by_the_numbers_in_them() {
        let mut v = vec![
            "w=128",
            "w=16",
            "aha lambda=1e-3",
            "aha lambda=3e-4",
            "w=16 p=0.5",
        ];
        v.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            v,
            [
                "aha lambda=3e-4",
                "aha lambda=1e-3",
                "w=16",
                "w=16 p=0.5",
                "w=128"
            ]
        );
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
                x_axis: XAxis::LogSwept,
            },
            Figure::Heatmap {
                title: "heads".into(),
                x: "head".into(),
                y: "layer".into(),
                values: vec![vec![0.1, 0.9], vec![0.5, 0.3]],
                range: (0.0, 1.0),
                x_ticks: vec![],
                y_ticks: vec![],
            },
            Figure::Bars {
                title: "sparsity".into(),
                x: "layer".into(),
                y: "sparsity".into(),
                bars: vec![("0".into(), 0.2), ("1".into(), 0.96)],
            },
            usage_and_loss(
                "usage and loss",
                "window w",
                grouped_fixture(),
                grouped_fixture(),
            ),
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
                Figure::Panels { panels, .. } => (&panels[1].x, &panels[1].y),
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
        let dir = crate::sweep::tables::fixture::sweep_dir("plots");
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
            "loss_curves",
            "bucket_loss",
            "ppa_s_curve",
            "pareto",
            "pareto_time",
            "pareto_memory",
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
    fn probe_head_usage_gives_a_map_per_task() {
        let dir = std::env::temp_dir().join(format!("attnsweep-probe-map-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("probe_head_usage.csv");
        std::fs::write(&p, "task,layer,head,mu_f\npasskey,0,0,0.5\npasskey,0,1,1.0\npasskey,1,0,0.0\npasskey,1,1,0.25\nniah_single,0,0,1.0\nniah_single,0,1,0.0\nniah_single,1,0,0.5\nniah_single,1,1,0.5\n").unwrap();
        let maps = probe_usage_maps(&p, "aha").unwrap();
        let names: Vec<&str> = maps.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(names, ["niah_single", "passkey"]);
        match &maps[1].1 {
            Figure::Heatmap { values, range, .. } => {
                assert_eq!(values, &vec![vec![0.5, 1.0], vec![0.0, 0.25]]);
                assert_eq!(*range, (0.0, 1.0));
            }
            _ => panic!("heatmap expected"),
        }
        std::fs::write(&p, "task,layer,head,mu_f\npasskey,0,x,0.5\n").unwrap();
        let e = probe_usage_maps(&p, "aha").err().unwrap().to_string();
        assert!(e.contains("row 2 needs task,layer,head,mu_f"), "{e}");
    }

    #[test]
    fn niah_csv_gives_heatmap_and_depth_curve() {
        let dir = std::env::temp_dir().join(format!("attnsweep-niah-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("niah.csv");
        std::fs::write(&p, "depth,length,accuracy,full_ratio\n0.0,64,1.0,0.2\n0.5,64,0.5,0.4\n0.0,128,0.8,0.3\n0.5,128,0.2,0.5\n").unwrap();
        let figs = niah_figures(&p, "c", "m", Some(32.0)).unwrap();
        assert_eq!(figs.len(), 2);
        match &figs[0].1 {
            Figure::Heatmap {
                values,
                x_ticks,
                y_ticks,
                ..
            } => {
                assert_eq!(values, &vec![vec![1.0, 0.8], vec![0.5, 0.2]]);
                // The axes name the lengths and depths, not their indices.
                assert_eq!(
                    (x_ticks.as_slice(), y_ticks.as_slice()),
                    (
                        &["64".to_string(), "128".into()][..],
                        &["0".to_string(), "0.5".into()][..]
                    )
                );
                assert_eq!(cell_label(1.5, x_ticks), "128");
                assert_eq!(cell_label(1.0, x_ticks), "");
            }
            _ => panic!("heatmap expected"),
        }
        match &figs[1].1 {
            Figure::Lines { series, .. } => {
                assert_eq!(series[0].points, vec![(0.0, 0.2), (0.5, 0.4)]);
                assert_eq!(series[1].points, vec![(0.0, 0.3), (0.5, 0.5)]);
                // A 32-token window reaches a needle from depth 0.5 of 64 tokens, 0.75 of 128.
                assert_eq!(series[2].name, "window reach, L=64");
                assert_eq!(series[2].points, vec![(0.5, 0.0), (0.5, 1.0)]);
                assert_eq!(series[3].points, vec![(0.75, 0.0), (0.75, 1.0)]);
            }
            _ => panic!("lines expected"),
        }
        for (_, f) in &figs {
            assert!(render(f).0 > 5_000);
        }
    }
}
