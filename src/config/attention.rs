//! `[attention]`: which method, and every method's settings, with each method's facts about
//! them in one place: which settings it reads (`AttentionConfig::reads`, the rest are set
//! aside when a sweep cell's id is computed) and the checks that concern it alone.
//!
//! A new method adds its variant to `Method` and `Method::ALL`, its fields to `AttentionConfig`
//! (with their defaults, and their range checks in `validate`), its arm to `reads`, and its
//! fields to `canonical`'s list.

use super::check::{check, check_open_f};
use super::{name_of, ModelConfig, TrainConfig};
use anyhow::{bail, ensure, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    Full,
    Swa,
    Ppa,
    StaticHybrid,
    /// All-or-Here: per (token, head) choice between full and window.
    Aha,
    /// Learning to Attend: local attention, then a second, global module for routed tokens.
    L2a,
    /// Switch attention: per token choice between a full and a window branch.
    Swiattn,
    /// The top-k (layer, head) pairs of a head ranking always full, the rest window.
    StaticHeads,
    /// Attention sinks (StreamingLLM; DuoAttention's streaming heads): the sequence's first
    /// `sink_tokens` keys and the window.
    Sinks,
}

impl Method {
    /// Every method, in the order tables and the CLI list them.
    pub(crate) const ALL: [Method; 9] = [
        Method::Full,
        Method::Swa,
        Method::Ppa,
        Method::StaticHybrid,
        Method::Aha,
        Method::L2a,
        Method::Swiattn,
        Method::StaticHeads,
        Method::Sinks,
    ];
}

/// Which implementation computes attention.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum AttnImpl {
    /// The CUDA kernels when the model is on a GPU, computes in bf16 and a kernel library
    /// is built (`attnsweep kernels build`); the reference path otherwise.
    Auto,
    /// Dense PyTorch attention with masks (runs anywhere; the definition the kernels are
    /// tested against).
    Reference,
    /// The kernel library; an error when it cannot run. On the CPU this is the library's
    /// ATen reference, which exercises the same wiring.
    Cuda,
}

/// Where a routed method's gates come from.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Router {
    /// A learned linear router with a straight-through gate.
    Learned,
    /// Context-free: each gate drawn i.i.d. Bernoulli(bernoulli_p).
    Bernoulli,
}

/// How L2A's global module starts.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum L2aStart {
    /// Its Q/K/V/O copies of the base attention (the paper's and the authors' code): with
    /// every gate open at the start, each layer adds a second attention output.
    Copy,
    /// Its output projection at zero, Q/K/V copies: the global branch adds nothing at the
    /// start, so the model starts as its window alone (the base with SWA) and the branch
    /// grows from there.
    Inert,
}

/// How a per-token quantity over the hidden dimension is reduced to one number.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Reduction {
    Mean,
    Sum,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AttentionConfig {
    pub method: Method,
    /// Sliding-window size w: query i sees keys i-w+1..=i.
    pub window: usize,
    /// PPA power p in [0, 1].
    pub ppa_power: f64,
    /// static_hybrid: layers every-1, 2*every-1, ... are full, the rest use the window.
    pub hybrid_every: usize,
    /// Gate threshold: AHA and SwiAttn take the full path when s > tau, L2A when s >= tau.
    /// May differ between training and evaluation.
    pub tau: f64,
    /// AHA: weight of the L1 penalty on router scores; L2A: of the squared penalty.
    pub lambda: f64,
    /// AHA training: fraction of the (token, head) pairs that picked the window whose
    /// full-path output is still computed, for the straight-through router gradient
    /// `dy . (full - local)`; their router gradient is scaled by 1 / ste_sample, so it stays
    /// an unbiased estimate of the exact one and the other such pairs need no full path.
    /// 1 (the default) computes it for every pair: the exact gradient of the paper.
    pub ste_sample: f64,
    pub router: Router,
    /// Bernoulli router: probability that a gate is 1.
    pub bernoulli_p: f64,
    /// Bernoulli router: per layer, the probability of each of its gates (a head's for AHA,
    /// the layer's one gate for L2A and SwiAttn), in place of `bernoulli_p`: random gates
    /// matched to a learned router's usage gate by gate (a grid's `match_usage` sets it).
    /// Empty (the default): `bernoulli_p` everywhere.
    pub bernoulli_rates: Vec<Vec<f64>>,
    /// AHA and SwiAttn: initial router bias (router weights start at zero). The default,
    /// sigmoid(1) = 0.73 > tau, starts every gate on the full path, as a full-attention base
    /// model behaves.
    pub router_init_bias: f64,
    /// L2A: probability per training step of running global attention for every token,
    /// so the router gets a language-model gradient on tokens it masked.
    pub p_force: f64,
    /// L2A: layers (0-based) whose global module was pruned; they keep only the window.
    pub pruned_layers: Vec<usize>,
    /// L2A: how the global module starts ("copy", the default, or "inert").
    pub l2a_start: L2aStart,
    /// SwiAttn adaptive regulariser: gamma = gamma_base / (eps + NLL + alpha * ||O_full - O_swa||^2).
    pub swiattn_gamma_base: f64,
    pub swiattn_eps: f64,
    pub swiattn_alpha: f64,
    /// false: gamma = gamma_base (ablation V1).
    pub swiattn_adaptive: bool,
    /// false: drop the NLL term (ablation V2).
    pub swiattn_nll: bool,
    /// true: both branches share one output projection; false: each owns one, both
    /// initialised from the base model's.
    pub swiattn_shared_o_proj: bool,
    /// How the branches' disagreement ||O_full - O_swa||^2 is reduced over the hidden
    /// dimension: the mean (the paper's "mean squared error", the default) or the sum (the
    /// squared norm, hidden_size times the mean, so alpha weighs it that much more).
    pub swiattn_disagreement: Reduction,
    /// static_heads: a head_ranking.csv written by `attnsweep eval` of an AHA model.
    pub head_ranking: PathBuf,
    /// static_heads: how many of the top-ranked heads are always full; 0 takes the ranked
    /// model's budget (its per-head usage summed and rounded: the same share of full calls).
    pub top_k: usize,
    /// aha: start the routers at a static assignment: a head_ranking.csv whose first `top_k`
    /// heads (0: the ranked model's budget, as static heads count it) start open and the rest
    /// closed (router bias +|router_init_bias| and -|router_init_bias|); empty: every head
    /// starts at `router_init_bias`.
    pub router_init_heads: PathBuf,
    /// static_heads: ramp the full heads along another run's usage: that run's
    /// `train_log.csv` (its `mu_f` by step). At each fraction of training the first
    /// round(k x mu_f / its last mu_f) of the k ranked heads run full, k the assignment's
    /// (`top_k`), at most k (a usage above its last is capped: all k); empty: all k from the
    /// first step. Evaluation, in training (`eval_every`) and after, runs all k.
    pub top_k_ramp: PathBuf,
    /// sinks: how many of the sequence's first tokens every query sees beside its window
    /// (StreamingLLM keeps 4).
    pub sink_tokens: usize,
    pub attn_impl: AttnImpl,
}

impl Default for AttentionConfig {
    fn default() -> Self {
        AttentionConfig {
            method: Method::Full,
            window: 64,
            ppa_power: 0.5,
            hybrid_every: 4,
            tau: 0.5,
            lambda: 3e-4,
            ste_sample: 1.0,
            router: Router::Learned,
            bernoulli_p: 0.1,
            bernoulli_rates: Vec::new(),
            router_init_bias: 1.0,
            p_force: 0.1,
            pruned_layers: Vec::new(),
            l2a_start: L2aStart::Copy,
            swiattn_gamma_base: 1e-3,
            swiattn_eps: 0.1,
            swiattn_alpha: 100.0,
            swiattn_adaptive: true,
            swiattn_nll: true,
            swiattn_shared_o_proj: false,
            swiattn_disagreement: Reduction::Mean,
            head_ranking: PathBuf::new(),
            top_k: 0,
            top_k_ramp: PathBuf::new(),
            router_init_heads: PathBuf::new(),
            sink_tokens: 4,
            attn_impl: AttnImpl::Auto,
        }
    }
}

impl AttentionConfig {
    /// The settings of this section its method reads, by key: `method` and `attn_impl` always;
    /// a method with a router reads `router`, and `bernoulli_p` for context-free gates or its
    /// learned router's settings otherwise. Two configs that differ only in the others compute
    /// the same thing.
    pub(crate) fn reads(&self) -> Vec<&'static str> {
        let mut keys = vec!["method", "attn_impl"];
        let learned = self.router == Router::Learned;
        // A method with a router: the settings its learned router reads.
        let router = |keys: &mut Vec<&'static str>, learned_reads: &[&'static str]| {
            keys.push("router");
            match learned {
                true => keys.extend(learned_reads),
                false => keys.extend(["bernoulli_p", "bernoulli_rates"]),
            }
        };
        match self.method {
            Method::Full => {}
            Method::Swa => keys.push("window"),
            Method::Ppa => keys.extend(["window", "ppa_power"]),
            Method::StaticHybrid => keys.extend(["window", "hybrid_every"]),
            Method::Aha => {
                keys.push("window");
                router(
                    &mut keys,
                    &[
                        "tau",
                        "lambda",
                        "ste_sample",
                        "router_init_bias",
                        "router_init_heads",
                        "top_k",
                    ],
                );
            }
            Method::L2a => {
                keys.extend(["window", "pruned_layers", "l2a_start"]);
                router(&mut keys, &["tau", "lambda", "p_force"]);
            }
            Method::Swiattn => {
                keys.extend(["window", "swiattn_shared_o_proj"]);
                // gamma = gamma_base without the adaptive weight, whose terms are then unread;
                // with alpha 0 the disagreement's reduction is unread.
                let regulariser: &[&'static str] = match (self.swiattn_adaptive, self.swiattn_alpha)
                {
                    (false, _) => &["swiattn_gamma_base", "swiattn_adaptive"],
                    (true, a) if a == 0.0 => &[
                        "swiattn_gamma_base",
                        "swiattn_adaptive",
                        "swiattn_eps",
                        "swiattn_alpha",
                        "swiattn_nll",
                    ],
                    (true, _) => &[
                        "swiattn_gamma_base",
                        "swiattn_adaptive",
                        "swiattn_eps",
                        "swiattn_alpha",
                        "swiattn_nll",
                        "swiattn_disagreement",
                    ],
                };
                router(
                    &mut keys,
                    &[&["tau", "router_init_bias"][..], regulariser].concat(),
                );
            }
            Method::StaticHeads => keys.extend(["window", "head_ranking", "top_k", "top_k_ramp"]),
            Method::Sinks => keys.extend(["window", "sink_tokens"]),
        }
        keys
    }

    /// Whether its method's gates are drawn at random, afresh each step: context-free
    /// (Bernoulli) gates, or straight-through gates sampled (`ste_sample` below 1).
    pub(crate) fn draws_gates(&self) -> bool {
        let a = self.canonical();
        a.router == Router::Bernoulli || a.ste_sample < 1.0
    }

    /// The same computation with every setting its method does not read (`reads`) at its
    /// default: `lambda` on a full-attention model, `ppa_power` on a window, the regulariser of
    /// context-free gates.
    pub(crate) fn canonical(&self) -> AttentionConfig {
        let keep = self.reads();
        let d = AttentionConfig::default();
        let mut a = self.clone();
        macro_rules! reset_unread {
            ($($field:ident),*) => {
                $(if !keep.contains(&stringify!($field)) {
                    a.$field = d.$field.clone();
                })*
            };
        }
        // Every field but `method` and `attn_impl`, which every method reads (a test holds
        // this list to the struct's fields).
        reset_unread!(
            window,
            ppa_power,
            hybrid_every,
            tau,
            lambda,
            ste_sample,
            router,
            bernoulli_p,
            bernoulli_rates,
            router_init_bias,
            p_force,
            pruned_layers,
            l2a_start,
            swiattn_gamma_base,
            swiattn_eps,
            swiattn_alpha,
            swiattn_adaptive,
            swiattn_nll,
            swiattn_shared_o_proj,
            swiattn_disagreement,
            head_ranking,
            top_k,
            top_k_ramp,
            router_init_heads,
            sink_tokens
        );
        a
    }

    /// Every setting's range, and the checks that concern one method's settings alone.
    pub(crate) fn validate(&self, m: &ModelConfig, train: &TrainConfig) -> Result<()> {
        let a = self;
        check("attention.window", a.window, 1, 1 << 30)?;
        check("attention.ppa_power", a.ppa_power, 0.0, 1.0)?;
        check("attention.hybrid_every", a.hybrid_every, 1, 1024)?;
        check("attention.tau", a.tau, 0.0, 1.0)?;
        check("attention.lambda", a.lambda, 0.0, 1e3)?;
        if !(a.ste_sample > 0.0 && a.ste_sample <= 1.0) {
            bail!(
                "attention.ste_sample = {} is out of range: allowed in (0, 1]",
                a.ste_sample
            );
        }
        check("attention.bernoulli_p", a.bernoulli_p, 0.0, 1.0)?;
        for layer in &a.bernoulli_rates {
            for &p in layer {
                check("attention.bernoulli_rates", p, 0.0, 1.0)?;
            }
        }
        ensure!(
            a.bernoulli_rates.is_empty() || a.bernoulli_rates.len() == m.num_hidden_layers,
            "attention.bernoulli_rates holds {} layers, the model {}: one list of rates a layer",
            a.bernoulli_rates.len(),
            m.num_hidden_layers
        );
        // A layer's list: one rate for all its gates, or one a gate (AHA gates each head;
        // L2A and SwiAttn gate each token once a layer; no other method draws Bernoulli
        // gates). Any other length would be read as neither. The methods' registry sits in
        // the model layer, above this one, so the count is stated here.
        let gates_a_layer = match a.method {
            Method::Aha => m.num_attention_heads,
            _ => 1,
        };
        if let Some((l, r)) = a
            .bernoulli_rates
            .iter()
            .enumerate()
            .find(|(_, r)| r.len() != 1 && r.len() != gates_a_layer)
        {
            bail!(
                "attention.bernoulli_rates: layer {l} holds {} rates; {:?} has {gates_a_layer} \
                 gate(s) a layer: give one rate a layer or one a gate",
                r.len(),
                a.method
            );
        }
        check(
            "attention.router_init_bias",
            a.router_init_bias,
            -30.0,
            30.0,
        )?;
        check("attention.p_force", a.p_force, 0.0, 1.0)?;
        if let Some(&l) = a.pruned_layers.iter().find(|&&l| l >= m.num_hidden_layers) {
            bail!(
                "attention.pruned_layers holds {l}, but the model has layers 0 ..= {}",
                m.num_hidden_layers - 1
            );
        }
        if !a.pruned_layers.is_empty() && a.method != Method::L2a {
            bail!("attention.pruned_layers applies to method \"l2a\" only");
        }
        if train.router_hold_steps > 0 && !(a.method == Method::L2a && a.router == Router::Learned)
        {
            bail!(
                "train.router_hold_steps = {} applies to method \"l2a\" with a learned router only; \
                 set it to 0 or use attention.method = \"l2a\"",
                train.router_hold_steps
            );
        }
        let penalised =
            matches!(a.method, Method::Aha | Method::L2a) && a.router == Router::Learned;
        if train.lambda_ramp && !penalised {
            bail!(
                "train.lambda_ramp schedules the penalty of a learned router (methods \"aha\" and \
                 \"l2a\"), which this run has none of; set it to false"
            );
        }
        check(
            "attention.swiattn_gamma_base",
            a.swiattn_gamma_base,
            0.0,
            1e3,
        )?;
        check_open_f("attention.swiattn_eps", a.swiattn_eps, 0.0, 1e3)?;
        check("attention.swiattn_alpha", a.swiattn_alpha, 0.0, 1e6)?;
        check("attention.sink_tokens", a.sink_tokens, 1, 1 << 20)?;
        ensure!(
            a.method == Method::Aha || a.router_init_heads.as_os_str().is_empty(),
            "attention.router_init_heads starts AHA's routers; attention.method = \"{}\" has none \
             (leave it out or use aha)",
            name_of(a.method)
        );
        ensure!(
            a.method == Method::StaticHeads || a.top_k_ramp.as_os_str().is_empty(),
            "attention.top_k_ramp ramps static heads; attention.method = \"{}\" has none (leave \
             it out or use static_heads)",
            name_of(a.method)
        );
        if a.method == Method::StaticHeads {
            if a.head_ranking.as_os_str().is_empty() {
                bail!("attention.method = \"static_heads\" needs attention.head_ranking (a head_ranking.csv from eval of an AHA run)");
            }
            check(
                "attention.top_k",
                a.top_k,
                0,
                m.num_hidden_layers * m.num_attention_heads,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use toml::Value;

    /// `canonical` knows every setting: a full-attention config (which reads none of them)
    /// with every setting but `method` and `attn_impl` changed comes back as the defaults.
    #[test]
    fn canonical_resets_every_setting_a_method_does_not_read() {
        let defaults = toml::Table::try_from(AttentionConfig::default()).unwrap();
        let mut changed = defaults.clone();
        for (k, v) in changed.iter_mut() {
            if k == "method" || k == "attn_impl" {
                continue;
            }
            *v = match (k.as_str(), v.clone()) {
                (_, Value::Integer(i)) => Value::Integer(i + 1),
                (_, Value::Float(f)) => Value::Float(f + 0.125),
                (_, Value::Boolean(b)) => Value::Boolean(!b),
                ("router", _) => Value::String("bernoulli".into()),
                ("swiattn_disagreement", _) => Value::String("sum".into()),
                ("l2a_start", _) => Value::String("inert".into()),
                ("bernoulli_rates", _) => Value::Array(vec![Value::Array(vec![Value::Float(0.5)])]),
                (_, Value::String(s)) => Value::String(s + "x"),
                (_, Value::Array(_)) => Value::Array(vec![Value::Integer(1)]),
                (k, other) => panic!("{k} = {other}: give this test a changed value of its type"),
            };
        }
        let a: AttentionConfig = Value::Table(changed.clone()).try_into().unwrap();
        let back = toml::Table::try_from(&a).unwrap();
        for (k, v) in &back {
            if k != "method" && k != "attn_impl" {
                assert_ne!(Some(v), defaults.get(k), "{k} was not changed");
            }
        }
        assert_eq!(a.canonical(), AttentionConfig::default());
    }

    /// `Method::ALL` lists every method once, in declaration order: the variants as serde
    /// knows them (from the error a name it does not know gives) are ALL's names.
    #[test]
    fn every_method_is_listed_once() {
        let names: Vec<String> = Method::ALL
            .iter()
            .map(|m| Value::try_from(m).unwrap().as_str().unwrap().to_string())
            .collect();
        let e = Value::String("\u{1}".into())
            .try_into::<Method>()
            .unwrap_err()
            .to_string();
        let declared: Vec<&str> = e
            .split_once("expected")
            .unwrap()
            .1
            .split('`')
            .skip(1)
            .step_by(2)
            .collect();
        assert_eq!(names, declared, "{e}");
    }
}
