//! Attention sinks (StreamingLLM, Xiao et al. 2024; DuoAttention's streaming heads): every
//! query attends the sequence's first `sink_tokens` keys, where softmax parks the attention it
//! has nowhere else to put, and its window of the last `window` keys. A fixed pattern over
//! absolute key positions (`KeyPattern::Sinks`): its decoding cache keeps the sinks and a ring
//! of the last `window` keys, so its memory stays flat in the length, and a full-attention
//! model evaluated with it is StreamingLLM's training-free baseline beside SWA's.

use crate::config::Method;
use crate::model::attention::patterns::KeyPattern;
use crate::model::attention::shared::Static;
use crate::model::attention::spec::{
    never_forced, no_extra_params, no_fixed_heads, no_head_budget, no_setup, no_variant,
    BenchVariant, CellKind, Example, Gates, MethodSpec, Provenance, SettingColumn, Value,
};

/// Its name beside SWA's in the baseline tables: zero-shot on full attention's weights,
/// continued from them, or trained on its own.
fn baseline(p: &Provenance) -> &'static str {
    match (p.from_reference, p.kind) {
        (true, CellKind::Evaluated) => "Sinks-ZS",
        (true, _) => "Sinks-CPT",
        (false, _) => "Sinks",
    }
}

pub(super) const SINKS: MethodSpec = MethodSpec {
    method: Method::Sinks,
    label: "Sinks",
    gates: Gates::None,
    windowed: true,
    dense_mask: true,
    build: |b| {
        Box::new(Static(KeyPattern::Sinks {
            sinks: b.a.sink_tokens,
            window: b.a.window,
        }))
    },
    extra_params: no_extra_params,
    fixed_heads: no_fixed_heads,
    force_global: never_forced,
    describe: |a, _, _| vec![format!("sinks {}", a.sink_tokens)],
    variant: no_variant,
    bench: &[BenchVariant {
        name: "sinks",
        setup: no_setup,
        calibrate_router: false,
        peer: Some("sinks"),
        reads_window: true,
        reads_usage: false,
        reads_power: false,
    }],
    reference: false,
    zero_shot: true,
    prunable: false,
    // The sinks beside the window, in the sweeps that run it; they change what its time
    // measures (the pairs beyond the window).
    columns: &[SettingColumn {
        name: "sink_tokens",
        value: |a| Value::Number(a.sink_tokens as f64),
        every_cell: false,
        in_every_summary: false,
        timed: true,
    }],
    baseline: Some(baseline),
    head_budget: no_head_budget,
    reports: &[],
    hf: include_str!("sinks.py"),
    examples: &[
        Example {
            name: "sinks",
            set: |a| {
                a.method = Method::Sinks;
                a.sink_tokens = 2;
            },
        },
        // One sink beside a window of one: each query sees the first token and itself.
        Example {
            name: "sinks_1",
            set: |a| {
                a.method = Method::Sinks;
                a.sink_tokens = 1;
                a.window = 1;
            },
        },
    ],
};
