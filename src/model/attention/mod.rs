//! Attention: the layer every method shares, and one file per method.
//!
//! | file | what |
//! |---|---|
//! | `ctx.rs` | what one forward is asked for beyond the parameters (gate overrides, seeds) |
//! | `patterns.rs` | which keys a query sees under each static pattern (over absolute positions); pair counts; masks; the keys a cache keeps; the kernel that runs it; the reference attention |
//! | `cache.rs` | where a layer's keys come from: the chunk, or a decoding cache that keeps what its method states (`Keep`) |
//! | `gates.rs` | routers, thresholds, context-free gates, the straight-through estimator |
//! | `base.rs` | what every method builds on: projections, the chunk, where a call runs (`Base::exec`), the `Route` a method implements |
//! | `spec.rs` | `MethodSpec`: a method's facts, from how it is built to the tables, figures and tests it fills |
//! | `shared.rs` | what several methods share: a layer of one fixed pattern, the routed kernels' paths |
//! | `methods/` | one file per method (`fixed.rs`: full, SWA, PPA, StaticHybrid; `aha.rs`: AHA and static heads; `l2a.rs`; `swiattn.rs`), each with its `MethodSpec`, and the registry of them (`methods/mod.rs`) |
//! | `layer.rs` | `SelfAttention`: the base projections and the method's part, built from its spec |
//!
//! Each file imports only those above it in this table; method files never import each other.
//! A call runs on the kernel library, on the dense reference path (correct everywhere, the
//! definition the kernels are tested against), or decoding over a cache; every method computes
//! the same function on each, and the kernels only skip work whose result is multiplied by a
//! hard zero.

mod base;
mod cache;
mod ctx;
mod gates;
mod layer;
mod methods;
mod patterns;
mod shared;
mod spec;
#[cfg(test)]
mod tests;

pub(crate) use base::{projection_params, AttnOutput, Regulariser};
pub(crate) use cache::{CacheState, Keys, LayerCache};
pub use ctx::ForwardCtx;
pub(crate) use ctx::GateOverride;
pub(crate) use layer::SelfAttention;
pub(crate) use methods::{all as all_methods, spec, UsageRamp, HEAD_RANKING_COLUMNS};
pub(crate) use patterns::{KeyPattern, MaskCache};
pub(crate) use shared::routed_paths;
pub(crate) use spec::{
    BenchKnobs, BenchVariant, CellKind, Gates, MethodSpec, PaperUsageAt, Provenance, Report,
    SettingColumn, SettingCurve, TableCell, Value, SHARED_COLUMNS,
};
// What the kernels' tests compare with: the reference attention, gates and pair counts.
#[cfg(test)]
pub(crate) use {
    gates::{hash_uniform, threshold},
    patterns::attend,
    shared::routed_pairs,
};

/// `modeling_attnsweep.py` for a model of method `m`: the decoder transformers runs
/// (`hf/modeling_attnsweep.py`) and the method's own layer (`MethodSpec::hf`).
pub(crate) fn hf_modeling(m: crate::config::Method) -> String {
    format!(
        "{}\n\n{}",
        include_str!("hf/modeling_attnsweep.py"),
        spec(m).hf
    )
}
