//! Tests of the figures: grouping, references, every figure of a fixture sweep rendered.

use super::cells::{niah_figures, probe_usage_maps};
use super::gates::usage_and_loss;
use super::series::{full_reference, grouped, with_reference};
use super::*;
use crate::model::attention::spec;
use crate::sweep::axes::cell_label;
use crate::sweep::cell_files;
use crate::sweep::figure::tests::render;
use crate::sweep::figure::{Figure, XAxis};
use crate::sweep::fixture;

const WINDOW: &str = "attention.window";

/// `grouped` of `rows` as one line over the window: each cell's loss at its window.
fn along_window(rows: &[&Row]) -> Vec<crate::sweep::figure::Series> {
    grouped(
        rows,
        WINDOW,
        |_| "aha".into(),
        |r| Some((r.window, r.loss())),
        None,
    )
}

/// The settings a label names, as a row holds them.
fn varied(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Replicates of one setting at one x become their mean with Student's 95 % interval as
/// an error bar; another setting at the same x stays its own point, without one; the
/// chart with error bars renders.
#[test]
fn replicates_become_a_mean_with_an_error_bar() {
    let dir = fixture::sweep_dir("replicate-points");
    let all = rows(&dir).unwrap().rows;
    let with = |cell: &str, settings: &[(&str, &str)], loss: f64| {
        let mut r = all[0].clone();
        r.cell = cell.into();
        r.varied = varied(settings);
        r.report.loss = loss;
        r
    };
    let (a, b, c) = (
        with("a", &[(WINDOW, "8"), ("train.seed", "1")], 1.0),
        with("b", &[(WINDOW, "8"), ("train.seed", "2")], 1.2),
        with("c", &[(WINDOW, "4")], 3.0),
    );
    let s = grouped(
        &[&a, &b, &c],
        WINDOW,
        |_| "s".into(),
        |r| Some((8.0, r.loss())),
        None,
    );
    assert_eq!(s.len(), 1);
    let (points, errors) = (&s[0].points, &s[0].errors);
    assert_eq!(points.len(), 2);
    let mean = points
        .iter()
        .position(|p| (p.1 - 1.1).abs() < 1e-12)
        .unwrap();
    let half = 12.706 * (0.02f64).sqrt() / 2f64.sqrt();
    assert!(
        (errors[mean].1 - 1.1 - half).abs() < 1e-9 && (1.1 - errors[mean].0 - half).abs() < 1e-9,
        "{errors:?}"
    );
    assert!(errors[1 - mean].0.is_nan());
    let single = grouped(
        &[&c],
        WINDOW,
        |_| "s".into(),
        |r| Some((8.0, r.loss())),
        None,
    );
    assert!(single[0].errors.is_empty());
    // A bounded quantity's interval stays inside its range, where Student's t would not.
    let usage = grouped(
        &[&a, &b],
        WINDOW,
        |_| "s".into(),
        |r| Some((8.0, if r.loss() > 1.1 { 0.02 } else { 0.001 })),
        Some((0.0, 1.0)),
    );
    let (lo, hi) = usage[0].errors[0];
    assert!(lo > 0.0 && hi < 1.0, "{lo} {hi}");
    let again = grouped(
        &[&a, &b, &c],
        WINDOW,
        |_| "s".into(),
        |r| Some((8.0, r.loss())),
        None,
    );
    let fig = usage_and_loss("t", "x", s, again);
    assert!(render(&fig).0 > 0);
    // A cell two stages share (a sweep's cell that is a regime's first seed) is one of the
    // regime's three replicates, and the sweep's setting of that cell alone is no point of
    // its own beside their mean.
    let mut first = with("first", &[(WINDOW, "8"), ("train.seed", "1")], 1.0);
    first.stage = "sweep".into();
    first.also.push(crate::sweep::rows::Membership {
        stage: "regime".into(),
        varied: varied(&[("train.seed", "1")]),
        line: "regime".into(),
        rung: false,
    });
    let seed = |cell: &str, s: &str, loss: f64| {
        let mut r = with(cell, &[("train.seed", s)], loss);
        r.stage = "regime".into();
        r
    };
    let (second, third) = (seed("second", "2", 1.2), seed("third", "3", 1.1));
    let shared = grouped(
        &[&first, &second, &third],
        WINDOW,
        |_| "s".into(),
        |r| Some((8.0, r.loss())),
        None,
    );
    assert_eq!(shared.len(), 1);
    assert_eq!(shared[0].points.len(), 1);
    assert!((shared[0].points[0].1 - 1.1).abs() < 1e-12);
    let half = 4.303 * 0.1 / 3f64.sqrt();
    assert!(
        (shared[0].errors[0].1 - 1.1 - half).abs() < 1e-3,
        "{:?}",
        shared[0].errors
    );
    // Another stage at one of a line's x (a variant the settings do not name, such as AHA's
    // sampled gradient) is a series of its own, named by its stage: no line joins them.
    let at = |cell: &str, stage: &str, w: f64, loss: f64| {
        let mut r = with(cell, &[(WINDOW, &w.to_string())], loss);
        r.stage = stage.into();
        r.window = w;
        r
    };
    let line = [at("l4", "aha", 4.0, 1.0), at("l8", "aha", 8.0, 0.9)];
    let variant = at("v8", "sampled", 8.0, 0.95);
    let split = along_window(&[&line[0], &line[1], &variant]);
    let names: Vec<&str> = split.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["aha", "aha (sampled)"]);
    assert_eq!(split[0].points, [(4.0, 1.0), (8.0, 0.9)]);
    // A stage at other x values continues the line, even where it holds the most of them;
    // of two stages at one x with as many values, the first listed keeps the line.
    let narrow = [
        at("n1", "narrow", 1.0, 1.3),
        at("n2", "narrow", 2.0, 1.2),
        at("n3", "narrow", 3.0, 1.1),
    ];
    let rows: Vec<&Row> = narrow.iter().chain(&line).chain([&variant]).collect();
    let three = along_window(&rows);
    let names: Vec<&str> = three.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["aha", "aha (sampled)"]);
    assert_eq!(three[0].points.len(), 5);
    let other = at("o8", "other", 8.0, 0.8);
    let tie = along_window(&[&variant, &other]);
    let names: Vec<&str> = tie.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["aha", "aha (other)"]);
    assert_eq!(tie[0].points, [(8.0, 0.95)]);
}

/// The reference line is full attention trained as long, one set-up's: a second full-attention
/// stage (a control with frozen parameters) stays out of it, an evaluation of the reference's
/// cells counts, and another budget does not.
#[test]
fn the_reference_line_is_one_full_attention_set_up() {
    let dir = fixture::sweep_dir("reference-line");
    let all = rows(&dir).unwrap().rows;
    let full = all
        .iter()
        .find(|r| r.kind == StageKind::Train && spec(r.method).reference)
        .expect("the fixture trains full attention");
    let like = |stage: &str, cell: &str, kind: StageKind, source: &str, loss: f64| {
        let mut r = full.clone();
        (r.stage, r.cell, r.kind, r.source) = (stage.into(), cell.into(), kind, source.into());
        r.report.loss = loss;
        r
    };
    let rows = [
        like("clp", "clp-1", StageKind::Train, "", 1.0),
        like("clp", "clp-2", StageKind::Train, "", 1.2),
        like("clp_frozen", "frozen-1", StageKind::Train, "", 2.0),
        like("probes", "probes-1", StageKind::Eval, "clp-1", 1.4),
        like("probes", "probes-9", StageKind::Eval, "frozen-1", 9.0),
    ];
    let mut other = like("clp", "clp-3", StageKind::Train, "", 5.0);
    other.budget_tokens += 1.0;
    let routed = [&rows[0]];
    let all_rows = rows.iter().chain([&other]);
    let line = full_reference(all_rows, &routed, |r| Some(r.loss())).unwrap();
    assert!((line - 1.2).abs() < 1e-12, "{line}");
}

/// The Pareto figure draws a setting's replicates as one point, their mean, with the
/// quality's 95 % interval as its error bar; a setting of one replicate has none.
#[test]
fn pareto_points_are_replicate_means_with_error_bars() {
    let dir = fixture::sweep_dir("pareto-means");
    let all = rows(&dir).unwrap().rows;
    let loss_points = |rows: &[Row]| -> Vec<(String, Vec<(f64, f64)>, Vec<(f64, f64)>)> {
        let figs = super::pareto::pareto_figures(rows);
        let (_, fig) = figs
            .iter()
            .find(|(stem, _)| stem == "pareto")
            .expect("a front");
        let series = match fig {
            Figure::Lines { series, .. } => series.clone(),
            Figure::Panels { panels, .. } => panels[0].series.clone(),
            _ => panic!("a line figure"),
        };
        series
            .into_iter()
            .map(|s| (s.name, s.points, s.errors))
            .collect()
    };
    let before = loss_points(&all);
    let i = all
        .iter()
        .position(|r| r.kind == StageKind::Train && !r.is_reference() && r.mu_f().is_some())
        .expect("a routed train cell");
    let seeded = |seed: &str, loss: f64| {
        let mut r = all[i].clone();
        r.cell = format!("{}-{seed}", r.cell);
        r.varied.push(("train.seed".into(), seed.into()));
        r.report.loss = loss;
        r
    };
    let mean = (all[i].loss() + 0.1 + all[i].loss() - 0.1) / 2.0;
    let mut replicated: Vec<Row> = all.clone();
    replicated[i] = seeded("1", all[i].loss() + 0.1);
    replicated.insert(i + 1, seeded("2", all[i].loss() - 0.1));
    let after = loss_points(&replicated);
    let family = crate::sweep::pareto::family(&all[i]);
    let count = |v: &[(String, Vec<(f64, f64)>, Vec<(f64, f64)>)]| {
        v.iter().find(|s| s.0 == family).map(|s| s.1.len())
    };
    assert_eq!(count(&after), count(&before), "one point for the two seeds");
    let (_, points, errors) = after.iter().find(|s| s.0 == family).unwrap();
    let k = points
        .iter()
        .position(|p| (p.1 - mean).abs() < 1e-12)
        .expect("the replicates' mean");
    assert!(errors[k].0 < mean && errors[k].1 > mean, "{errors:?}");
    let (_, _, single) = before.iter().find(|s| s.0 == family).unwrap();
    assert!(
        single.is_empty(),
        "no error bar without replicates: {single:?}"
    );
}

#[test]
fn a_control_at_one_window_is_its_own_series_and_legends_keep_whole_names() {
    let dir = fixture::sweep_dir("control-series");
    let all = rows(&dir).unwrap().rows;
    let with = |settings: &[(&str, &str)], window: f64, loss: f64| {
        let mut r = all[0].clone();
        r.cell = format!("{settings:?}");
        r.varied = varied(settings);
        r.window = window;
        r.report.loss = loss;
        r
    };
    let cells = [
        with(&[(WINDOW, "8"), ("train.seed", "1")], 8.0, 1.0),
        with(&[(WINDOW, "16"), ("train.seed", "1")], 16.0, 0.9),
        with(
            &[("train.router_init_bias", "1.0"), ("train.seed", "1")],
            8.0,
            2.0,
        ),
    ];
    let refs: Vec<&Row> = cells.iter().collect();
    let s = along_window(&refs);
    let names: Vec<&str> = s.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["aha", "aha router_init_bias=1.0"]);
    assert_eq!(s[0].points, [(8.0, 1.0), (16.0, 0.9)]);
    // A reference line spans the x range; the legend widens to the longest name.
    let lines = with_reference(s, Some(0.5));
    assert_eq!(lines[2].points, [(8.0, 0.5), (16.0, 0.5)]);
    let fig = usage_and_loss("t", "x", vec![], lines);
    let long = "full attention, trained as long".chars().count() as u32;
    assert!(fig.size().0 >= 560 * 2 + 8 * long);
}

#[test]
fn every_figure_of_a_fixture_sweep_renders() {
    let dir = fixture::sweep_dir("plots");
    // Without rates measured alone, no time front (the shared cells' are no cell's own).
    let shared: Vec<String> = figures(&dir).unwrap().into_iter().map(|(s, _)| s).collect();
    assert!(!shared.contains(&"pareto_time".to_string()), "{shared:?}");
    fixture::trained_alone(&dir);
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
    let written = write_all(&dir, &dir, false).unwrap().written;
    assert!(written.iter().any(|p| p.ends_with("figures/pareto.png")));
    // A figure of a cell read here that this plot does not draw goes, with a word; one named
    // after no cell (put there by hand) stays.
    let stale = dir.join("figures/full_ratio_vs_depth_swa-0.png");
    let own = dir.join("figures/my_notes.png");
    std::fs::write(&stale, b"old").unwrap();
    std::fs::write(&own, b"mine").unwrap();
    let plotted = write_all(&dir, &dir, false).unwrap();
    assert_eq!(plotted.removed, [stale.clone()]);
    assert!(!stale.exists() && own.exists());
    assert!(crate::sweep::unread_report(&plotted).contains("draws it no longer"));
    // L2A Fig. 13 has the trained threshold among the test-time ones, in order of tau.
    let Some((_, Figure::Lines { series, .. })) = figs.iter().find(|(s, _)| s == "threshold_sweep")
    else {
        panic!("threshold_sweep is one chart");
    };
    assert_eq!(series.len(), 1);
    assert_eq!(series[0].labels, ["tau=0.3", "tau=0.5", "tau=0.7"]);
}

/// PPA's attention time against p reads only the PPA cells timed alone on the GPU: one
/// line for the attention layers and one for prefill, each at the powers timed.
#[test]
fn ppa_s_curve_plots_time_against_p_from_cells_timed_alone() {
    let dir = fixture::sweep_dir("ppa-time");
    let ppa_time = |dir: &Path| {
        let figs = figures(dir).unwrap();
        let Some((_, Figure::Panels { panels, .. })) =
            figs.into_iter().find(|(s, _)| s == "ppa_s_curve")
        else {
            panic!("ppa_s_curve has panels");
        };
        panels
            .into_iter()
            .find(|p| p.title == "one sequence, alone on the GPU")
    };
    assert!(ppa_time(&dir).is_none(), "no cell ran alone yet");
    tables::tests::time_alone(&dir, &["ppa-0", "ppa-5", "full-0"], ("ppa-5", 6.0));
    let panel = ppa_time(&dir).expect("a time panel once PPA cells ran alone");
    let names: Vec<&str> = panel.series.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(names.iter().all(|n| n.contains("window=")), "{names:?}");
    let prefill = panel
        .series
        .iter()
        .find(|s| s.name.starts_with("prefill"))
        .unwrap();
    // The fixture times 8 ms for every cell but the one set to 6 ms.
    assert_eq!(prefill.points, [(0.0, 8.0), (0.5, 6.0)]);
}

/// SwiAttn's curve in its regulariser's weight: loss, and its full ratio beside the paper's
/// ~0.13, on a log axis (the weight is swept over decades).
#[test]
fn swiattn_gamma_draws_the_full_ratio_beside_the_papers() {
    let dir = fixture::sweep_dir("swiattn-gamma");
    // A second SwiAttn cell, at ten times the regulariser's weight.
    let path = dir.join("cells.json");
    let mut cells: Vec<crate::sweep::Cell> =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut twin = cells.iter().find(|c| c.id == "swi-0").unwrap().clone();
    twin.id = "swi-1".into();
    twin.index = cells.len();
    twin.config.attention.swiattn_gamma_base *= 10.0;
    let gamma = toml::Value::from(twin.config.attention.swiattn_gamma_base);
    twin.assignment
        .insert("attention.swiattn_gamma_base".into(), gamma);
    cells.push(twin);
    std::fs::write(&path, serde_json::to_string(&cells).unwrap()).unwrap();
    let copy = std::process::Command::new("cp")
        .args(["-r", "swi-0", "swi-1"])
        .current_dir(&dir)
        .status()
        .unwrap();
    assert!(copy.success());
    let figs = figures(&dir).unwrap();
    let Some((_, Figure::Panels { panels, .. })) =
        figs.into_iter().find(|(s, _)| s == "swiattn_gamma")
    else {
        panic!("swiattn_gamma has panels");
    };
    let usage = panels
        .iter()
        .find(|p| p.title == "share of full attention")
        .expect("a usage panel");
    assert!(matches!(usage.x_axis, XAxis::LogSwept));
    let paper = usage
        .series
        .iter()
        .find(|s| s.name.starts_with("SwiAttn paper"))
        .expect("the paper's ratio");
    assert!(
        paper.points.iter().all(|p| p.1 == 0.13),
        "{:?}",
        paper.points
    );
    assert!(usage.series.iter().any(|s| s.name.starts_with("window=")));
}

#[test]
fn probe_head_usage_gives_a_map_per_task() {
    let dir = std::env::temp_dir().join(format!("attnsweep-probe-map-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("probe_head_usage.csv");
    std::fs::write(&p, "task,layer,head,mu_f\npasskey,0,0,0.5\npasskey,0,1,1.0\npasskey,1,0,0.0\npasskey,1,1,0.25\nniah_single,0,0,1.0\nniah_single,0,1,0.0\nniah_single,1,0,0.5\nniah_single,1,1,0.5\n").unwrap();
    let maps = probe_usage_maps(&cell_files::probe_usage(&p).unwrap(), "aha");
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
    let e = cell_files::probe_usage(&p).err().unwrap().to_string();
    assert!(e.contains("row 2 needs task,layer,head,mu_f"), "{e}");
}

#[test]
fn niah_csv_gives_heatmap_and_depth_curve() {
    let dir = std::env::temp_dir().join(format!("attnsweep-niah-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("niah.csv");
    std::fs::write(&p, "depth,length,accuracy,full_ratio\n0.0,64,1.0,0.2\n0.5,64,0.5,0.4\n0.0,128,0.8,0.3\n0.5,128,0.2,0.5\n").unwrap();
    let niah = cell_files::niah(&p).unwrap().unwrap();
    let figs = niah_figures(&niah, "c", "m", Some(32.0));
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

#[test]
fn niah_csv_without_ratios_draws_no_depth_curve() {
    // Full attention's probes in a grid with routed methods: the column is there, empty.
    let dir = std::env::temp_dir().join(format!("attnsweep-niah-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("niah.csv");
    std::fs::write(
        &p,
        "depth,length,accuracy,full_ratio\n0.0,64,1.0,\n0.5,64,0.5,\n",
    )
    .unwrap();
    let niah = cell_files::niah(&p).unwrap().unwrap();
    let figs = niah_figures(&niah, "c", "m", Some(32.0));
    let names: Vec<&str> = figs.iter().map(|f| f.0.as_str()).collect();
    assert_eq!(names, ["niah_heatmap"]);
    std::fs::remove_dir_all(&dir).ok();
}

/// The lambda figure draws the paper's usage at each window whose lambdas the sweep varies,
/// as a hollow dashed reference in the usage panel only, and none at a window it did not run.
#[test]
fn lambda_ablation_draws_the_papers_usage_at_its_windows() {
    use crate::config::{Method, Router};
    use crate::model::attention::PaperUsageAt;
    use crate::sweep::figure::{Look, Series};
    use crate::sweep::grid::StageKind;
    let dir = fixture::sweep_dir("lambda-paper");
    let all = rows(&dir).unwrap().rows;
    let aha: Vec<&Row> = all
        .iter()
        .filter(|r| {
            r.method == Method::Aha && r.kind == StageKind::Train && r.router == Router::Learned
        })
        .collect();
    let at = |window, lambda, mu_f| PaperUsageAt {
        window,
        lambda,
        mu_f,
    };
    // The fixture sweeps lambda 3e-4 and 0.1 at w 16: 1e-5 lies outside, w 128 is not run.
    let paper = [
        at(16.0, 1e-3, 0.2),
        at(16.0, 1e-2, 0.1),
        at(16.0, 1e-5, 0.9),
        at(128.0, 3e-4, 0.1),
    ];
    let train: Vec<&Row> = all.iter().filter(|r| r.kind == StageKind::Train).collect();
    let mut figs = Vec::new();
    gates::lambda_ablation(&aha, &train, (&paper, "paper"), &mut figs);
    let Some((_, Figure::Panels { panels, .. })) = figs.first() else {
        panic!("no lambda figure");
    };
    let refs: Vec<&Series> = panels[0]
        .series
        .iter()
        .filter(|s| s.name.starts_with("paper"))
        .collect();
    let names: Vec<&str> = panels[0].series.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(refs.len(), 1, "{names:?}");
    assert_eq!(refs[0].name, "paper, w 16");
    assert_eq!(refs[0].points, [(1e-3, 0.2), (1e-2, 0.1)]);
    assert!(matches!(
        refs[0].look,
        Look::Chosen {
            hollow: true,
            dashed: true,
            ..
        }
    ));
    assert!(panels[1]
        .series
        .iter()
        .all(|s| !s.name.starts_with("paper")));
    // The quality panel has full attention trained as long as its reference.
    let names: Vec<&str> = panels[1].series.iter().map(|s| s.name.as_str()).collect();
    assert!(
        names.contains(&"full attention, trained as long"),
        "{names:?}"
    );
    // One value at a window is drawn as a level across the lambdas swept there (3e-4 to 0.1),
    // through the paper's own lambda.
    let mut figs = Vec::new();
    gates::lambda_ablation(&aha, &train, (&[at(16.0, 1e-3, 0.2)], "paper"), &mut figs);
    let Some((_, Figure::Panels { panels, .. })) = figs.first() else {
        panic!("no lambda figure");
    };
    let level = panels[0]
        .series
        .iter()
        .find(|s| s.name.starts_with("paper"))
        .unwrap();
    assert_eq!(
        level.name,
        "paper, w 16: its usage at lambda 0.001, as a level"
    );
    assert_eq!(level.points, [(3e-4, 0.2), (0.1, 0.2)]);
    let _ = std::fs::remove_dir_all(&dir);
}
