//! A method's facts, stated once in its own file beside its maths (`MethodSpec`): how its part
//! of a layer is built, what it adds, reads and forces, how the benches time it, and what it
//! reports: its label, the columns of its settings, its names in the papers' tables, the paper
//! tables and figures it fills, and the examples every generated test runs. The registry
//! (`methods/mod.rs`) lists every method's; the memory plan, training, the benches and the
//! sweep's rows, tables and figures read them there and hold no `match` on methods.

use super::base::{Build, Route};
use crate::config::{AttentionConfig, Method, ModelConfig, Router};
use anyhow::Result;

/// Where a method's gates sit: none (a fixed pattern), one per (token, head), or one per token
/// shared by its heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gates {
    None,
    PerHead,
    PerToken,
}

/// A method's facts.
pub(crate) struct MethodSpec {
    pub(crate) method: Method,
    /// How tables, figures and the CLI name it ("AHA").
    pub(crate) label: &'static str,
    /// Where its gates sit.
    pub(crate) gates: Gates,
    /// Whether it reads `attention.window` (every method but full attention).
    pub(crate) windowed: bool,
    /// Whether its reference path builds a dense `[L, L]` mask per pattern (every method but
    /// full attention, which runs the fused causal kernel).
    pub(crate) dense_mask: bool,
    /// Builds its part of one layer.
    pub(super) build: fn(&Build) -> Box<dyn Route>,
    /// Parameters it adds to one layer's attention (routers are negligible and not counted).
    pub(crate) extra_params: fn(&ModelConfig, &AttentionConfig) -> f64,
    /// What it reads from files before the model is built: a `[layer][head]` assignment, each
    /// chosen head's place in its ranking (static heads: the heads always full; AHA started at
    /// a static budget: the heads whose routers start open), None where it reads none.
    pub(crate) fixed_heads: fn(&ModelConfig, &AttentionConfig) -> Result<Option<HeadRanks>>,
    /// Probability per training step that every token runs its global path (L2A's `p_force`).
    pub(crate) force_global: fn(&AttentionConfig) -> f64,
    /// Its own settings, shown beside its window where figures name a cell (`λ 0.0003`), given
    /// the attention it ran with, the model's heads and the usage measured (None: not routed).
    pub(crate) describe: fn(&AttentionConfig, usize, Option<f64>) -> Vec<String>,
    /// Its configuration's name in its paper's ablation table ("" where it has none).
    pub(crate) variant: fn(&AttentionConfig) -> String,
    /// The variants `bench train` times (`--methods`), each with its training setup.
    pub(crate) bench: &'static [BenchVariant],
    /// Full attention: the reference of every retain %, quality panel and prefill speed-up.
    pub(crate) reference: bool,
    /// A pattern that runs on weights trained without it (SWA on full attention's): an
    /// evaluation of one is a zero-shot cell, and the Pareto table says so.
    pub(crate) zero_shot: bool,
    /// Its layers can drop what they add once trained (`attnsweep prune`: L2A's global module).
    pub(crate) prunable: bool,
    /// The columns of its own settings in `summary.csv` (and `timing.csv`).
    pub(crate) columns: &'static [SettingColumn],
    /// Its row's name where the papers set a method beside its baselines (SwiAttn Tables 1-3:
    /// "SWA-ZS", "StaticHybrid", "SwiAttn"), by how the cell came to be; None: not there.
    pub(crate) baseline: Option<fn(&Provenance) -> &'static str>,
    /// Its row's name in AHA Table 5, dynamic heads against static ones at one budget ("AHA",
    /// "top-8 (AHA's budget)", "all heads window"), given the attention it ran with, how the
    /// cell came to be, the model's (layer, head) pairs and the usage measured; "" where it has
    /// no row there.
    pub(crate) head_budget: fn(&AttentionConfig, &Provenance, usize, Option<f64>) -> String,
    /// The paper tables and figures of its own (the shared ones, `summary.csv`, `pareto.csv`,
    /// the loss curves, hold every method).
    pub(crate) reports: &'static [Report],
    /// Its layer in plain PyTorch for transformers (`methods/<file>.py`): the part `attnsweep
    /// export` writes into `modeling_attnsweep.py` beside the shared decoder
    /// (`hf/modeling_attnsweep.py`), registering the method under its config name.
    pub(crate) hf: &'static str,
    /// The configurations every generated test runs it at (`tests.rs`, `step.rs`, `llama.rs`):
    /// a new method is checked by them as soon as it is registered.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) examples: &'static [Example],
}

/// One variant of a method in `bench train`.
pub(crate) struct BenchVariant {
    pub(crate) name: &'static str,
    /// The training bench's settings beside the method: the usage its gates open at and the
    /// share of window pairs whose full path is computed for the router.
    pub(crate) setup: fn(&mut AttentionConfig, &BenchKnobs),
    /// Its learned router is set to open at `BenchKnobs::full_usage` before timing.
    pub(crate) calibrate_router: bool,
    /// The PyTorch peer (`kernels/train_peer.py`) implements it under this name.
    pub(crate) peer: Option<&'static str>,
    /// What it computes depends on the window (`--window`); on the gates' usage
    /// (`--full-usage`); on PPA's power (`--ppa-power`). A setting it does not read is not
    /// part of its case.
    pub(crate) reads_window: bool,
    pub(crate) reads_usage: bool,
    pub(crate) reads_power: bool,
}

/// The settings of `bench train` a method's variant may read.
pub(crate) struct BenchKnobs {
    pub(crate) full_usage: f64,
    pub(crate) ste_sample: f64,
}

/// How a cell's numbers were made: by training, by evaluating a model again, or by pruning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CellKind {
    Trained,
    Evaluated,
    Pruned,
}

/// How a cell came to be, as the papers' tables name it.
pub(crate) struct Provenance {
    pub(crate) kind: CellKind,
    /// It continued from, or evaluates, a model of the reference method (full attention).
    pub(crate) from_reference: bool,
}

/// A setting's value in a table.
pub(crate) enum Value {
    Number(f64),
    Text(String),
}

/// One setting column of `summary.csv`. The columns of the settings the shared layers read
/// come first (`SHARED_COLUMNS`), then the methods' own in the registry's order: those written
/// for every cell, then those written for the method's cells alone.
pub(crate) struct SettingColumn {
    pub(crate) name: &'static str,
    pub(crate) value: fn(&AttentionConfig) -> Value,
    /// Written for every cell (a paper's axis, which its tables read of every row), or only
    /// for the cells of the method that declares it (empty elsewhere).
    pub(crate) every_cell: bool,
    /// The papers' methods' columns stand in every summary, so that the summaries of different
    /// sweeps line up; a method beyond the papers adds its columns where the sweep ran it.
    pub(crate) in_every_summary: bool,
    /// It changes what a cell's time measures: `timing.csv` names it beside the window.
    pub(crate) timed: bool,
}

/// The settings the shared layers read, whichever method reads them: the window of every
/// windowed method and the learned routers' penalty and threshold.
pub(crate) const SHARED_COLUMNS: [SettingColumn; 3] = [
    shared("window", |a| Value::Number(a.window as f64)),
    shared("lambda", |a| Value::Number(a.lambda)),
    shared("tau", |a| Value::Number(a.tau)),
];

const fn shared(name: &'static str, value: fn(&AttentionConfig) -> Value) -> SettingColumn {
    SettingColumn {
        name,
        value,
        every_cell: true,
        in_every_summary: true,
        timed: false,
    }
}

/// What a paper table knows of one cell when it picks its rows.
pub(crate) struct TableCell<'a> {
    pub(crate) method: Method,
    pub(crate) kind: CellKind,
    pub(crate) router: Router,
    /// Its method is the reference (full attention).
    pub(crate) reference: bool,
    /// Its name beside the papers' methods (`MethodSpec::baseline`), where its method has one.
    pub(crate) baseline: Option<&'static str>,
    /// Its row's name in AHA Table 5 (`MethodSpec::head_budget`; "" where none).
    pub(crate) head_budget: &'a str,
}

/// One paper table drawn from the summary: the cells it holds, with the named columns, sorted.
pub(crate) struct PaperTable {
    pub(crate) file: &'static str,
    pub(crate) holds: fn(&TableCell) -> bool,
    /// Written only where a cell it holds also passes this (the table's subject is there).
    pub(crate) subject: fn(&TableCell) -> bool,
    pub(crate) columns: &'static [&'static str],
    pub(crate) sort: &'static [&'static str],
}

/// A method's quality against one of its own settings, beside the probes, the long-range
/// recall and the time of the cells timed alone (PPA Fig. 3 and Table 1).
pub(crate) struct SettingCurve {
    /// The grid key (`attention.ppa_power`), the figure's stem, the setting's symbol in
    /// titles and the x axis's name.
    pub(crate) key: &'static str,
    pub(crate) stem: &'static str,
    pub(crate) symbol: &'static str,
    pub(crate) axis: &'static str,
    pub(crate) value: fn(&AttentionConfig) -> f64,
    /// The setting's value at which the method is full attention (PPA's p = 1), whose probes
    /// stand for full attention's where the sweep trained none.
    pub(crate) full_at: Option<f64>,
    /// The setting is swept over decades (a regulariser's weight): a log axis.
    pub(crate) log: bool,
}

/// A fixed per-head assignment, `[layer][head]`: a head's place in the ranking it was chosen
/// by where it is always full (0 the first), None where it is not.
pub(crate) type HeadRanks = Vec<Vec<Option<usize>>>;

/// What a method reports beyond the tables and figures every method fills.
pub(crate) enum Report {
    /// A table of the summary's rows.
    Table(PaperTable),
    /// Every head of its cells, with its usage and the gaps between its full-path calls (AHA
    /// Table 3), in this file.
    HeadGaps { file: &'static str },
    /// Its learned routers' layer x head usage maps and every head sorted (AHA Figs. 3/4).
    HeadUsage,
    /// Its learned routers' usage and loss against lambda (AHA Table 4), beside the usage its
    /// paper reports at each (window, lambda) it ran, named by `source`.
    LambdaAblation {
        paper: &'static [PaperUsageAt],
        source: &'static str,
    },
    /// Its learned cells' loss against attention work as the test-time threshold moves (L2A
    /// Fig. 13).
    ThresholdSweep,
    /// Quality against one of its own settings.
    Curve(SettingCurve),
    /// The share of full attention (mu_f) its paper reports at its headline setting, and
    /// where: the reference line of the budget figure's usage panel.
    PaperUsage { mu_f: f64, source: &'static str },
}

/// A share of full attention a paper reports at one window and lambda.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PaperUsageAt {
    pub(crate) window: f64,
    pub(crate) lambda: f64,
    pub(crate) mu_f: f64,
}

/// One configuration of a method that the generated tests run (`examples`).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) struct Example {
    pub(crate) name: &'static str,
    /// Sets the method and its settings on a tiny model's attention.
    pub(crate) set: fn(&mut AttentionConfig),
}

/// The defaults of `MethodSpec`'s hooks for a method that adds, reads and forces nothing.
pub(super) fn no_extra_params(_: &ModelConfig, _: &AttentionConfig) -> f64 {
    0.0
}

pub(super) fn no_fixed_heads(_: &ModelConfig, _: &AttentionConfig) -> Result<Option<HeadRanks>> {
    Ok(None)
}

pub(super) fn never_forced(_: &AttentionConfig) -> f64 {
    0.0
}

pub(super) fn no_variant(_: &AttentionConfig) -> String {
    String::new()
}

pub(super) fn no_setup(_: &mut AttentionConfig, _: &BenchKnobs) {}

pub(super) fn no_head_budget(
    _: &AttentionConfig,
    _: &Provenance,
    _: usize,
    _: Option<f64>,
) -> String {
    String::new()
}
