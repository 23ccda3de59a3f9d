//! A sweep directory of finished cells with known results, for the tests of tables and
//! figures.

use crate::config::{Config, Method};
use crate::run::prune::PruneReport;
use crate::run::report::Timing;
use crate::run::report::{
    AttentionWork, Bucket, EvalFile, EvalReport, GapStats, GateReport, NeedReport, PrecisionRecall,
};
use crate::sweep::{Cell, StageKind};
use std::path::{Path, PathBuf};

struct Spec {
    id: &'static str,
    kind: StageKind,
    dep: Option<&'static str>,
    loss: f64,
    density: f64,
    gates: bool,
    threshold: Option<f64>,
    edit: fn(&mut Config),
}

pub(crate) fn sweep_dir(name: &str) -> PathBuf {
    sweep_dir_with(name, &[])
}

/// The fixture sweep with attention sinks too: continued from the base, and the base
/// evaluated with them (zero-shot), beside SWA's two.
pub(crate) fn sweep_dir_with_sinks(name: &str) -> PathBuf {
    let sinks = |c: &mut Config| c.attention.method = Method::Sinks;
    sweep_dir_with(
        name,
        &[
            Spec {
                id: "sinks-0",
                kind: StageKind::Train,
                dep: Some("base-0"),
                loss: 2.05,
                density: 0.25,
                gates: false,
                threshold: None,
                edit: sinks,
            },
            Spec {
                id: "sinkzs-0",
                kind: StageKind::Eval,
                dep: Some("base-0"),
                loss: 2.3,
                density: 0.25,
                gates: false,
                threshold: None,
                edit: sinks,
            },
        ],
    )
}

/// The fixture sweep with a second window (SWA at 0.6 of the pairs beside swa-0 at 0.2), so
/// that the other methods between them have a window line at their pairs.
pub(crate) fn sweep_dir_with_windows(name: &str) -> PathBuf {
    sweep_dir_with(
        name,
        &[Spec {
            id: "swa-6",
            kind: StageKind::Train,
            dep: Some("base-0"),
            loss: 1.9,
            density: 0.6,
            gates: false,
            threshold: None,
            edit: |c| {
                c.attention.method = Method::Swa;
                c.attention.window = 77
            },
        }],
    )
}

fn sweep_dir_with(name: &str, extra: &[Spec]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("attnsweep-fixture-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // AHA at w 16 with a strong penalty, trained and evaluated again with the same attention.
    fn aha_16b(c: &mut Config) {
        c.attention.method = Method::Aha;
        c.attention.window = 16;
        c.attention.lambda = 0.1;
    }
    let specs = [
        Spec {
            id: "base-0",
            kind: StageKind::Train,
            dep: None,
            loss: 2.0,
            density: 1.0,
            gates: false,
            threshold: None,
            edit: |_| {},
        },
        Spec {
            id: "full-0",
            kind: StageKind::Train,
            dep: Some("base-0"),
            loss: 1.8,
            density: 1.0,
            gates: false,
            threshold: None,
            edit: |_| {},
        },
        Spec {
            id: "zs-0",
            kind: StageKind::Eval,
            dep: Some("base-0"),
            loss: 2.5,
            density: 0.2,
            gates: false,
            threshold: None,
            edit: |c| c.attention.method = Method::Swa,
        },
        Spec {
            id: "swa-0",
            kind: StageKind::Train,
            dep: Some("base-0"),
            loss: 2.1,
            density: 0.2,
            gates: false,
            threshold: None,
            edit: |c| c.attention.method = Method::Swa,
        },
        Spec {
            id: "hyb-0",
            kind: StageKind::Train,
            dep: Some("base-0"),
            loss: 1.9,
            density: 0.4,
            gates: false,
            threshold: None,
            edit: |c| c.attention.method = Method::StaticHybrid,
        },
        Spec {
            id: "aha-4",
            kind: StageKind::Train,
            dep: Some("base-0"),
            loss: 1.85,
            density: 0.9,
            gates: true,
            threshold: None,
            edit: |c| {
                c.attention.method = Method::Aha;
                c.attention.window = 4
            },
        },
        // aha-4 evaluated again on sequences four times longer, for its gaps alone.
        Spec {
            id: "gaps-4",
            kind: StageKind::Eval,
            dep: Some("aha-4"),
            loss: 1.95,
            density: 0.8,
            gates: true,
            threshold: None,
            edit: |c| {
                c.attention.method = Method::Aha;
                c.attention.window = 4;
                c.eval.seq_len = 4 * c.data.seq_len
            },
        },
        Spec {
            id: "aha-16",
            kind: StageKind::Train,
            dep: Some("base-0"),
            loss: 1.82,
            density: 0.6,
            gates: true,
            threshold: None,
            edit: |c| {
                c.attention.method = Method::Aha;
                c.attention.window = 16
            },
        },
        Spec {
            id: "aha-16b",
            kind: StageKind::Train,
            dep: Some("base-0"),
            loss: 1.9,
            density: 0.5,
            gates: true,
            threshold: None,
            edit: aha_16b,
        },
        // aha-16b evaluated again with the same attention (as a probe stage does).
        Spec {
            id: "probe-16b",
            kind: StageKind::Eval,
            dep: Some("aha-16b"),
            loss: 1.9,
            density: 0.5,
            gates: true,
            threshold: None,
            edit: aha_16b,
        },
        Spec {
            id: "heads-2",
            kind: StageKind::Train,
            dep: Some("aha-16"),
            loss: 1.95,
            density: 0.5,
            gates: true,
            threshold: None,
            edit: |c| {
                c.attention.method = Method::StaticHeads;
                c.attention.top_k = 2
            },
        },
        Spec {
            id: "heads-budget",
            kind: StageKind::Train,
            dep: Some("aha-16"),
            loss: 1.84,
            density: 0.5,
            gates: true,
            threshold: None,
            edit: |c| {
                c.attention.method = Method::StaticHeads;
                c.attention.top_k = 0
            },
        },
        Spec {
            id: "heads-16",
            kind: StageKind::Train,
            dep: Some("aha-16"),
            loss: 1.83,
            density: 1.0,
            gates: true,
            threshold: None,
            edit: |c| {
                c.attention.method = Method::StaticHeads;
                c.attention.top_k = 16
            },
        },
        Spec {
            id: "l2a-0",
            kind: StageKind::Train,
            dep: Some("base-0"),
            loss: 1.83,
            density: 0.5,
            gates: true,
            threshold: None,
            edit: |c| c.attention.method = Method::L2a,
        },
        Spec {
            id: "tau-3",
            kind: StageKind::Eval,
            dep: Some("l2a-0"),
            loss: 1.81,
            density: 0.7,
            gates: true,
            threshold: None,
            edit: |c| {
                c.attention.method = Method::L2a;
                c.attention.tau = 0.3
            },
        },
        Spec {
            id: "tau-7",
            kind: StageKind::Eval,
            dep: Some("l2a-0"),
            loss: 1.9,
            density: 0.3,
            gates: true,
            threshold: None,
            edit: |c| {
                c.attention.method = Method::L2a;
                c.attention.tau = 0.7
            },
        },
        Spec {
            id: "prune-9",
            kind: StageKind::Prune,
            dep: Some("l2a-0"),
            loss: 1.86,
            density: 0.4,
            gates: true,
            threshold: Some(0.9),
            edit: |c| c.attention.method = Method::L2a,
        },
        Spec {
            id: "swi-0",
            kind: StageKind::Train,
            dep: Some("base-0"),
            loss: 1.84,
            density: 0.6,
            gates: true,
            threshold: None,
            edit: |c| c.attention.method = Method::Swiattn,
        },
        Spec {
            id: "swi-v1",
            kind: StageKind::Train,
            dep: Some("base-0"),
            loss: 1.88,
            density: 0.5,
            gates: true,
            threshold: None,
            edit: |c| {
                c.attention.method = Method::Swiattn;
                c.attention.swiattn_adaptive = false
            },
        },
        Spec {
            id: "ppa-0",
            kind: StageKind::Train,
            dep: Some("base-0"),
            loss: 2.0,
            density: 0.15,
            gates: false,
            threshold: None,
            edit: |c| {
                c.attention.method = Method::Ppa;
                c.attention.ppa_power = 0.0
            },
        },
        Spec {
            id: "ppa-5",
            kind: StageKind::Train,
            dep: Some("base-0"),
            loss: 1.9,
            density: 0.3,
            gates: false,
            threshold: None,
            edit: |c| {
                c.attention.method = Method::Ppa;
                c.attention.ppa_power = 0.5
            },
        },
    ];
    let mut cells = Vec::new();
    for (i, s) in specs.iter().chain(extra).enumerate() {
        let mut config = Config::default();
        (s.edit)(&mut config);
        let cell_dir = dir.join(s.id);
        std::fs::create_dir_all(cell_dir.join("eval")).unwrap();
        std::fs::write(
            cell_dir.join("status.json"),
            r#"{"state":"done","attempts":1,"error":null}"#,
        )
        .unwrap();
        let gap = |gaps: u64, median: Option<u32>, share: f64| GapStats {
            gaps,
            mean: median.map(f64::from),
            median,
            p90: median.map(|m| m + 1),
            max: median.map(|m| m + 2),
            max_censored: Some(64),
            censored_share: share,
        };
        let gates = s.gates.then(|| GateReport {
            mu_f: s.density,
            per_layer: vec![s.density, s.density * 0.5],
            per_head: vec![vec![0.9, 0.1], vec![0.4, 0.6]],
            gaps: vec![
                vec![gap(9, Some(1), 0.0), gap(0, None, 1.0)],
                vec![gap(4, Some(2), 0.5), gap(5, Some(3), 0.25)],
            ],
            censored_heads: 1,
            need: Some(NeedReport {
                window: 64,
                positions: 10,
                needing: 4,
                per_layer: vec![],
                all_gates: PrecisionRecall {
                    precision: Some(0.3),
                    recall: Some(0.8),
                    ..Default::default()
                },
                ask_rule: PrecisionRecall {
                    precision: Some(0.33),
                    recall: Some(0.9),
                    ..Default::default()
                },
            }),
        });
        let pairs = s.density * 1e6;
        let report = EvalReport {
            split: "val".into(),
            seq_len: config.eval_seq_len(),
            checkpoint_step: Some(config.train.steps),
            train_steps: config.train.steps,
            tokens: 1000,
            loss: s.loss,
            perplexity: s.loss.exp(),
            bits_per_token: s.loss / std::f64::consts::LN_2,
            unigram_entropy: 3.0,
            attention: AttentionWork {
                pairs,
                full_causal_pairs: 1e6,
                pairs_vs_full: s.density,
                flops: 4.0 * pairs,
                full_causal_flops: 4e6,
            },
            kv_cache_bytes: vec![500.0, 500.0],
            kv_cache_bytes_total: 1000.0,
            kv_cache_bytes_full: 1000.0,
            buckets: [
                ("unpredictable", 0),
                ("local", 1),
                ("d2-3", 2),
                ("d4-7", 4),
                ("d64-127", 64),
                ("d128-255", 128),
            ]
            .iter()
            .map(|&(name, lo)| Bucket {
                bucket: name.into(),
                min_distance: lo,
                tokens: 100 + lo as u64,
                loss: s.loss + 0.1 * lo as f64,
                accuracy: Some(1.0 / (1.0 + lo as f64)),
            })
            .collect(),
            gates,
            timing: Some(Timing {
                device: "Cpu".into(),
                batch: 2,
                seq_len: 8,
                forward_ms: 10.0,
                attention_ms: 4.0 * s.density,
                prefill_ms: 8.0,
                decode_steps: 4,
                decode_tokens_per_s: 100.0 / s.density,
                decode_cache_bytes: 1000.0,
                runs: 3,
                forward_ms_spread: 1.0,
                prefill_ms_spread: 0.5,
                decode_tokens_per_s_spread: 2.0,
            }),
            by_source: Vec::new(),
            by_position: Vec::new(),
        };
        let file = EvalFile {
            report,
            config: config.clone(),
        };
        std::fs::write(
            cell_dir.join("eval/eval.json"),
            serde_json::to_string(&file).unwrap(),
        )
        .unwrap();
        let suite = serde_json::json!({ "results": { "niah_single": {
            "alias": "niah_single", "exact_match,none": s.loss, "exact_match_stderr,none": 0.1 } } });
        std::fs::write(cell_dir.join("eval/results.json"), suite.to_string()).unwrap();
        if s.kind == StageKind::Train {
            std::fs::write(
                cell_dir.join("val_log.csv"),
                format!("step,val_loss\n100,{}\n200,{}\n", s.loss + 0.1, s.loss),
            )
            .unwrap();
            // Rates 1000, 3000, 2000: the median is 2000.
            std::fs::write(
                cell_dir.join("train_log.csv"),
                "step,loss,lr,grad_norm,tokens_per_s,tokens_seen,reg,mu_f\n\
                 10,3,0.001,1,1000.0,100,,\n20,3,0.001,1,3000.0,200,,\n30,3,0.001,1,2000.0,300,,\n",
            )
            .unwrap();
        }
        if let Some(threshold) = s.threshold {
            let p = PruneReport {
                threshold,
                sparsity: vec![0.5, 0.95],
                pruned_layers: vec![1],
                kv_cache_bytes_before: 2000.0,
                kv_cache_bytes_after: 1000.0,
                kv_cache_bytes_full: 2000.0,
                loss_before: 1.83,
                loss_after: s.loss,
            };
            std::fs::write(
                cell_dir.join("prune.json"),
                serde_json::to_string(&p).unwrap(),
            )
            .unwrap();
        }
        cells.push(Cell {
            index: i,
            id: s.id.into(),
            stage: s.id.split('-').next().unwrap().into(),
            kind: s.kind,
            label: s.id.into(),
            assignment: varied(&config),
            settings: Default::default(),
            depends_on: s.dep.map(String::from),
            depends_on_stage: None,
            reads: None,
            reads_stage: None,
            match_usage: false,
            exclusive: false,
            ladder: None,
            pretrained: None,
            threshold: s.threshold,
            config,
        });
    }
    std::fs::write(
        dir.join("cells.json"),
        serde_json::to_string(&cells).unwrap(),
    )
    .unwrap();
    // A cell that did not finish is left out of every table.
    std::fs::create_dir_all(dir.join("broken")).unwrap();
    dir
}

/// The fixture sweep with budget ladders: full attention (`full-0`) and AHA at w 16
/// (`aha-16`) each trained again for half the steps as lower rungs (`ladder`); `full-0` probed
/// by two evaluations at two prompt lengths (`probe_samples.jsonl`: at length 8 the prompts
/// 1, 1, 0 of niah_single, 1 of niah_multikey and, in the second, 1 of niah_multivalue; at 16
/// niah_single's 0, 1), its rung once (niah_single 0, 0 at 8 and 1, 1 at 16); the pretrained
/// model evaluated (loss 2.2) and probed (niah_single 0, 1 at 8).
pub(crate) fn sweep_dir_with_ladders(name: &str) -> PathBuf {
    fn half(c: &mut Config) {
        c.train.steps /= 2;
    }
    let rung = |id, dep: Option<&'static str>, kind, loss, edit| Spec {
        id,
        kind,
        dep,
        loss,
        density: 1.0,
        gates: false,
        threshold: None,
        edit,
    };
    let dir = sweep_dir_with(
        name,
        &[
            rung("fullrung-0", Some("base-0"), StageKind::Train, 1.95, half),
            rung("probefull-0", Some("full-0"), StageKind::Eval, 1.8, |_| {}),
            rung(
                "proberung-0",
                Some("fullrung-0"),
                StageKind::Eval,
                1.95,
                half,
            ),
            rung(
                "probefull2-0",
                Some("full-0"),
                StageKind::Eval,
                1.81,
                |_| {},
            ),
            rung("pre-0", None, StageKind::Eval, 2.2, |_| {}),
            rung("prepr-0", None, StageKind::Eval, 2.3, |_| {}),
            // A control run on a lower rung before its ladder's top: a line of one budget.
            rung("ctlrung-0", Some("base-0"), StageKind::Train, 2.05, |c| {
                c.attention.method = Method::Swa;
                c.train.steps /= 2;
            }),
            Spec {
                id: "aharung-16",
                density: 0.9,
                gates: true,
                ..rung("", Some("base-0"), StageKind::Train, 1.9, |c| {
                    c.attention.method = Method::Aha;
                    c.attention.window = 16;
                    c.train.steps /= 2;
                })
            },
        ],
    );
    let path = dir.join("cells.json");
    let mut cells: Vec<Cell> =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for c in &mut cells {
        c.ladder = match c.id.as_str() {
            "fullrung-0" => Some("full".into()),
            "aharung-16" => Some("aha".into()),
            "ctlrung-0" => Some("ctl".into()),
            _ => None,
        };
    }
    std::fs::write(&path, serde_json::to_string(&cells).unwrap()).unwrap();
    // Full attention's two rungs and the pretrained model split their loss by position: the
    // first half of each sequence 0.3 above the second.
    for id in ["full-0", "fullrung-0", "pre-0"] {
        let eval = dir.join(id).join("eval/eval.json");
        let mut file: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&eval).unwrap()).unwrap();
        let loss = file["report"]["loss"].as_f64().unwrap();
        file["report"]["by_position"] = serde_json::json!([
            { "from": 0, "to": 4, "tokens": 8, "loss": loss + 0.3 },
            { "from": 4, "to": 8, "tokens": 8, "loss": loss },
        ]);
        std::fs::write(&eval, file.to_string()).unwrap();
    }
    // Each prompt named as an evaluation names it (depth, index, target): the n-th prompt of
    // a task and length is the same prompt in every cell.
    let samples = |id: &str, prompts: &[(&str, u64, f64)]| {
        let mut seen: std::collections::BTreeMap<(&str, u64), usize> = Default::default();
        let lines: Vec<String> = prompts
            .iter()
            .map(|&(task, length, x)| {
                let n = seen.entry((task, length)).or_default();
                *n += 1;
                serde_json::json!({ "task": task, "length": length, "exact_match": x,
                    "depth": 0.5, "sample": *n - 1, "target": format!("{task}-{length}-{n}") })
                .to_string()
            })
            .collect();
        std::fs::write(
            dir.join(id).join("eval/probe_samples.jsonl"),
            lines.join("\n"),
        )
        .unwrap();
    };
    let single = "niah_single";
    samples(
        "probefull-0",
        &[
            (single, 8, 1.0),
            (single, 8, 1.0),
            (single, 8, 0.0),
            ("niah_multikey", 8, 1.0),
            (single, 16, 0.0),
            (single, 16, 1.0),
        ],
    );
    samples("probefull2-0", &[("niah_multivalue", 8, 1.0)]);
    samples("prepr-0", &[(single, 8, 0.0), (single, 8, 1.0)]);
    samples(
        "proberung-0",
        &[
            (single, 8, 0.0),
            (single, 8, 0.0),
            (single, 16, 1.0),
            (single, 16, 1.0),
        ],
    );
    dir
}

/// What a grid would vary to make a fixture cell: its attention settings that differ from
/// the defaults, and its evaluation length where it sets one.
fn varied(c: &Config) -> std::collections::BTreeMap<String, toml::Value> {
    let table = |a: &crate::config::AttentionConfig| toml::Table::try_from(a).unwrap();
    let (set, default) = (table(&c.attention), table(&Default::default()));
    let mut out: std::collections::BTreeMap<String, toml::Value> = set
        .into_iter()
        .filter(|(k, v)| default.get(k) != Some(v))
        .map(|(k, v)| (format!("attention.{k}"), v))
        .collect();
    if c.eval.seq_len != 0 {
        out.insert("eval.seq_len".into(), (c.eval.seq_len as i64).into());
    }
    out
}

/// Marks the train cells of a fixture sweep as run each alone on its device (the `cell.json`
/// a run writes), so their training rates count for a front.
pub(crate) fn trained_alone(dir: &Path) {
    let cells: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cells.json")).unwrap()).unwrap();
    for c in cells.as_array().unwrap() {
        if c["kind"] == "train" {
            let mut ran = c.clone();
            ran["alone"] = true.into();
            let id = c["id"].as_str().unwrap();
            std::fs::write(dir.join(id).join("cell.json"), ran.to_string()).unwrap();
        }
    }
}

pub(crate) fn csv(path: &Path) -> Vec<Vec<String>> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| l.split(',').map(String::from).collect())
        .collect()
}
