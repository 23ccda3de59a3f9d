//! The methods of one fixed pattern per layer: full attention, a sliding window (SWA), the
//! window plus power offsets (PPA), and StaticHybrid (every `hybrid_every`-th layer full, the
//! others the window). Which keys each pattern sees is `patterns.rs`; here is the layer that
//! runs one, and each method's facts.

use crate::config::{AttentionConfig, Method};
use crate::model::attention::base::{Build, Route};
use crate::model::attention::patterns::KeyPattern;
use crate::model::attention::shared::Static;
use crate::model::attention::spec::{
    never_forced, no_extra_params, no_fixed_heads, no_head_budget, no_setup, no_variant,
    BenchVariant, CellKind, Example, Gates, MethodSpec, PaperTable, Provenance, Report,
    SettingColumn, SettingCurve, Value,
};

/// The pattern of StaticHybrid's layer `layer`: every `hybrid_every`-th layer (the last of each
/// group) full, the others the window.
pub(crate) fn hybrid_pattern(a: &AttentionConfig, layer: usize) -> KeyPattern {
    if (layer + 1) % a.hybrid_every == 0 {
        KeyPattern::Full
    } else {
        KeyPattern::Window(a.window)
    }
}

/// A fixed-pattern method's facts, given how it builds its layer, with the examples the
/// generated tests run it at.
const fn fixed(
    method: Method,
    label: &'static str,
    build: fn(&Build) -> Box<dyn Route>,
    bench: &'static [BenchVariant],
    examples: &'static [Example],
) -> MethodSpec {
    let windowed = !matches!(method, Method::Full);
    MethodSpec {
        method,
        label,
        gates: Gates::None,
        windowed,
        dense_mask: windowed,
        build,
        extra_params: no_extra_params,
        fixed_heads: no_fixed_heads,
        force_global: never_forced,
        describe: |_, _, _| Vec::new(),
        variant: no_variant,
        bench,
        reference: false,
        zero_shot: false,
        prunable: false,
        columns: &[],
        baseline: None,
        head_budget: no_head_budget,
        reports: &[],
        hf: include_str!("fixed.py"),
        examples,
    }
}

/// The bench variant of a fixed pattern: the method as configured, timed beside its peer;
/// `reads_window` where its pattern has a window.
const fn timed(name: &'static str, reads_window: bool) -> BenchVariant {
    BenchVariant {
        name,
        setup: no_setup,
        calibrate_router: false,
        peer: Some(name),
        reads_window,
        reads_usage: false,
        reads_power: false,
    }
}

pub(super) const FULL: MethodSpec = MethodSpec {
    reference: true,
    baseline: Some(|_| "FullAttn"),
    ..fixed(
        Method::Full,
        "Full",
        |_| Box::new(Static(KeyPattern::Full)),
        &[timed("full", false)],
        &[Example {
            name: "full",
            set: |a| a.method = Method::Full,
        }],
    )
};

/// SWA's name beside the papers' methods: zero-shot on full attention's weights (an
/// evaluation of a full model), continued from them, or trained on its own.
fn swa_baseline(p: &Provenance) -> &'static str {
    match (p.from_reference, p.kind) {
        (true, CellKind::Evaluated) => "SWA-ZS",
        (true, _) => "SWA-CPT",
        (false, _) => "SWA",
    }
}

pub(super) const SWA: MethodSpec = MethodSpec {
    zero_shot: true,
    baseline: Some(swa_baseline),
    // Trained as long, every head on the window: AHA Table 5's all-window row.
    head_budget: |_, p, _, _| match p.kind {
        CellKind::Trained => "all heads window".into(),
        _ => String::new(),
    },
    ..fixed(
        Method::Swa,
        "SWA",
        |b| Box::new(Static(KeyPattern::Window(b.a.window))),
        &[timed("swa", true)],
        &[
            Example {
                name: "swa",
                set: |a| a.method = Method::Swa,
            },
            // A window that sees every earlier key at the tests' lengths: no mask is built.
            Example {
                name: "swa_wider_than_the_sequence",
                set: |a| {
                    a.method = Method::Swa;
                    a.window = 16;
                },
            },
        ],
    )
};

/// PPA's power: a column of every cell (PPA Table 1's axis), named in `timing.csv` too.
const PPA_POWER: SettingColumn = SettingColumn {
    name: "ppa_power",
    value: |a| Value::Number(a.ppa_power),
    every_cell: true,
    in_every_summary: true,
    timed: true,
};

pub(super) const PPA: MethodSpec = MethodSpec {
    describe: |a, _, _| vec![format!("p {}", a.ppa_power)],
    columns: &[PPA_POWER],
    reports: &[
        // Table 1.
        Report::Table(PaperTable {
            file: "ppa.csv",
            holds: |c| c.method == Method::Ppa,
            subject: |c| c.method == Method::Ppa,
            columns: &[
                "ppa_power",
                "window",
                "loss",
                "perplexity",
                "far_loss",
                "far_accuracy",
                "pairs_vs_full",
                "tokens_per_s",
                "cell",
            ],
            sort: &["window", "ppa_power"],
        }),
        // Fig. 3 and Table 1: the S-curve in p.
        Report::Curve(SettingCurve {
            key: "attention.ppa_power",
            stem: "ppa_s_curve",
            symbol: "p",
            axis: "power p",
            value: |a| a.ppa_power,
            full_at: Some(1.0),
            log: false,
        }),
    ],
    ..fixed(
        Method::Ppa,
        "PPA",
        |b| {
            Box::new(Static(KeyPattern::Ppa {
                power: b.a.ppa_power,
                window: b.a.window,
            }))
        },
        &[BenchVariant {
            reads_power: true,
            ..timed("ppa", true)
        }],
        &[
            Example {
                name: "ppa",
                set: |a| {
                    a.method = Method::Ppa;
                    a.ppa_power = 0.5;
                },
            },
            // Every distance is an offset: the pattern is full attention.
            Example {
                name: "ppa_1",
                set: |a| {
                    a.method = Method::Ppa;
                    a.ppa_power = 1.0;
                },
            },
        ],
    )
};

pub(super) const STATIC_HYBRID: MethodSpec = MethodSpec {
    baseline: Some(|_| "StaticHybrid"),
    ..fixed(
        Method::StaticHybrid,
        "StaticHybrid",
        |b| Box::new(Static(hybrid_pattern(b.a, b.layer))),
        &[timed("static_hybrid", true)],
        &[Example {
            name: "static_hybrid",
            set: |a| {
                a.method = Method::StaticHybrid;
                a.hybrid_every = 2;
            },
        }],
    )
};
