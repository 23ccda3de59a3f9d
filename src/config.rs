//! The experiment file: one TOML document with `[model]`, `[attention]`, `[data]`, `[train]`
//! and `[eval]` sections. Every field has a default, unknown keys are errors, and every value
//! is range-checked with a message naming its key. `--set section.key=value` overrides are
//! applied to the TOML tree before it is parsed, so they obey exactly the same rules.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub model: ModelConfig,
    pub attention: AttentionConfig,
    pub data: DataConfig,
    pub train: TrainConfig,
    pub eval: EvalConfig,
}

/// Field names follow the Hugging Face `config.json` of Llama-family models so a converted
/// model's configuration carries over unchanged.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// 0 means "take it from the prepared data set"; the resolved config holds the real value.
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// 0 means hidden_size / num_attention_heads.
    pub head_dim: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub attention_bias: bool,
    pub tie_word_embeddings: bool,
    pub initializer_range: f64,
    /// RMSNorm of queries and keys: none (Llama, Qwen2), per head over head_dim before RoPE
    /// (Qwen3), or over the whole projection (OLMo-2).
    pub qk_norm: QkNorm,
    /// pre: norm before attention and MLP (Llama); post: norm on their outputs before the
    /// residual add (OLMo-2).
    pub norm_placement: NormPlacement,
    /// Hugging Face's rope_scaling: None, linear or llama3.
    pub rope_scaling: Option<RopeScaling>,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm {
    None,
    PerHead,
    Full,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum NormPlacement {
    Pre,
    Post,
}

/// Rotary frequency scaling as Hugging Face configs write it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RopeScaling {
    /// "linear" or "llama3".
    pub rope_type: String,
    pub factor: f64,
    #[serde(default)]
    pub low_freq_factor: Option<f64>,
    #[serde(default)]
    pub high_freq_factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<f64>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            vocab_size: 0,
            hidden_size: 128,
            intermediate_size: 384,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 4,
            head_dim: 0,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-5,
            attention_bias: false,
            tie_word_embeddings: true,
            initializer_range: 0.02,
            qk_norm: QkNorm::None,
            norm_placement: NormPlacement::Pre,
            rope_scaling: None,
        }
    }
}

impl ModelConfig {
    pub fn head_dim(&self) -> usize {
        if self.head_dim == 0 {
            self.hidden_size / self.num_attention_heads.max(1)
        } else {
            self.head_dim
        }
    }
}

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
}

impl Method {
    pub fn is_routed(self) -> bool {
        matches!(
            self,
            Method::Aha | Method::L2a | Method::Swiattn | Method::StaticHeads
        )
    }
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
    /// AHA and SwiAttn: initial router bias (router weights start at zero). The default,
    /// sigmoid(1) = 0.73 > tau, starts every gate on the full path, as a full-attention base
    /// model behaves.
    pub router_init_bias: f64,
    /// L2A: probability per training step of running global attention for every token,
    /// so the router gets a language-model gradient on tokens it masked.
    pub p_force: f64,
    /// L2A: layers (0-based) whose global module was pruned; they keep only the window.
    pub pruned_layers: Vec<usize>,
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
            router_init_bias: 1.0,
            p_force: 0.1,
            pruned_layers: Vec::new(),
            swiattn_gamma_base: 1e-3,
            swiattn_eps: 0.1,
            swiattn_alpha: 100.0,
            swiattn_adaptive: true,
            swiattn_nll: true,
            swiattn_shared_o_proj: false,
            swiattn_disagreement: Reduction::Mean,
            head_ranking: PathBuf::new(),
            top_k: 0,
            attn_impl: AttnImpl::Auto,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// A directory written by `attnsweep data prepare` or `attnsweep data synth`.
    pub dir: PathBuf,
    pub seq_len: usize,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            dir: PathBuf::new(),
            seq_len: 256,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    Fp32,
    Bf16,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    pub steps: usize,
    pub batch_size: usize,
    pub grad_accum: usize,
    pub lr: f64,
    /// Cosine decay ends at lr * min_lr_ratio.
    pub min_lr_ratio: f64,
    pub warmup_steps: usize,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub adam_eps: f64,
    /// Global gradient-norm clip; 0 disables clipping.
    pub grad_clip: f64,
    pub seed: u64,
    /// Compute dtype; parameters and optimizer state stay fp32.
    pub dtype: Dtype,
    /// "auto" (CUDA when available), "cpu", "cuda" or "cuda:N".
    pub device: String,
    pub log_every: usize,
    pub ckpt_every: usize,
    /// How many step checkpoints to keep on disk (the newest ones).
    pub keep_checkpoints: usize,
    /// Validation loss every N steps (0: only at the end).
    pub eval_every: usize,
    /// Keep the MLP weights fixed; train attention, routers and norms only (L2A E.1.3).
    pub freeze_mlp: bool,
    /// L2A with a learned router: for the first N steps of the run every gate is held open
    /// (every token runs global attention) and the router does not learn, so the global
    /// module trains on every token before the router judges it. Not in the paper (0, the
    /// default): a diagnostic of router collapse, which happens when the router closes
    /// before the global module, started as a copy of attention reading other inputs, has
    /// become useful.
    pub router_hold_steps: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 1000,
            batch_size: 16,
            grad_accum: 1,
            lr: 3e-3,
            min_lr_ratio: 0.1,
            warmup_steps: 100,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            adam_eps: 1e-8,
            grad_clip: 1.0,
            seed: 1337,
            dtype: Dtype::Fp32,
            device: "auto".into(),
            log_every: 10,
            ckpt_every: 200,
            keep_checkpoints: 2,
            eval_every: 0,
            freeze_mlp: false,
            router_hold_steps: 0,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Sequences per forward pass (loss evaluation, probes and multiple-choice items).
    pub batch_size: usize,
    /// At most this many batches of the validation split (0: all of it).
    pub max_batches: usize,
    /// Length of the sequences the loss and gate statistics are measured on (0: data.seq_len).
    /// Longer than training measures how a model extends, and lets gaps between a head's
    /// full-attention calls run longer before the sequence end cuts them off.
    pub seq_len: usize,
    /// Long-context probes run after the loss evaluation, scored by greedy generation:
    /// niah_single, niah_multikey, niah_multivalue, passkey, mqar, variable_tracking.
    pub tasks: Vec<String>,
    /// Prompt lengths of the probes in tokens (empty: data.seq_len).
    pub lengths: Vec<usize>,
    /// Depths of the relevant needle, 0 = start of the context, 1 = just before the question.
    pub depths: Vec<f64>,
    /// Probes per (task, length, depth).
    pub samples: usize,
    pub haystack: HaystackKind,
    /// Data set whose val split the text haystack is cut from (empty: data.dir).
    pub haystack_dir: PathBuf,
    pub probe_seed: u64,
    /// Digits of magic numbers and pass keys. Unset: the value the data set's probe documents
    /// were written with (`data probes`), else 7.
    pub digits: Option<usize>,
    /// Needles of the multi-key and multi-value tasks; variables in a tracking chain. Unset:
    /// the data set's probe documents', else 4.
    pub needles: Option<usize>,
    /// Keys asked at once in MQAR. Unset: the data set's probe documents', else 4.
    pub queries: Option<usize>,
    /// Multiple-choice task files: JSONL lines with context, choices and gold (the index of
    /// the right choice), in the lm-evaluation-harness shape.
    pub mc: Vec<PathBuf>,
    /// Longest multiple-choice input in tokens; longer contexts lose their start (0: data.seq_len).
    pub max_length: usize,
    /// Also measure what inference costs in time (`eval.json`'s `timing`): one batch's forward
    /// and the attention layers' share of it, and a prefill followed by greedy decoding over
    /// the key-value cache. Off by default: measured times differ from run to run, and
    /// everything else an evaluation writes does not.
    pub timing: bool,
}

/// Where probe haystacks come from.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum HaystackKind {
    /// RULER's repeated noise sentences.
    Noise,
    /// Windows of a prepared corpus.
    Text,
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig {
            batch_size: 16,
            max_batches: 50,
            seq_len: 0,
            tasks: Vec::new(),
            lengths: Vec::new(),
            depths: vec![0.0, 0.25, 0.5, 0.75, 1.0],
            samples: 10,
            haystack: HaystackKind::Noise,
            haystack_dir: PathBuf::new(),
            probe_seed: crate::probes::ProbeSpec::default().seed,
            digits: None,
            needles: None,
            queries: None,
            mc: Vec::new(),
            max_length: 0,
            timing: false,
        }
    }
}

impl EvalConfig {
    /// The probe settings, unset ones at their defaults.
    pub fn probe_spec(&self) -> crate::probes::ProbeSpec {
        let d = crate::probes::ProbeSpec::default();
        crate::probes::ProbeSpec {
            seed: self.probe_seed,
            digits: self.digits.unwrap_or(d.digits),
            needles: self.needles.unwrap_or(d.needles),
            queries: self.queries.unwrap_or(d.queries),
        }
    }
}

/// `lo <= v <= hi`, written so that NaN (for which every comparison is false) fails it.
fn check<T: PartialOrd + std::fmt::Display>(key: &str, v: T, lo: T, hi: T) -> Result<()> {
    if !(v >= lo && v <= hi) {
        bail!("{key} = {v} is out of range: allowed {lo} ..= {hi}");
    }
    Ok(())
}

fn check_open_f(key: &str, v: f64, lo: f64, hi: f64) -> Result<()> {
    if !(v > lo && v < hi) {
        bail!("{key} = {v} is out of range: allowed strictly between {lo} and {hi}");
    }
    Ok(())
}

impl Config {
    pub fn validate(&self) -> Result<()> {
        let m = &self.model;
        if m.vocab_size != 0 {
            check("model.vocab_size", m.vocab_size, 2, 1 << 24)?;
        }
        check("model.hidden_size", m.hidden_size, 1, 65_536)?;
        check("model.intermediate_size", m.intermediate_size, 1, 1 << 18)?;
        check("model.num_hidden_layers", m.num_hidden_layers, 1, 1024)?;
        check("model.num_attention_heads", m.num_attention_heads, 1, 1024)?;
        check(
            "model.num_key_value_heads",
            m.num_key_value_heads,
            1,
            m.num_attention_heads,
        )?;
        if m.num_attention_heads % m.num_key_value_heads != 0 {
            bail!(
                "model.num_key_value_heads = {} must divide model.num_attention_heads = {}",
                m.num_key_value_heads,
                m.num_attention_heads
            );
        }
        if m.head_dim == 0 && m.hidden_size % m.num_attention_heads != 0 {
            bail!(
                "model.hidden_size = {} is not divisible by model.num_attention_heads = {}; set model.head_dim",
                m.hidden_size,
                m.num_attention_heads
            );
        }
        check("model.head_dim", m.head_dim(), 2, 1024)?;
        if m.head_dim() % 2 != 0 {
            bail!(
                "model.head_dim = {} must be even (rotary embedding rotates pairs)",
                m.head_dim()
            );
        }
        check_open_f("model.rope_theta", m.rope_theta, 0.0, 1e12)?;
        check_open_f("model.rms_norm_eps", m.rms_norm_eps, 0.0, 1.0)?;
        check_open_f("model.initializer_range", m.initializer_range, 0.0, 10.0)?;
        if let Some(r) = &m.rope_scaling {
            check_open_f("model.rope_scaling.factor", r.factor, 0.0, 1e6)?;
            match r.rope_type.as_str() {
                "linear" => {}
                "llama3" => {
                    let (Some(lo), Some(hi), Some(orig)) = (
                        r.low_freq_factor,
                        r.high_freq_factor,
                        r.original_max_position_embeddings,
                    ) else {
                        bail!("model.rope_scaling of type llama3 needs low_freq_factor, high_freq_factor and original_max_position_embeddings");
                    };
                    if !(lo > 0.0 && hi > lo && orig > 0.0 && hi.is_finite() && orig.is_finite()) {
                        bail!("model.rope_scaling: need 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0");
                    }
                }
                t => {
                    bail!("model.rope_scaling.rope_type = {t:?} is not supported (linear, llama3)")
                }
            }
        }

        let a = &self.attention;
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
        if self.train.router_hold_steps > 0
            && !(a.method == Method::L2a && a.router == Router::Learned)
        {
            bail!(
                "train.router_hold_steps = {} applies to method \"l2a\" with a learned router only; \
                 set it to 0 or use attention.method = \"l2a\"",
                self.train.router_hold_steps
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

        check("data.seq_len", self.data.seq_len, 2, 1 << 22)?;

        let t = &self.train;
        check("train.steps", t.steps, 1, 1 << 40)?;
        check("train.batch_size", t.batch_size, 1, 1 << 20)?;
        check("train.grad_accum", t.grad_accum, 1, 1 << 16)?;
        check_open_f("train.lr", t.lr, 0.0, 10.0)?;
        check("train.min_lr_ratio", t.min_lr_ratio, 0.0, 1.0)?;
        check("train.warmup_steps", t.warmup_steps, 0, t.steps)?;
        check("train.weight_decay", t.weight_decay, 0.0, 10.0)?;
        check("train.beta1", t.beta1, 0.0, 0.999_999)?;
        check("train.beta2", t.beta2, 0.0, 0.999_999_999)?;
        check_open_f("train.adam_eps", t.adam_eps, 0.0, 1.0)?;
        check("train.grad_clip", t.grad_clip, 0.0, 1e6)?;
        parse_device(&t.device).map(|_| ())?;
        check("train.log_every", t.log_every, 1, 1 << 40)?;
        check("train.ckpt_every", t.ckpt_every, 1, 1 << 40)?;
        check("train.keep_checkpoints", t.keep_checkpoints, 1, 1 << 20)?;

        let e = &self.eval;
        check("eval.batch_size", e.batch_size, 1, 1 << 20)?;
        for t in &e.tasks {
            crate::probes::Task::parse(t).context("eval.tasks")?;
        }
        for &l in &e.lengths {
            check("eval.lengths", l, 8, 1 << 24)?;
        }
        for &d in &e.depths {
            check("eval.depths", d, 0.0, 1.0)?;
        }
        if !e.tasks.is_empty() && e.depths.is_empty() {
            bail!("eval.depths is empty; probes need at least one depth");
        }
        check("eval.samples", e.samples, 1, 1 << 24)?;
        if e.seq_len != 0 {
            check("eval.seq_len", e.seq_len, 2, 1 << 22)?;
        }
        if e.max_length != 0 {
            // One context token and one continuation token at least.
            check("eval.max_length", e.max_length, 2, 1 << 24)?;
        }
        e.probe_spec().validate().context("eval")?;
        Ok(())
    }

    /// The length of the sequences evaluation measures: `eval.seq_len`, or `data.seq_len`
    /// when that is unset.
    pub fn eval_seq_len(&self) -> usize {
        match self.eval.seq_len {
            0 => self.data.seq_len,
            n => n,
        }
    }

    /// The setting `eval_seq_len` comes from, for messages.
    pub fn eval_seq_len_key(&self) -> &'static str {
        match self.eval.seq_len {
            0 => "data.seq_len",
            _ => "eval.seq_len",
        }
    }

    /// Reads an experiment file as a TOML tree (the defaults' empty tree when `path` is None).
    pub fn read_tree(path: Option<&Path>) -> Result<toml::Table> {
        let Some(p) = path else {
            return Ok(toml::Table::new());
        };
        let text = std::fs::read_to_string(p)
            .with_context(|| format!("cannot read config {}", p.display()))?;
        text.parse::<toml::Table>()
            .with_context(|| format!("{} is not valid TOML", p.display()))
    }

    /// A config from its TOML tree: every number finite, every key known, every value in range.
    pub fn from_tree(tree: toml::Table) -> Result<Config> {
        reject_non_finite(&tree, "")?;
        let cfg: Config = toml::Value::Table(tree).try_into()?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads an experiment file (or the built-in defaults when `path` is None), applies
    /// `--set` overrides, and validates the result. An error names the file, or the override
    /// when the file alone is valid.
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<Config> {
        let base = Config::read_tree(path)?;
        let what = path
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "the defaults".into());
        let mut tree = base.clone();
        for o in overrides {
            apply_override(&mut tree, o)?;
        }
        match Config::from_tree(tree) {
            Ok(cfg) => Ok(cfg),
            Err(e) if overrides.is_empty() || Config::from_tree(base).is_err() => {
                Err(e.context(format!("invalid config ({what})")))
            }
            Err(e) => {
                // The file alone is valid: the override that breaks it is named, the first
                // one the error's key belongs to when it names one.
                let text = format!("{e:#}");
                let culprit = overrides
                    .iter()
                    .find(|o| {
                        o.split_once('=')
                            .is_some_and(|(k, _)| text.contains(k.trim()))
                    })
                    .map_or_else(|| overrides.join(" --set "), |o| o.clone());
                Err(e.context(format!("--set {culprit} makes {what} invalid")))
            }
        }
    }

    /// The config with every path in a form text can hold: a path that is not UTF-8 (an
    /// `eval --mc` file, say) is recorded as its lossy rendering. For reports only; the run
    /// itself opens the path as given.
    pub fn recordable(&self) -> Config {
        let mut c = self.clone();
        let lossy = |p: &mut PathBuf| {
            if p.to_str().is_none() {
                *p = PathBuf::from(p.to_string_lossy().into_owned());
            }
        };
        lossy(&mut c.data.dir);
        lossy(&mut c.attention.head_ranking);
        lossy(&mut c.eval.haystack_dir);
        c.eval.mc.iter_mut().for_each(lossy);
        c
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(&self.recordable()).expect("config serialises")
    }

    /// The settings whose values differ between self and other, dotted (`train.lr`), with
    /// both values as TOML writes them.
    pub fn differences(&self, other: &Config) -> Vec<(String, String, String)> {
        fn walk(
            prefix: &str,
            a: &toml::Table,
            b: &toml::Table,
            out: &mut Vec<(String, String, String)>,
        ) {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for k in keys {
                let key = format!("{prefix}{k}");
                match (a.get(k), b.get(k)) {
                    (Some(toml::Value::Table(x)), Some(toml::Value::Table(y))) => {
                        walk(&format!("{key}."), x, y, out)
                    }
                    (x, y) if x != y => {
                        let show =
                            |v: Option<&toml::Value>| v.map_or("(unset)".into(), |v| v.to_string());
                        out.push((key, show(x), show(y)));
                    }
                    _ => {}
                }
            }
        }
        let table = |c: &Config| toml::Table::try_from(c).expect("config serialises");
        let mut out = Vec::new();
        walk("", &table(self), &table(other), &mut out);
        out
    }

    /// The same computation with every attention setting that its method ignores put back to
    /// its default: `lambda` on a full-attention model, `ppa_power` on a window, the
    /// regulariser of a context-free (Bernoulli) router. Two configs that differ only there
    /// compute the same thing, so they identify the same sweep cell.
    pub fn canonical(&self) -> Config {
        let mut c = self.clone();
        let d = AttentionConfig::default();
        let a = &mut c.attention;
        let m = a.method;
        let routed = matches!(m, Method::Aha | Method::L2a | Method::Swiattn);
        let learned = routed && a.router == Router::Learned;
        if m == Method::Full {
            a.window = d.window;
        }
        if m != Method::Ppa {
            a.ppa_power = d.ppa_power;
        }
        if m != Method::StaticHybrid {
            a.hybrid_every = d.hybrid_every;
        }
        if !routed {
            a.router = d.router;
        }
        if !(routed && a.router == Router::Bernoulli) {
            a.bernoulli_p = d.bernoulli_p;
        }
        if !learned {
            a.tau = d.tau;
        }
        if !(learned && matches!(m, Method::Aha | Method::L2a)) {
            a.lambda = d.lambda;
        }
        if !(learned && m == Method::Aha) {
            a.ste_sample = d.ste_sample;
        }
        if !(learned && matches!(m, Method::Aha | Method::Swiattn)) {
            a.router_init_bias = d.router_init_bias;
        }
        if !(learned && m == Method::L2a) {
            a.p_force = d.p_force;
        }
        if m != Method::Swiattn {
            a.swiattn_shared_o_proj = d.swiattn_shared_o_proj;
        }
        if !(learned && m == Method::Swiattn) {
            a.swiattn_gamma_base = d.swiattn_gamma_base;
            a.swiattn_eps = d.swiattn_eps;
            a.swiattn_alpha = d.swiattn_alpha;
            a.swiattn_adaptive = d.swiattn_adaptive;
            a.swiattn_nll = d.swiattn_nll;
            a.swiattn_disagreement = d.swiattn_disagreement;
        } else if !a.swiattn_adaptive {
            // gamma = gamma_base: the adaptive weight's terms are not read.
            a.swiattn_eps = d.swiattn_eps;
            a.swiattn_alpha = d.swiattn_alpha;
            a.swiattn_nll = d.swiattn_nll;
            a.swiattn_disagreement = d.swiattn_disagreement;
        } else if a.swiattn_alpha == 0.0 {
            a.swiattn_disagreement = d.swiattn_disagreement;
        }
        if m != Method::StaticHeads {
            a.head_ranking = d.head_ranking;
            a.top_k = d.top_k;
        }
        c
    }

    /// The settings that differ from the defaults, as TOML: what identifies a computation,
    /// unchanged when a later version adds settings with defaults.
    pub fn non_default_toml(&self) -> String {
        fn strip(v: &mut toml::Table, d: &toml::Table) {
            v.retain(|k, x| match (x, d.get(k)) {
                (toml::Value::Table(t), Some(toml::Value::Table(dt))) => {
                    strip(t, dt);
                    !t.is_empty()
                }
                (x, Some(dx)) => x != dx,
                (_, None) => true,
            });
        }
        let table = |c: &Config| toml::Table::try_from(c).expect("config serialises");
        let mut t = table(self);
        strip(&mut t, &table(&Config::default()));
        toml::to_string_pretty(&t).expect("table serialises")
    }
}

/// The settings a resumed run may change (a dotted key, or a whole section): where and how often
/// it logs, checkpoints and evaluates, and which attention implementation computes the same
/// function. The others define the run: changed mid-run, its result would match neither
/// configuration, so `train --resume` refuses them.
pub const RESUME_MAY_CHANGE: &[&str] = &[
    "train.device",
    "train.log_every",
    "train.ckpt_every",
    "train.keep_checkpoints",
    "train.eval_every",
    "attention.attn_impl",
    "eval",
];

/// Whether `train --resume` may change the dotted setting `key`.
pub fn resume_may_change(key: &str) -> bool {
    RESUME_MAY_CHANGE.iter().any(|k| {
        key == *k
            || key
                .strip_prefix(k)
                .is_some_and(|rest| rest.starts_with('.'))
    })
}

/// A number given as a command-line flag: finite (NaN would pass every range check after it).
pub fn finite_flag(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(v) => Err(format!("{v} is not a finite number")),
        Err(e) => Err(e.to_string()),
    }
}

/// Refuses NaN and infinite numbers anywhere in a TOML tree (TOML allows `nan` and `inf`, and
/// NaN would pass any range check), naming the dotted key.
pub fn reject_non_finite(tree: &toml::Table, prefix: &str) -> Result<()> {
    fn walk(v: &toml::Value, key: &str) -> Result<()> {
        match v {
            toml::Value::Float(f) if !f.is_finite() => {
                bail!("{key} = {f} is not a finite number")
            }
            toml::Value::Array(a) => a.iter().try_for_each(|x| walk(x, key)),
            toml::Value::Table(t) => reject_non_finite(t, &format!("{key}.")),
            _ => Ok(()),
        }
    }
    tree.iter()
        .try_for_each(|(k, v)| walk(v, &format!("{prefix}{k}")))
}

/// A `--set` value: a TOML value (number, bool, array, quoted string), else a bare string, so
/// `--set attention.method=swa` needs no quotes; in a list, each bare word is a string
/// (`[passkey, mqar]`).
pub fn parse_value(raw: &str) -> toml::Value {
    let raw = raw.trim();
    let toml_value = |text: &str| {
        format!("v = {text}")
            .parse::<toml::Table>()
            .ok()
            .and_then(|mut t| t.remove("v"))
    };
    if let Some(v) = toml_value(raw) {
        return v;
    }
    match raw.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        Some(inner) if !inner.contains(['[', ']', '"', '\'']) => toml::Value::Array(
            inner
                .split(',')
                .map(str::trim)
                .filter(|w| !w.is_empty())
                .map(|w| toml_value(w).unwrap_or_else(|| toml::Value::String(w.to_string())))
                .collect(),
        ),
        _ => toml::Value::String(raw.to_string()),
    }
}

/// `section.key=value`, the value read by `parse_value`.
pub fn apply_override(tree: &mut toml::Table, spec: &str) -> Result<()> {
    let (key, raw) = spec
        .split_once('=')
        .with_context(|| format!("--set {spec:?}: expected section.key=value"))?;
    let key = key.trim();
    let parts: Vec<&str> = key.split('.').collect();
    if parts.len() < 2 || parts.iter().any(|p| p.is_empty()) {
        bail!("--set {spec:?}: key must look like section.key (e.g. attention.window)");
    }
    let value = parse_value(raw);
    let mut table = tree;
    for p in &parts[..parts.len() - 1] {
        let entry = table
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        table = entry
            .as_table_mut()
            .with_context(|| format!("--set {spec:?}: {p} is not a section"))?;
    }
    table.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    Auto,
    Cpu,
    Cuda(usize),
}

pub fn parse_device(s: &str) -> Result<DeviceSpec> {
    Ok(match s {
        "auto" => DeviceSpec::Auto,
        "cpu" => DeviceSpec::Cpu,
        "cuda" => DeviceSpec::Cuda(0),
        _ => match s.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => DeviceSpec::Cuda(n),
            None => bail!("train.device = {s:?} is not one of auto, cpu, cuda, cuda:N"),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err_of(toml_text: &str, sets: &[&str]) -> String {
        let dir = std::env::temp_dir().join(format!("attnsweep-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // One file per call: tests run in parallel threads.
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let p = dir.join(format!("c{n}.toml"));
        std::fs::write(&p, toml_text).unwrap();
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        format!("{:#}", Config::load(Some(&p), &sets).unwrap_err())
    }

    /// Differences name every changed leaf setting with both values; resume may change the
    /// listed keys and every key of a listed section, nothing that merely shares a prefix.
    #[test]
    fn differences_and_what_resume_may_change() {
        let a = Config::default();
        let set = |s: &[&str]| {
            let sets: Vec<String> = s.iter().map(|x| x.to_string()).collect();
            Config::load(None, &sets).unwrap()
        };
        assert!(a.differences(&a).is_empty());
        let b = set(&["train.lr=0.5", "attention.method=swa", "eval.batch_size=3"]);
        let keys: Vec<String> = a.differences(&b).into_iter().map(|d| d.0).collect();
        assert_eq!(keys, ["attention.method", "eval.batch_size", "train.lr"]);
        let (_, was, now) = &a.differences(&b)[2];
        assert_eq!(
            (was.as_str(), now.as_str()),
            (&*a.train.lr.to_string(), "0.5")
        );
        for key in [
            "train.device",
            "eval.batch_size",
            "eval",
            "attention.attn_impl",
        ] {
            assert!(resume_may_change(key), "{key}");
        }
        for key in [
            "train.lr",
            "train.steps",
            "evaluation.x",
            "train.device_x",
            "attention",
        ] {
            assert!(!resume_may_change(key), "{key}");
        }
    }

    /// NaN passes any `lo <= v <= hi` written as `v < lo || v > hi`; TOML allows nan and inf.
    /// Every non-finite number is refused, from a file or an override, naming the key.
    #[test]
    fn non_finite_numbers_are_refused_everywhere() {
        for set in [
            "attention.ppa_power=nan",
            "attention.tau=nan",
            "attention.bernoulli_p=nan",
            "attention.p_force=nan",
            "train.weight_decay=nan",
            "train.grad_clip=inf",
            "eval.depths=[0.5, nan]",
            "attention.swiattn_alpha=-inf",
        ] {
            let key = set.split('=').next().unwrap();
            let e = err_of("", &[set]);
            assert!(
                e.contains(key) && e.contains("not a finite number"),
                "{set}: {e}"
            );
        }
        let e = err_of("[train]\ngrad_clip = nan\n", &[]);
        assert!(e.contains("train.grad_clip") && e.contains("finite"), "{e}");
        let e = err_of(
            "[model.rope_scaling]\nrope_type = \"linear\"\nfactor = inf\n",
            &[],
        );
        assert!(e.contains("model.rope_scaling.factor"), "{e}");
    }

    /// An error caused by an override names the override, not the file it was applied to.
    #[test]
    fn errors_blame_the_override_that_caused_them() {
        let e = err_of("[train]\nlr = 0.01\n", &["data.seq_len=1"]);
        assert!(
            e.contains("--set data.seq_len=1") && e.contains("data.seq_len = 1"),
            "{e}"
        );
        let e = err_of("[train]\nsteps = 0\n", &["data.seq_len=64"]);
        assert!(e.contains("invalid config") && !e.contains("--set"), "{e}");
        let e = err_of("", &["eval.max_length=1"]);
        assert!(e.contains("eval.max_length = 1"), "{e}");
        let e = err_of("", &["eval.seq_len=1"]);
        assert!(e.contains("eval.seq_len = 1"), "{e}");
        let e = err_of("", &["train.router_hold_steps=5"]);
        assert!(
            e.contains("train.router_hold_steps = 5") && e.contains("\"l2a\""),
            "{e}"
        );
        let e = err_of(
            "[attention]\nmethod = \"l2a\"\nrouter = \"bernoulli\"\n",
            &["train.router_hold_steps=5"],
        );
        assert!(e.contains("learned router only"), "{e}");
    }

    /// Lists of bare words need no quotes, as single bare words need none.
    #[test]
    fn bare_words_in_lists_are_strings() {
        let c = Config::load(None, &["eval.tasks=[passkey, mqar]".into()]).unwrap();
        assert_eq!(c.eval.tasks, ["passkey", "mqar"]);
        let c = Config::load(None, &["eval.lengths=[64,128]".into()]).unwrap();
        assert_eq!(c.eval.lengths, [64, 128]);
        assert_eq!(parse_value("[a, 2, true]").as_array().unwrap().len(), 3);
        assert_eq!(
            parse_value("[\"a\", b]"),
            toml::Value::String("[\"a\", b]".into())
        );
    }

    /// Settings a method ignores do not make two configs different computations; settings
    /// it reads do.
    #[test]
    fn canonical_sets_aside_what_a_method_ignores() {
        let load = |sets: &[&str]| {
            let v: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            Config::load(None, &v).unwrap().canonical()
        };
        assert_eq!(
            load(&[
                "attention.method=full",
                "attention.lambda=0.1",
                "attention.window=8"
            ]),
            load(&["attention.method=full"])
        );
        assert_eq!(
            load(&[
                "attention.method=swa",
                "attention.ppa_power=0.9",
                "attention.tau=0.2"
            ]),
            load(&["attention.method=swa"])
        );
        assert_eq!(
            load(&[
                "attention.method=aha",
                "attention.router=bernoulli",
                "attention.lambda=1"
            ]),
            load(&["attention.method=aha", "attention.router=bernoulli"])
        );
        assert_eq!(
            load(&[
                "attention.method=swiattn",
                "attention.swiattn_adaptive=false",
                "attention.swiattn_alpha=3"
            ]),
            load(&[
                "attention.method=swiattn",
                "attention.swiattn_adaptive=false"
            ])
        );
        assert_ne!(
            load(&["attention.method=aha", "attention.lambda=0.1"]),
            load(&["attention.method=aha"])
        );
        assert_ne!(
            load(&["attention.method=swa", "attention.window=8"]),
            load(&["attention.method=swa"])
        );
        assert_ne!(
            load(&[
                "attention.method=swiattn",
                "attention.swiattn_disagreement=sum"
            ]),
            load(&["attention.method=swiattn"])
        );
    }

    #[test]
    fn defaults_are_valid_and_round_trip() {
        let c = Config::default();
        c.validate().unwrap();
        let back: Config = toml::from_str(&c.to_toml()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn overrides_parse_types_and_bare_strings() {
        let c = Config::load(
            None,
            &[
                "attention.method=swa".into(),
                "attention.window=16".into(),
                "train.lr=0.01".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.attention.method, Method::Swa);
        assert_eq!(c.attention.window, 16);
        assert_eq!(c.train.lr, 0.01);
    }

    #[test]
    fn errors_name_the_problem() {
        assert!(err_of("[model\nx=1", &[]).contains("not valid TOML"));
        assert!(err_of("[model]\nhiden_size = 3\n", &[]).contains("hiden_size"));
        assert!(err_of("[nosuch]\n", &[]).contains("nosuch"));
        let e = err_of("", &["attention.ppa_power=1.5"]);
        assert!(
            e.contains("attention.ppa_power") && e.contains("0 ..= 1"),
            "{e}"
        );
        let e = err_of(
            "[model]\nnum_attention_heads = 4\nnum_key_value_heads = 3\n",
            &[],
        );
        assert!(e.contains("num_key_value_heads"), "{e}");
        assert!(err_of("", &["attention.method=sparse"]).contains("sparse"));
        assert!(err_of("", &["train.device=tpu"]).contains("train.device"));
        assert!(err_of("", &["window=3"]).contains("section.key"));
        assert!(err_of("", &["train.steps=0"]).contains("train.steps"));
        for bad in ["0", "1.5", "-0.1"] {
            let e = err_of("", &[&format!("attention.ste_sample={bad}")]);
            assert!(
                e.contains("attention.ste_sample") && e.contains("(0, 1]"),
                "{e}"
            );
        }
    }
}
