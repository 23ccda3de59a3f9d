//! The methods of one fixed pattern per layer: full attention, a sliding window (SWA), the
//! window plus power offsets (PPA), and StaticHybrid (every `hybrid_every`-th layer full, the
//! others the window). Which keys each pattern sees is `patterns.rs`; here is the layer that
//! runs one, and each method's facts.

use crate::config::{AttentionConfig, Method};
use crate::model::attention::base::{
    never_forced, no_extra_params, no_fixed_heads, no_setup, no_variant, BenchVariant, Build,
    Gates, MethodSpec, Route,
};
use crate::model::attention::patterns::KeyPattern;
use crate::model::attention::shared::Static;

/// The pattern of StaticHybrid's layer `layer`: every `hybrid_every`-th layer (the last of each
/// group) full, the others the window.
pub(crate) fn hybrid_pattern(a: &AttentionConfig, layer: usize) -> KeyPattern {
    if (layer + 1) % a.hybrid_every == 0 {
        KeyPattern::Full
    } else {
        KeyPattern::Window(a.window)
    }
}

/// A fixed-pattern method's facts, given how it builds its layer.
const fn fixed(
    method: Method,
    label: &'static str,
    build: fn(&Build) -> Box<dyn Route>,
    bench: &'static [BenchVariant],
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

pub(super) const FULL: MethodSpec = fixed(
    Method::Full,
    "Full",
    |_| Box::new(Static(KeyPattern::Full)),
    &[timed("full", false)],
);

pub(super) const SWA: MethodSpec = fixed(
    Method::Swa,
    "SWA",
    |b| Box::new(Static(KeyPattern::Window(b.a.window))),
    &[timed("swa", true)],
);

pub(super) const PPA: MethodSpec = MethodSpec {
    describe: |a, _, _| vec![format!("p {}", a.ppa_power)],
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
    )
};

pub(super) const STATIC_HYBRID: MethodSpec = fixed(
    Method::StaticHybrid,
    "StaticHybrid",
    |b| Box::new(Static(hybrid_pattern(b.a, b.layer))),
    &[timed("static_hybrid", true)],
);
