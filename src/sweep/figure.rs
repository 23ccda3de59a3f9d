//! Figures as data (`Figure`: lines, panels, heatmaps, bars) and their rendering to PNG and
//! SVG. Text is drawn with a font compiled into the binary (DejaVu Sans), so plotting needs no
//! system fonts and works headless.

use super::axes::{bounds, cell_label, exact_step, min_gap, tick_format, Swept};
use crate::util::atomic;
use anyhow::{anyhow, Result};
use plotters::coord::combinators::LogCoord;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontStyle;
use std::path::{Path, PathBuf};

static FONT: &[u8] = include_bytes!("fonts/DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";
pub(crate) const SIZE: (u32, u32) = (900, 560);

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
#[derive(Clone)]
pub(crate) struct Series {
    pub(crate) name: String,
    pub(crate) points: Vec<(f64, f64)>,
    pub(crate) line: bool,
    /// Text drawn beside each point (same length as `points`), e.g. tau values.
    pub(crate) labels: Vec<String>,
    /// The 95 % interval (low, high) of each point that is a mean of replicates, drawn as an
    /// error bar (same length as `points`, NaN where a point is one measurement; empty: none).
    pub(crate) errors: Vec<(f64, f64)>,
    pub(crate) look: Look,
}

/// How a series is drawn: by its place in the chart (colours and markers cycle), or as its
/// maker chose, so that series sharing a colour read as one thing done two ways (a method
/// run by us and by a peer: the colour the method's, the marker and dashes the
/// implementation's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Look {
    #[default]
    ByPlace,
    Chosen {
        /// Index into the palette.
        colour: usize,
        /// Index into the marker shapes.
        shape: usize,
        hollow: bool,
        dashed: bool,
    },
}

impl Look {
    /// The colour, shape, hollowness and dashes of series `i` drawn this way.
    fn resolve(self, i: usize) -> (RGBColor, usize, bool, bool) {
        match self {
            Look::ByPlace => (PALETTE[i % PALETTE.len()], i % 5, i % 2 == 1, false),
            Look::Chosen {
                colour,
                shape,
                hollow,
                dashed,
            } => (PALETTE[colour % PALETTE.len()], shape % 5, hollow, dashed),
        }
    }
}

/// One x-y chart of a [`Figure::Panels`].
pub(crate) struct Panel {
    pub(crate) title: String,
    pub(crate) x: String,
    pub(crate) y: String,
    pub(crate) series: Vec<Series>,
    pub(crate) x_axis: XAxis,
}

/// How a chart's x axis is scaled and where its ticks go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum XAxis {
    /// Linear, ticks at round numbers: measured values (steps, attention work).
    Linear,
    /// Linear, ticks at the values a sweep set (PPA's p, needle depth) when there are few.
    LinearSwept,
    /// Log scale, ticks at the values a sweep set (windows, lambdas, distances).
    LogSwept,
    /// `LogSwept` for counts in the millions or more (training tokens), each tick written in
    /// three significant digits with its unit (2.1M, 20.1M, 200M).
    LogCounts,
}

/// What a figure is drawn from; `draw` renders it on any plotters backend.
pub(crate) enum Figure {
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

/// Line and marker colours: Okabe and Ito's colour-blind-safe palette without its yellow,
/// which is hard to see on white, then Paul Tol's indigo, wine, olive, green and rose and a
/// mid grey, so that a chart of up to thirteen series (a Pareto chart's front, its references
/// and eleven families of methods) gives each its own colour.
const PALETTE: [RGBColor; 13] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(230, 159, 0),
    RGBColor(0, 0, 0),
    RGBColor(51, 34, 136),
    RGBColor(136, 34, 85),
    RGBColor(153, 153, 51),
    RGBColor(34, 136, 51),
    RGBColor(238, 102, 119),
    RGBColor(119, 119, 119),
];

/// Markers drawn along one line at most.
const MARKERS_PER_LINE: usize = 24;

/// Width of the legend panel beside a chart, at least: room for 30 characters. A legend of
/// longer names is as wide as its longest (`legend_width`): names are never cut, since two
/// series cut to one string could not be told apart.
const LEGEND_W: u32 = 300;

/// Pixels of a heatmap's colour bar, right of its cells.
const HEAT_BAR: u32 = 110;

/// Pixels of a figure's title, and of a single chart's (which sits above its legend's column).
const TITLE_FONT: u32 = 22;
const CHART_TITLE_FONT: u32 = 20;

/// A generous width in pixels of `text` set in the figures' sans-serif at `font` pixels: an
/// average character is about half the font's size wide, capitals and 'm' more.
fn title_width(text: &str, font: u32) -> u32 {
    text.chars().count() as u32 * font * 11 / 20
}

/// Pixels of the legend of `series`: the marker's column and the longest name at the
/// legend's font (about 8 pixels a character).
fn legend_width<'a>(series: impl IntoIterator<Item = &'a Series>) -> u32 {
    let longest = series
        .into_iter()
        .map(|s| s.name.chars().count())
        .max()
        .unwrap_or(0);
    LEGEND_W.max(56 + 8 * longest as u32)
}

/// The series a figure of panels lists in its one legend: the first panel's, then those of
/// later panels not named yet (a reference line drawn in one panel only).
fn panels_legend(panels: &[Panel]) -> Vec<&Series> {
    let mut out: Vec<&Series> = Vec::new();
    for p in panels {
        for s in &p.series {
            if !out.iter().any(|o| o.name == s.name) {
                out.push(s);
            }
        }
    }
    out
}

/// A panel's series drawn as the shared legend lists them: one placed by its order in the
/// panel takes its legend entry's look (the entry's chosen one, else that of its place in the
/// legend), so a series that only some panels have keeps its legend entry's colour and marker.
fn looks_of_legend(series: &[Series], legend: &[&Series]) -> Vec<Series> {
    series
        .iter()
        .map(|s| {
            let mut s = s.clone();
            let entry = legend.iter().position(|l| l.name == s.name);
            if let (Look::ByPlace, Some(i)) = (s.look, entry) {
                s.look = match legend[i].look {
                    chosen @ Look::Chosen { .. } => chosen,
                    Look::ByPlace => Look::Chosen {
                        colour: i,
                        shape: i,
                        hollow: i % 2 == 1,
                        dashed: false,
                    },
                };
            }
            s
        })
        .collect()
}

/// The marker of series `i` drawn with `look`; by place, colours cycle through 7, shapes
/// through 5 (35 distinct), and every other series is hollow and larger, so coinciding points
/// of two series both show.
fn marker<'a, DB: DrawingBackend + 'a, C: Clone + 'a>(
    i: usize,
    look: Look,
    p: C,
) -> DynElement<'a, DB, C> {
    let (c, shape, hollow, _) = look.resolve(i);
    let size = if hollow { 7 } else { 5 };
    let style = if hollow {
        c.stroke_width(2)
    } else {
        c.filled()
    };
    let at = EmptyElement::at(p);
    match shape {
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

/// Distinct x values up to which the x axis is labelled at exactly those values (a sweep's
/// windows, powers, lambdas) rather than at round numbers.
const SWEPT_TICKS: usize = 12;

/// The x values of every series, when there are few enough to label each one; vertical
/// markers (several points at one x, such as a window's reach) are not swept values, unless
/// no series varies. A lone point is (a setting run once beside a sweep of others).
fn swept_values(series: &[Series]) -> Option<Vec<f64>> {
    let marker = |s: &&Series| s.points.len() > 1 && s.points.iter().all(|p| p.0 == s.points[0].0);
    let mut xs: Vec<f64> = series
        .iter()
        .filter(|s| !marker(s))
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .filter(|v| v.is_finite())
        .collect();
    if xs.is_empty() {
        // No series varies (one length measured): its value still gets its tick.
        xs = series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .filter(|v| v.is_finite())
            .collect();
    }
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    (!xs.is_empty() && xs.len() <= SWEPT_TICKS).then_some(xs)
}

/// A line chart's y range (every error bar inside it), the swept x values it labels where
/// its axis names them, and its tick formats.
struct LineAxes {
    y: (f64, f64),
    swept: Option<Vec<f64>>,
    x_fmt: Box<dyn Fn(&f64) -> String>,
    y_fmt: Box<dyn Fn(&f64) -> String>,
}

fn line_axes(series: &[Series], x_axis: XAxis) -> LineAxes {
    let (y0, y1) = bounds(series.iter().flat_map(|s| {
        s.points.iter().enumerate().flat_map(|(i, p)| {
            let (lo, hi) = s
                .errors
                .get(i)
                .copied()
                .filter(|e| e.0.is_finite() && e.1.is_finite())
                .unwrap_or((p.1, p.1));
            [p.1.min(lo), p.1.max(hi)]
        })
    }));
    let swept = match x_axis {
        XAxis::Linear => None,
        XAxis::LinearSwept | XAxis::LogSwept | XAxis::LogCounts => swept_values(series),
    };
    let x_step = match &swept {
        // Each swept value printed exactly (0.125, not 0.1), and neighbours apart.
        Some(xs) => min_gap(xs).min(exact_step(xs)),
        None => {
            let (a, b) = bounds(series.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
            (b - a) / 10.0
        }
    };
    // Swept whole numbers (lengths of 131072 tokens) printed whole, never rounded to 1.3e5.
    let whole = swept
        .as_ref()
        .is_some_and(|xs| xs.iter().all(|v| v.fract() == 0.0 && v.abs() < 1e15));
    let round = tick_format(x_step);
    LineAxes {
        y: (y0, y1),
        swept,
        x_fmt: Box::new(move |v: &f64| match (x_axis, whole && v.fract() == 0.0) {
            (XAxis::LogCounts, _) => short_count(*v),
            (_, true) => format!("{}", *v as i64),
            (_, false) => round(v),
        }),
        y_fmt: Box::new(tick_format((y1 - y0) / 10.0)),
    }
}

/// A count in three significant digits with its unit: 2097152 as 2.1M, 20054016 as 20.1M,
/// 999 as 999.
pub(crate) fn short_count(v: f64) -> String {
    let (scaled, unit) = match v.abs() {
        a if a >= 1e9 => (v / 1e9, "G"),
        a if a >= 1e6 => (v / 1e6, "M"),
        a if a >= 1e3 => (v / 1e3, "k"),
        _ => (v, ""),
    };
    let digits = match scaled.abs() {
        a if a >= 100.0 => 0,
        a if a >= 10.0 => 1,
        _ => 2,
    };
    let text = format!("{scaled:.digits$}");
    let text = match text.contains('.') {
        true => text.trim_end_matches('0').trim_end_matches('.').to_string(),
        false => text,
    };
    format!("{text}{unit}")
}

/// Draws point label `l` beside its marker at pixel `(px, py)` of the whole image, clear of
/// it, on the marker's left where it would run past the plot's right edge (`right`); a label
/// that would overlap one already `placed` (pixel boxes: left, baseline, width) is left out
/// (the tables have every cell's settings).
fn place_label<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    placed: &mut Vec<(i32, i32, i32)>,
    l: &str,
    (px, py): (i32, i32),
    right: i32,
) -> Result<()> {
    let w = 7 * l.chars().count() as i32;
    let gap = 9;
    let flip = px + gap + w > right;
    let left = if flip { px - gap - w } else { px + gap };
    let overlaps = placed
        .iter()
        .any(|&(x, y, pw)| (py - y).abs() < 15 && left < x + pw && x < left + w);
    if overlaps {
        return Ok(());
    }
    placed.push((left, py, w));
    let (anchor, x) = match flip {
        true => (HPos::Right, px - gap),
        false => (HPos::Left, px + gap),
    };
    let style = TextStyle::from((FAMILY, 13).into_font()).pos(Pos::new(anchor, VPos::Center));
    // In the panel's own pixels (backend_coord is the whole image's).
    let (bx, by) = root.get_base_pixel();
    root.draw(&Text::new(l.to_string(), (x - bx, py - by), style))
        .map_err(err)
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
    let LineAxes {
        y: (y0, y1),
        swept,
        x_fmt,
        y_fmt,
    } = line_axes(series, x_axis);
    let mut builder = ChartBuilder::on(root);
    builder
        .caption(title, text(CHART_TITLE_FONT))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72);
    // One body for the four axis kinds; only the coordinate type differs.
    macro_rules! body {
        ($xr:expr) => {{
            let mut chart = builder.build_cartesian_2d($xr, y0..y1).map_err(err)?;
            // Pixel boxes (left, baseline, width) of the point labels drawn so far: a label that
            // would overlap one is left out (the tables have every cell's settings).
            let mut placed: Vec<(i32, i32, i32)> = Vec::new();
            chart
                .configure_mesh()
                .x_desc(x)
                .y_desc(y)
                .axis_desc_style(text(16))
                .label_style(text(14))
                .x_label_formatter(&|v: &f64| x_fmt(v))
                .y_label_formatter(&|v: &f64| y_fmt(v))
                .light_line_style(WHITE.mix(0.0))
                .draw()
                .map_err(err)?;
            for (i, s) in series.iter().enumerate() {
                let (c, _, _, dashed) = s.look.resolve(i);
                match (s.line, dashed) {
                    (true, false) => {
                        chart
                            .draw_series(LineSeries::new(s.points.clone(), c.stroke_width(2)))
                            .map_err(err)?;
                    }
                    (true, true) => {
                        chart
                            .draw_series(DashedLineSeries::new(
                                s.points.clone(),
                                8,
                                5,
                                c.stroke_width(2),
                            ))
                            .map_err(err)?;
                    }
                    (false, _) => {}
                }
                // Error bars (95 % intervals of replicated means), under the markers.
                for (&(px, _), &(lo, hi)) in s.points.iter().zip(&s.errors) {
                    if lo.is_finite() && hi.is_finite() {
                        chart
                            .draw_series(std::iter::once(PathElement::new(
                                vec![(px, lo), (px, hi)],
                                c.stroke_width(2),
                            )))
                            .map_err(err)?;
                    }
                }
                // One draw per marker: the shapes differ in type. A line of many points (heads
                // by rank) shows every `stride`-th, so the markers name the line, not hide it.
                let stride = match s.line {
                    true => s.points.len().div_ceil(MARKERS_PER_LINE).max(1),
                    false => 1,
                };
                for &p in s.points.iter().step_by(stride) {
                    chart
                        .plotting_area()
                        .draw(&marker(i, s.look, p))
                        .map_err(err)?;
                }
                for (&p, l) in s.points.iter().zip(&s.labels) {
                    if !l.is_empty() {
                        let right = chart.plotting_area().get_pixel_range().0.end;
                        place_label(root, &mut placed, l, chart.backend_coord(&p), right)?;
                    }
                }
            }
        }};
    }
    let finite_x = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .filter(|v| v.is_finite());
    if matches!(x_axis, XAxis::LogSwept | XAxis::LogCounts) {
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
    draw_legend_of(area, &series.iter().collect::<Vec<_>>())
}

fn draw_legend_of<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    series: &[&Series],
) -> Result<()> {
    let text = (FAMILY, 14).into_font();
    let (_, h) = area.dim_in_pixel();
    let row = 22i32;
    let fits = ((h as i32 - 70) / row).max(1) as usize;
    for (i, s) in series.iter().enumerate().take(fits) {
        let y = 60 + i as i32 * row;
        let (c, _, _, dashed) = s.look.resolve(i);
        if s.line {
            // A dashed line's sample: two dashes with a gap.
            let segments = match dashed {
                true => vec![(4, 16), (24, 36)],
                false => vec![(4, 36)],
            };
            for (a, b) in segments {
                area.draw(&PathElement::new(vec![(a, y), (b, y)], c.stroke_width(2)))
                    .map_err(err)?;
            }
        }
        area.draw(&marker::<DB, (i32, i32)>(i, s.look, (20, y)))
            .map_err(err)?;
        area.draw(&Text::new(s.name.clone(), (44, y - 8), text.clone()))
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
    #[cfg(test)]
    pub(crate) fn title(&self) -> &str {
        match self {
            Figure::Lines { title, .. }
            | Figure::Heatmap { title, .. }
            | Figure::Panels { title, .. }
            | Figure::Bars { title, .. } => title,
        }
    }

    pub(crate) fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
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
                    let (chart, legend) =
                        root.split_horizontally(w.saturating_sub(legend_width(series)));
                    draw_lines(&chart, title, x, y, series, *x_axis)?;
                    draw_legend(&legend, series)?;
                } else {
                    draw_lines(root, title, x, y, series, *x_axis)?;
                }
            }
            Figure::Panels { title, panels } => {
                // Side by side over the same series, so one legend serves.
                let listed = panels_legend(panels);
                let (w, _) = root.dim_in_pixel();
                let width = Self::panels_legend_width(panels);
                let (body, legend) = root.split_horizontally(w.saturating_sub(width));
                let body = body.titled(title, text(TITLE_FONT)).map_err(err)?;
                let areas = body.split_evenly((1, panels.len().max(1)));
                for (area, p) in areas.iter().zip(panels) {
                    let series = looks_of_legend(&p.series, &listed);
                    draw_lines(area, &p.title, &p.x, &p.y, &series, p.x_axis)?;
                }
                if listed.len() > 1 || listed.iter().any(|s| !s.name.is_empty()) {
                    draw_legend_of(&legend, &listed)?;
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
                let (main, bar) = root.split_horizontally(w.saturating_sub(HEAT_BAR));
                let rows = values.len() as f64;
                let cols = values.first().map_or(0, |r| r.len()) as f64;
                let mut chart = ChartBuilder::on(&main)
                    .caption(title, text(TITLE_FONT))
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
                    .caption(title, text(TITLE_FONT))
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

    /// The figure drawn in memory: `size()`'s pixels, 3 bytes (RGB) each.
    pub(crate) fn rgb(&self) -> Result<Vec<u8>> {
        let size = self.size();
        let mut rgb = vec![0u8; size.0 as usize * size.1 as usize * 3];
        self.draw(&BitMapBackend::with_buffer(&mut rgb, size).into_drawing_area())?;
        Ok(rgb)
    }

    /// Pixels of the figure: wide enough for its panels side by side, its legend's longest
    /// name and its title (a title wider than the area it is centred on is cut at both edges).
    pub(crate) fn size(&self) -> (u32, u32) {
        let fits = |width: u32, title: &str, font: u32| width.max(title_width(title, font) + 48);
        match self {
            Figure::Panels { panels, title } => (
                Self::panels_legend_width(panels)
                    + fits(560 * panels.len() as u32, title, TITLE_FONT),
                SIZE.1,
            ),
            Figure::Lines { series, title, .. } => (
                fits(SIZE.0 - LEGEND_W, title, CHART_TITLE_FONT) + legend_width(series),
                SIZE.1,
            ),
            // A heatmap's title is centred left of its colour bar.
            Figure::Heatmap { title, .. } => (
                fits(SIZE.0 - HEAT_BAR, title, TITLE_FONT) + HEAT_BAR,
                SIZE.1,
            ),
            Figure::Bars { title, .. } => (fits(SIZE.0, title, TITLE_FONT), SIZE.1),
        }
    }

    fn panels_legend_width(panels: &[Panel]) -> u32 {
        legend_width(panels_legend(panels))
    }

    /// Writes `<stem>.png` and `<stem>.svg`. The PNG is drawn in memory and encoded at the
    /// best compression with adaptive filters: the bitmap backend's own file encoder
    /// compresses fast, and committed figures came out about twice as large.
    pub(crate) fn save(&self, stem: &Path) -> Result<Vec<PathBuf>> {
        use image::codecs::png::{CompressionType, FilterType, PngEncoder};
        use image::ImageEncoder;
        let png = stem.with_extension("png");
        let svg = stem.with_extension("svg");
        let size = self.size();
        let rgb = self.rgb()?;
        // Encoded whole in memory: the encoder writes its last chunk when dropped, where a
        // file's write error would be lost.
        let mut encoded = Vec::new();
        PngEncoder::new_with_quality(&mut encoded, CompressionType::Best, FilterType::Adaptive)
            .write_image(&rgb, size.0, size.1, image::ColorType::Rgb8)?;
        atomic::write_with(&png, |tmp| Ok(std::fs::write(tmp, &encoded)?))?;
        atomic::write_with(&svg, |tmp| {
            self.draw(&SVGBackend::new(tmp, size).into_drawing_area())
        })?;
        Ok(vec![png, svg])
    }
}

pub(super) fn series(name: String, mut points: Vec<(f64, f64)>, line: bool) -> Series {
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    Series {
        name,
        points,
        line,
        labels: vec![],
        errors: vec![],
        look: Look::ByPlace,
    }
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
pub(super) fn sorted(mut series: Vec<Series>) -> Vec<Series> {
    series.sort_by(|a, b| natural_cmp(&a.name, &b.name));
    series
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Renders into memory: (pixels that are not the white background, the SVG text).
    pub(in crate::sweep) fn render(f: &Figure) -> (usize, String) {
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

    /// Panels with different series: each series is drawn in the look of its entry in the
    /// one legend (its place there, not in its own panel); a chosen look stays.
    #[test]
    fn panel_series_take_their_legend_entry_look() {
        let line = |name: &str| series(name.into(), vec![(0.0, 1.0), (1.0, 2.0)], true);
        let chosen = Look::Chosen {
            colour: 9,
            shape: 2,
            hollow: false,
            dashed: true,
        };
        let mut kept = line("chosen");
        kept.look = chosen;
        let mut first_b = line("b");
        first_b.look = chosen;
        let panels = [vec![line("a"), first_b], vec![line("c"), kept, line("b")]];
        let panels: Vec<Panel> = panels
            .into_iter()
            .map(|series| Panel {
                title: "t".into(),
                x: "x".into(),
                y: "y".into(),
                series,
                x_axis: XAxis::Linear,
            })
            .collect();
        let legend = panels_legend(&panels);
        let drawn = looks_of_legend(&panels[1].series, &legend);
        // "c" is the legend's third entry but its panel's first.
        assert_eq!(drawn[0].look.resolve(0), Look::ByPlace.resolve(2));
        assert_ne!(drawn[0].look.resolve(0), Look::ByPlace.resolve(0));
        assert_eq!(drawn[1].look, chosen);
        // "b" is placed by order in the second panel but chosen in its legend entry.
        assert_eq!(drawn[2].look, chosen);
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

    /// Token budgets are written short, at three significant digits.
    #[test]
    fn counts_are_written_short() {
        let cases = [
            (2_097_152.0, "2.1M"),
            (20_054_016.0, "20.1M"),
            (200_015_872.0, "200M"),
            (1_500.0, "1.5k"),
            (999.0, "999"),
            (2.5e9, "2.5G"),
        ];
        for (v, text) in cases {
            assert_eq!(short_count(v), text, "{v}");
        }
    }

    #[test]
    fn long_lengths_are_labelled_whole_and_a_single_length_gets_its_tick() {
        let line = |xs: &[f64]| Figure::Lines {
            title: "tokens/s".into(),
            x: "L".into(),
            y: "tokens/s".into(),
            series: vec![series(
                "ours full".into(),
                xs.iter().map(|&x| (x, 1e4 * 8192.0 / x)).collect(),
                true,
            )],
            x_axis: XAxis::LogSwept,
        };
        let t = texts(&render(&line(&[8192.0, 32768.0, 131072.0])).1);
        for l in ["8192", "32768", "131072"] {
            assert!(t.iter().any(|x| x == l), "tick {l} missing: {t:?}");
        }
        assert!(!t.iter().any(|x| x.contains("e5")), "{t:?}");
        let t = texts(&render(&line(&[4096.0])).1);
        assert!(t.iter().any(|x| x == "4096"), "{t:?}");
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

    /// Point labels sit right of their marker, clear of it; one that would run past the
    /// plot's right edge ends left of its marker instead (anchored at its end), in the second
    /// panel of a panel figure as in the first.
    #[test]
    fn point_labels_clear_their_marker_and_the_plot_edge() {
        let mut s = series("m".into(), vec![(0.0, 0.0), (1.0, 1.0)], false);
        s.labels = vec!["left-end".into(), "right-end".into()];
        let panel = |title: &str| Panel {
            title: title.into(),
            x: "x".into(),
            y: "y".into(),
            series: vec![s.clone()],
            x_axis: XAxis::Linear,
        };
        let f = Figure::Panels {
            title: "labels".into(),
            panels: vec![panel("one"), panel("two")],
        };
        let (_, svg) = render(&f);
        // Each label's <text> attributes, in drawing order (first panel, then second).
        let attrs = |name: &str| -> Vec<String> {
            svg.match_indices(&format!("\n{name}\n</text>"))
                .map(|(at, _)| svg[svg[..at].rfind("<text").unwrap()..at].to_string())
                .collect()
        };
        let x = |a: &str| -> f64 {
            a.split("x=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        };
        let (left, right) = (attrs("left-end"), attrs("right-end"));
        assert_eq!((left.len(), right.len()), (2, 2), "{svg}");
        for (l, r) in left.iter().zip(&right) {
            assert!(!l.contains("text-anchor=\"end\""), "{l}");
            assert!(r.contains("text-anchor=\"end\""), "{r}");
        }
        // The second panel's labels lie in its own area: right of the first panel's.
        assert!(x(&left[0]) < x(&right[0]), "{left:?} {right:?}");
        assert!(x(&right[0]) < x(&left[1]), "{left:?} {right:?}");
        assert!(x(&left[1]) < x(&right[1]), "{left:?} {right:?}");
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
    fn values_apart_only_by_rounding_span_a_labelled_axis() {
        // Two means of the same scores, summed in another order: one value, padded as one.
        let (lo, hi) = bounds([0.4075, 0.40750000000000003].into_iter());
        assert!(lo < 0.35 && hi > 0.45, "{lo} {hi}");
        let (lo, hi) = bounds([1.0, 1.001].into_iter());
        assert!(lo < 1.0 && hi > 1.001 && hi - lo < 0.002, "{lo} {hi}");
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
            Figure::Panels {
                title: "usage and loss".into(),
                panels: ["mu_f", "validation loss"]
                    .into_iter()
                    .map(|y| Panel {
                        title: y.into(),
                        x: "window w, log scale".into(),
                        y: y.into(),
                        series: grouped_fixture(),
                        x_axis: XAxis::LogSwept,
                    })
                    .collect(),
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
    fn a_long_title_widens_its_figure() {
        // Wider than every figure's own area (900 pixels at most).
        let title =
            "Needle-in-a-haystack accuracy by depth and length: aha train.router_lr_mult=458.0 \
                     train.seed=1 train.steps=16 train.warmup_steps=1";
        let mut figs = fixtures();
        for f in &mut figs {
            match f {
                Figure::Lines { title: t, .. }
                | Figure::Heatmap { title: t, .. }
                | Figure::Bars { title: t, .. }
                | Figure::Panels { title: t, .. } => *t = title.into(),
            }
            // The area the title is centred on, and the title's font there.
            let (beside, font) = match &*f {
                Figure::Lines { series, .. } => (legend_width(series), CHART_TITLE_FONT),
                Figure::Panels { panels, .. } => (Figure::panels_legend_width(panels), TITLE_FONT),
                Figure::Heatmap { .. } => (HEAT_BAR, TITLE_FONT),
                Figure::Bars { .. } => (0, TITLE_FONT),
            };
            let (w, _) = f.size();
            assert!(
                w - beside >= title_width(title, font),
                "{w} for {:?}",
                f.title()
            );
            assert!(render(f).0 > 5_000);
        }
    }

    #[test]
    fn saved_png_has_the_right_size() {
        let dir = std::env::temp_dir().join(format!("attnsweep-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fig = fixtures().remove(0);
        let files = fig.save(&dir.join("f")).unwrap();
        let png = std::fs::read(&files[0]).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        let be = |o: usize| u32::from_be_bytes(png[o..o + 4].try_into().unwrap());
        assert_eq!((be(16), be(20)), SIZE);
        // The file decodes whole to the pixels the figure draws.
        let drawn = fig.rgb().unwrap();
        let decoded = image::load_from_memory(&png).unwrap().into_rgb8();
        assert_eq!(decoded.dimensions(), SIZE);
        assert!(
            decoded.into_raw() == drawn,
            "the PNG's pixels differ from the drawing"
        );
        assert!(std::fs::read_to_string(&files[1])
            .unwrap()
            .starts_with("<svg"));
    }
}
