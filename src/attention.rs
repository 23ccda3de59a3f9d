//! Attention: which keys each query sees, how many (query, key) pairs that is, and the layer
//! that computes it.
//!
//! Every static pattern here (full, sliding window, PPA) depends only on the distance
//! `d = i - k` between query `i` and key `k`, so one predicate `KeyPattern::sees(d)` defines
//! each of them; the dense mask, the pair count and the per-layer assignment of
//! `static_hybrid` are all derived from it.
//!
//! Routed methods choose per token (L2A, SwiAttn) or per token and head (AHA) between the
//! whole prefix and the window. Their maths is all in `SelfAttention::forward` below: the
//! router, the straight-through gate, how the two paths combine, the regulariser, and the
//! count of pairs the executed path attends. This reference path computes both paths densely
//! and combines them; CUDA kernels replace it behind the same interface.

use crate::config::{
    AttentionConfig, Method, ModelConfig, NormPlacement, QkNorm, Reduction, Router,
};
use crate::kernels::{kernel_for, Kernels, PpaOffsets, QueryPath};
use crate::nn::{upcast, Linear, RmsNorm, Rope};
use crate::rng::Rng;
use std::cell::RefCell;
use tch::{nn, Device, Kind, Tensor};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KeyPattern {
    /// Causal attention over the whole prefix.
    Full,
    /// The last `w` keys, self included.
    Window(usize),
    /// The window plus the power offsets S_p (PPA).
    Ppa { power: f64, window: usize },
}

impl KeyPattern {
    /// Whether a query sees the key `d >= 0` positions before it.
    pub fn sees(&self, d: usize) -> bool {
        match *self {
            KeyPattern::Full => true,
            KeyPattern::Window(w) => d < w,
            KeyPattern::Ppa { power, window } => d < window || is_power_offset(d, power),
        }
    }

    /// `sees(d)` for d = 0 .. len.
    pub fn distance_table(&self, len: usize) -> Vec<bool> {
        (0..len).map(|d| self.sees(d)).collect()
    }

    /// Number of (query, key) pairs attended in one causal sequence of length `len`:
    /// a distance d occurs for the `len - d` queries i >= d.
    pub fn attended_pairs(&self, len: usize) -> u64 {
        self.distance_table(len)
            .iter()
            .enumerate()
            .filter(|(_, &s)| s)
            .map(|(d, _)| (len - d) as u64)
            .sum()
    }

    /// Pairs attended by the queries at positions `start .. end` (query i sees the distances
    /// d <= i the pattern allows).
    pub fn pairs_between(&self, start: usize, end: usize) -> u64 {
        let mut seen = 0u64;
        let mut total = 0u64;
        for (i, s) in self.distance_table(end).iter().enumerate() {
            seen += *s as u64;
            if i >= start {
                total += seen;
            }
        }
        total
    }

    /// Dense `[len, len]` boolean mask, true where query i (row) may attend key k (column).
    pub fn mask(&self, len: usize, device: Device) -> Tensor {
        let pos = Tensor::arange(len as i64, (Kind::Int64, device));
        let dist = pos.unsqueeze(1) - pos.unsqueeze(0);
        let causal = dist.ge(0);
        let table = Tensor::from_slice(&self.distance_table(len)).to_device(device);
        let seen = table
            .index_select(0, &dist.clamp_min(0).flatten(0, 1))
            .view([len as i64, len as i64]);
        seen.logical_and(&causal)
    }

    /// The distances below `len` that PPA sees beyond its window (ascending); empty for the
    /// other patterns.
    pub fn offsets_beyond_window(&self, len: usize) -> Vec<i32> {
        match *self {
            KeyPattern::Ppa { power, window } => (window..len)
                .filter(|&d| is_power_offset(d, power))
                .map(|d| d as i32)
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Whether the dense causal kernel can stand in for the mask at this length.
    pub fn is_full_at(&self, len: usize) -> bool {
        self.distance_table(len).iter().all(|&s| s)
    }
}

/// PPA offset set: `j in S_p` iff `floor(j^p) - floor((j-1)^p) = 1`, with `0^p = 0` for
/// p > 0. (For p = 0 every `j^0 = 1` and `0^0 = 1`, so S_0 is empty and PPA is SWA.)
pub fn is_power_offset(j: usize, p: f64) -> bool {
    if j == 0 {
        return false;
    }
    let floor_pow = |x: usize| -> f64 {
        let v = (x as f64).powf(p);
        // powf may land a hair below an exact integer (256^0.125 -> 1.9999999999999998);
        // nudge so exact powers floor to the right integer.
        (v + 1e-9 * v.max(1.0)).floor()
    };
    floor_pow(j) - floor_pow(j - 1) == 1.0
}

/// The pattern layer `layer` uses under a static method.
pub fn layer_pattern(cfg: &AttentionConfig, layer: usize) -> KeyPattern {
    match cfg.method {
        Method::Full => KeyPattern::Full,
        Method::Swa => KeyPattern::Window(cfg.window),
        Method::Ppa => KeyPattern::Ppa {
            power: cfg.ppa_power,
            window: cfg.window,
        },
        Method::StaticHybrid => {
            if (layer + 1) % cfg.hybrid_every == 0 {
                KeyPattern::Full
            } else {
                KeyPattern::Window(cfg.window)
            }
        }
        m => unreachable!("{m:?} routes per token; it has no single pattern"),
    }
}

/// Reference attention over `q: [B, H, L, D]`, `k, v: [B, Hkv, L, D]`: softmax over the keys
/// the pattern allows. Full attention goes to the fused causal kernel; other patterns pass
/// their dense mask (correct everywhere, fast nowhere: the CUDA kernels replace it).
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pattern: &KeyPattern,
    mask: Option<&Tensor>,
) -> Tensor {
    let gqa = q.size()[1] != k.size()[1];
    let len = q.size()[2] as usize;
    if pattern.is_full_at(len) {
        Tensor::scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.0, true, None, gqa)
    } else {
        let owned;
        let mask = match mask {
            Some(m) => m,
            None => {
                owned = pattern.mask(len, q.device());
                &owned
            }
        };
        Tensor::scaled_dot_product_attention(q, k, v, Some(mask), 0.0, false, None, gqa)
    }
}

// ---------------------------------------------------------------------------------------
// Gates. A gate is 1 for the full (global) path and 0 for the window (local) path.

/// Forward with the hard gate, backward as if it were the soft score (straight-through).
pub fn straight_through(hard: &Tensor, soft: &Tensor) -> Tensor {
    // `soft - sg(soft)` first: exactly 0, so the value is exactly `hard` in any dtype
    // (`(hard + soft) - soft` can round away from it).
    hard + (soft - soft.detach())
}

/// Hard gate from soft scores: `s > tau` (AHA, SwiAttn) or `s >= tau` (L2A).
pub fn threshold(scores: &Tensor, tau: f64, inclusive: bool) -> Tensor {
    let on = if inclusive {
        scores.ge(tau)
    } else {
        scores.gt(tau)
    };
    on.to_kind(scores.kind())
}

/// Replaces the gates a layer would compute, for analysis and tests.
pub enum GateOverride {
    /// Every gate of every layer is this value (0 or 1); the STE gradient still flows.
    Constant(f64),
    /// Per layer `(hard, anchor)`: the gate is `hard + s - anchor`, the soft relaxation around
    /// recorded hard gates, whose gradient at `s = anchor` is exactly the STE gradient.
    Relaxed(Vec<(Tensor, Tensor)>),
}

/// Per-forward options that are not part of the model.
#[derive(Default)]
pub struct ForwardCtx {
    /// L2A: run global attention for every token this step (p_force).
    pub force_global: bool,
    pub gate_override: Option<GateOverride>,
    /// Seed of Bernoulli gates: each gate is a hash of (seed, layer, batch row, position,
    /// head), so a token's gate does not depend on how the sequence is cut into chunks.
    pub gate_seed: u64,
    /// Leave the logits in the compute dtype (training's fused loss reads them so) instead
    /// of fp32.
    pub compute_logits: bool,
}

/// Dense masks and PPA offset lists built once per forward and shared by the layers that use
/// the same pattern.
pub struct MaskCache {
    len: usize,
    device: Device,
    masks: RefCell<Vec<(KeyPattern, Tensor)>>,
    ppa: RefCell<Vec<(KeyPattern, Option<PpaOffsets>)>>,
}

impl MaskCache {
    pub fn new(len: usize, device: Device) -> Self {
        MaskCache {
            len,
            device,
            masks: RefCell::new(Vec::new()),
            ppa: RefCell::new(Vec::new()),
        }
    }

    /// PPA `pattern`'s offsets beyond its window at this length (int32, on the device),
    /// built and copied at most once per forward; None where no offset reaches beyond the
    /// window, so the window kernels alone run it.
    fn ppa_offsets(&self, pattern: KeyPattern) -> Option<PpaOffsets> {
        let mut all = self.ppa.borrow_mut();
        if let Some((_, offsets)) = all.iter().find(|(p, _)| *p == pattern) {
            return offsets.as_ref().map(PpaOffsets::shallow_clone);
        }
        let KeyPattern::Ppa { window, .. } = pattern else {
            return None;
        };
        let offsets = pattern.offsets_beyond_window(self.len);
        let offsets = (!offsets.is_empty()).then(|| PpaOffsets::new(&offsets, window, self.device));
        all.push((pattern, offsets.as_ref().map(PpaOffsets::shallow_clone)));
        offsets
    }

    /// `pattern` applied to (q, k, v), with the mask built at most once per forward.
    pub fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, pattern: KeyPattern) -> Tensor {
        if pattern.is_full_at(self.len) {
            return attend(q, k, v, &pattern, None);
        }
        let mut masks = self.masks.borrow_mut();
        if !masks.iter().any(|(p, _)| *p == pattern) {
            masks.push((pattern, pattern.mask(self.len, self.device)));
        }
        let mask = &masks
            .iter()
            .find(|(p, _)| *p == pattern)
            .expect("just inserted")
            .1;
        attend(q, k, v, &pattern, Some(mask))
    }
}

/// One stream of cached keys and values with their absolute positions.
struct Slot {
    k: Tensor,
    v: Tensor,
    pos: Tensor,
}

/// A layer's decoding cache: slot 0 holds the attention's keys and values, slot 1 those of
/// L2A's global module. Layers that only ever look back a window keep only that window.
#[derive(Default)]
pub struct LayerCache {
    slots: [Option<Slot>; 2],
}

impl LayerCache {
    /// Bytes held (keys and values).
    pub fn bytes(&self) -> f64 {
        self.slots
            .iter()
            .flatten()
            .map(|s| (s.k.numel() + s.v.numel()) as f64 * s.k.kind().elt_size_in_bytes() as f64)
            .sum()
    }
}

/// Where a layer's keys and values come from: the chunk being processed alone (training,
/// whole-sequence evaluation), or a decoding cache the chunk's keys extend.
pub enum Keys<'a> {
    Chunk(&'a MaskCache),
    Cache {
        cache: &'a RefCell<LayerCache>,
        start: i64,
    },
}

impl Keys<'_> {
    /// Position of the chunk's first token.
    fn start(&self) -> i64 {
        match self {
            Keys::Chunk(_) => 0,
            Keys::Cache { start, .. } => *start,
        }
    }

    /// The keys and values to attend over: the chunk's, after the cached ones of `slot`.
    fn extend(&self, slot: usize, k: Tensor, v: Tensor) -> (Tensor, Tensor) {
        let Keys::Cache { cache, start } = self else {
            return (k, v);
        };
        let mut c = cache.borrow_mut();
        let n = k.size()[2];
        let pos = Tensor::arange_start(*start, start + n, (Kind::Int64, k.device()));
        let merged = match c.slots[slot].take() {
            Some(s) => Slot {
                k: Tensor::cat(&[&s.k, &k], 2),
                v: Tensor::cat(&[&s.v, &v], 2),
                pos: Tensor::cat(&[&s.pos, &pos], 0),
            },
            None => Slot { k, v, pos },
        };
        let out = (merged.k.shallow_clone(), merged.v.shallow_clone());
        c.slots[slot] = Some(merged);
        out
    }

    /// `pattern` for queries of this chunk over keys from `extend(slot, ..)`.
    fn attend(
        &self,
        slot: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        pattern: KeyPattern,
    ) -> Tensor {
        match self {
            Keys::Chunk(masks) => masks.attend(q, k, v, pattern),
            Keys::Cache { cache, start } => {
                let c = cache.borrow();
                let kpos = &c.slots[slot]
                    .as_ref()
                    .expect("extended before attending")
                    .pos;
                let n = q.size()[2];
                let qpos = Tensor::arange_start(*start, start + n, (Kind::Int64, q.device()));
                let dist = qpos.unsqueeze(1) - kpos.unsqueeze(0);
                let table = Tensor::from_slice(&pattern.distance_table((start + n) as usize))
                    .to_device(q.device());
                let mask = table
                    .index_select(0, &dist.clamp_min(0).flatten(0, 1))
                    .view([n, kpos.size()[0]])
                    .logical_and(&dist.ge(0));
                let gqa = q.size()[1] != k.size()[1];
                Tensor::scaled_dot_product_attention(q, k, v, Some(&mask), 0.0, false, None, gqa)
            }
        }
    }

    /// Drops cached keys of `slot` that no later query can see through a window of `w`.
    fn trim(&self, slot: usize, w: usize, end: i64) {
        let Keys::Cache { cache, .. } = self else {
            return;
        };
        let mut c = cache.borrow_mut();
        if let Some(s) = c.slots[slot].as_mut() {
            // The last w keys, the window of the last query: a rolling buffer at its peak
            // size (the next query needs w - 1 of them beside its own).
            let keep = s.pos.ge(end - w as i64).nonzero().squeeze_dim(-1);
            s.k = s.k.index_select(2, &keep);
            s.v = s.v.index_select(2, &keep);
            s.pos = s.pos.index_select(0, &keep);
        }
    }
}

/// A layer's regulariser before it is averaged over layers.
pub enum Regulariser {
    /// Finished per-layer term (AHA: lambda * mean s; L2A: lambda * mean d_hat^2).
    Term(Tensor),
    /// SwiAttn: gamma * softplus(r) needs the per-token NLL, known only after the forward.
    Adaptive {
        logits: Tensor,
        disagreement: Tensor,
        params: SwiAttnReg,
    },
}

#[derive(Clone, Copy, Debug)]
pub struct SwiAttnReg {
    pub gamma_base: f64,
    pub eps: f64,
    pub alpha: f64,
    pub adaptive: bool,
    pub nll: bool,
    /// How `||O_full - O_swa||^2` is reduced over the hidden dimension.
    pub disagreement: Reduction,
}

impl SwiAttnReg {
    /// The branches' disagreement per token, `[B, T]` in fp32: the mean (the paper's MSE) or
    /// the sum (the squared norm) over the hidden dimension of `(full - local)^2`.
    fn disagreement(&self, full: &Tensor, local: &Tensor) -> Tensor {
        let sq = (full - local).to_kind(Kind::Float).square();
        match self.disagreement {
            Reduction::Mean => sq.mean_dim(-1, false, Kind::Float),
            Reduction::Sum => sq.sum_dim_intlist(-1, false, Kind::Float),
        }
    }
}

impl Regulariser {
    /// The per-layer term; `nll: [B, L]` is the per-token language-model loss.
    pub fn term(&self, nll: &Tensor) -> Tensor {
        match self {
            Regulariser::Term(t) => t.shallow_clone(),
            Regulariser::Adaptive {
                logits,
                disagreement,
                params: p,
            } => {
                // gamma is a weight, not a path for gradients.
                let gamma = if p.adaptive {
                    let nll = if p.nll {
                        nll.detach().to_kind(Kind::Float)
                    } else {
                        nll.zeros_like().to_kind(Kind::Float)
                    };
                    (nll + disagreement.detach() * p.alpha + p.eps).reciprocal() * p.gamma_base
                } else {
                    disagreement.full_like(p.gamma_base)
                };
                (gamma * logits.softplus()).mean(Kind::Float)
            }
        }
    }
}

/// What one attention layer hands back to the model.
pub struct AttnOutput {
    /// `[B, L, hidden]`, ready for the residual add.
    pub y: Tensor,
    /// Hard gates `[B, L, H]` (1 = full path; per-token methods repeat theirs over heads);
    /// None for static methods.
    pub gates: Option<Tensor>,
    /// Soft router scores `[B, L, H]` or `[B, L, 1]` when the gates come from a learned router.
    pub scores: Option<Tensor>,
    pub reg: Option<Regulariser>,
    /// (query, key) pairs of the path actually executed, summed over batch and query heads
    /// (a scalar tensor, so counting never waits for the device).
    pub pairs: Tensor,
}

// ---------------------------------------------------------------------------------------
// Layers.

/// Query, key, value and output projections of one attention module (HF names).
pub struct Projections {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    qk_norm: QkNorm,
    n_heads: i64,
    n_kv_heads: i64,
    head_dim: i64,
}

impl Projections {
    fn new(p: &nn::Path, m: &ModelConfig) -> Self {
        let (h, kv, hd) = (
            m.num_attention_heads as i64,
            m.num_key_value_heads as i64,
            m.head_dim() as i64,
        );
        let (d, std, bias) = (m.hidden_size as i64, m.initializer_range, m.attention_bias);
        // Qwen3 normalises each head (weights over head_dim), OLMo-2 the whole projection.
        let (qn, kn) = match m.qk_norm {
            QkNorm::None => (0, 0),
            QkNorm::PerHead => (hd, hd),
            QkNorm::Full => (h * hd, kv * hd),
        };
        let norm =
            |name: &str, dim: i64| (dim > 0).then(|| RmsNorm::new(p / name, dim, m.rms_norm_eps));
        Projections {
            q_proj: Linear::new(p / "q_proj", d, h * hd, bias, std),
            k_proj: Linear::new(p / "k_proj", d, kv * hd, bias, std),
            v_proj: Linear::new(p / "v_proj", d, kv * hd, bias, std),
            o_proj: Linear::new(p / "o_proj", h * hd, d, false, std),
            q_norm: norm("q_norm", qn),
            k_norm: norm("k_norm", kn),
            qk_norm: m.qk_norm,
            n_heads: h,
            n_kv_heads: kv,
            head_dim: hd,
        }
    }

    /// `x: [B, L, hidden]` to rotated `q: [B, H, L, D]` and `k, v: [B, Hkv, L, D]`.
    fn qkv(&self, x: &Tensor, rope: &Rope, kernels: Option<&Kernels>) -> (Tensor, Tensor, Tensor) {
        let (b, l, _) = x.size3().expect("attention input is [B, L, hidden]");
        let split = |t: Tensor, n: i64| t.view([b, l, n, self.head_dim]);
        let normed = |t: Tensor, n: i64, norm: &Option<RmsNorm>| match (self.qk_norm, norm) {
            (QkNorm::Full, Some(nm)) => split(nm.forward(&t), n),
            (QkNorm::PerHead, Some(nm)) => nm.forward(&split(t, n)),
            _ => split(t, n),
        };
        let q = rope.apply_transposed(
            &normed(self.q_proj.forward(x), self.n_heads, &self.q_norm),
            kernels,
        );
        let k = rope.apply_transposed(
            &normed(self.k_proj.forward(x), self.n_kv_heads, &self.k_norm),
            kernels,
        );
        // The kernels read v contiguous: the move makes it so once here, not in each of a
        // layer's launches.
        let v = split(self.v_proj.forward(x), self.n_kv_heads);
        let v = match kernel_for(kernels, &v) {
            Some(k) => k.to_heads(&v).expect("head transpose kernel on v"),
            None => v.transpose(1, 2),
        };
        (q, k, v)
    }

    /// `[B, H, L, D]` to `[B, L, H*D]`.
    fn merge(&self, y: &Tensor, kernels: Option<&Kernels>) -> Tensor {
        let (b, _, l, _) = y.size4().expect("[B, H, L, D]");
        let y = match kernel_for(kernels, y) {
            Some(k) => k
                .from_heads(y)
                .expect("head transpose kernel on the output"),
            None => y.transpose(1, 2),
        };
        y.reshape([b, l, self.n_heads * self.head_dim])
    }

    fn out(&self, y: &Tensor, kernels: Option<&Kernels>) -> Tensor {
        self.o_proj.forward(&self.merge(y, kernels))
    }

    /// Bytes of keys and values kept per cached position.
    fn kv_bytes_per_position(&self, elt: usize) -> f64 {
        (2 * self.n_kv_heads * self.head_dim) as f64 * elt as f64
    }
}

/// The method-specific part of a layer.
enum Route {
    /// One fixed pattern for every token and head.
    Static(KeyPattern),
    /// AHA (and static top-k heads): per (token, head) full or window over shared q, k, v.
    PerHead { gates: GateSource },
    /// L2A: window attention s, then a second module over s for routed tokens: o = s + d a.
    Global {
        gates: GateSource,
        global: Box<Projections>,
    },
    /// SwiAttn: per token full or window branch over shared q, k, v.
    Switch {
        gates: GateSource,
        swa_o_proj: Option<Linear>,
        reg: SwiAttnReg,
    },
}

enum GateSource {
    Learned {
        router: Linear,
        /// AHA's and SwiAttn's routers read the normalised hidden state. A post-norm model
        /// (OLMo-2) hands its attention the raw residual stream, so there the router has an
        /// RMSNorm of its own (`router_norm`, initialised to ones); None where the layer's
        /// input is already normalised, and for L2A, whose router reads the local output.
        norm: Option<RmsNorm>,
        tau: f64,
        inclusive: bool,
        lambda: f64,
    },
    Bernoulli(f64),
    /// Static head assignment: `[H]` gates, the same for every token.
    Fixed(Tensor),
}

/// One attention layer of any method, with Hugging Face parameter names for the base
/// module; parameters a method adds sit beside them (`router`, `global_attn.*`, `swa_o_proj`).
pub struct SelfAttention {
    proj: Projections,
    route: Route,
    window: usize,
    /// AHA: `attention.ste_sample`.
    ste_sample: f64,
    layer: usize,
    prefix: String,
    /// The kernel library computing window and sparse-query attention; None: reference path.
    kernels: Option<&'static Kernels>,
}

const KERNEL_FAILED: &str = "attention kernel failed on inputs the model validated";

/// The routed kernels' per-query paths `[B, H, L]` (uint8) from bool masks: the whole prefix
/// where `full`, else the window where `window`, else nothing.
fn query_paths(full: &Tensor, window: Option<&Tensor>) -> Tensor {
    let paths = full.to_kind(Kind::Uint8) * QueryPath::Full as i64;
    match window {
        Some(w) => paths.maximum(&(w.to_kind(Kind::Uint8) * QueryPath::Window as i64)),
        None => paths,
    }
}

/// Routed kernels' paths for a bool choice `on: [B, H, L]`: the whole prefix where on, the
/// window elsewhere.
pub fn routed_paths(on: &Tensor) -> Tensor {
    query_paths(on, Some(&on.logical_not()))
}

/// `[B, H, L, D]` attention of the queries marked in `full: [B, H, L]` (bool) over their whole
/// prefix, zeros for the others.
fn full_rows(kern: &Kernels, q: &Tensor, k: &Tensor, v: &Tensor, full: &Tensor) -> Tensor {
    // No query is on the window: any valid window (1) will do.
    kern.routed_attention(q, k, v, &query_paths(full, None), 1)
        .expect(KERNEL_FAILED)
}

/// Routed attention `[B, H, L, D]`: each query marked in `on: [B, H, L]` (bool) attends its
/// whole prefix, every other query its window, and no query runs the path it did not pick
/// (one list per (b, h) holding both, in one launch). Differentiable in q, k, v.
fn routed_attention(
    kern: &Kernels,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    on: &Tensor,
    window: i64,
) -> Tensor {
    kern.routed_attention(q, k, v, &routed_paths(on), window)
        .expect(KERNEL_FAILED)
}

/// Which window-picking queries also need the full path's output (see `per_head`).
enum Values<'a> {
    None,
    All,
    /// Those marked in a `[B, T, H]` mask.
    Some(&'a Tensor),
}

/// A uniform draw in [0, 1) per (batch row, position, head) of a `[B, T, H]` chunk starting
/// at position `start`: an integer hash of (seed, layer, row, position, head) computed on the
/// device, so it does not depend on the device, the chunking, or any generator's state.
pub(crate) fn hash_uniform(
    seed: u64,
    layer: usize,
    shape: [i64; 3],
    start: i64,
    device: Device,
) -> Tensor {
    let [b, l, h] = shape;
    let ar = |n: i64, at: i64| Tensor::arange_start(at, at + n, (Kind::Int64, device));
    let mask = 0xFFFF_FFFFi64;
    let salt =
        ((seed ^ (seed >> 32) ^ (layer as u64).wrapping_mul(0x9E37_79B9)) & 0xFFFF_FFFF) as i64;
    let mut x = ar(b, 0).view([b, 1, 1]) * 0x2545_F491i64
        + ar(l, start).view([1, l, 1]) * 0x1B87_3593i64
        + ar(h, 0).view([1, 1, h]) * 0x5BD1_E995i64
        + salt;
    // Products of values below 2^32 with multipliers below 2^31 stay inside int64.
    for mul in [0x7FEB_352Di64, 0x046B_2B8Bi64, 0x2C1B_3C6Di64] {
        x = x.bitwise_and(mask);
        x = x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(16)) * mul;
    }
    let x = x.bitwise_and(mask);
    x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(15))
        .to_kind(Kind::Double)
        / 4294967296.0
}

impl SelfAttention {
    /// `p` is `model.layers.N.self_attn`; `fixed_heads` the static_heads assignment of this
    /// layer.
    pub fn new(
        p: nn::Path,
        layer: usize,
        m: &ModelConfig,
        a: &AttentionConfig,
        fixed_heads: Option<&[bool]>,
        kernels: Option<&'static Kernels>,
    ) -> Self {
        let proj = Projections::new(&p, m);
        let (d, h) = (m.hidden_size as i64, m.num_attention_heads as i64);
        // `reads_hidden`: the router reads the layer's hidden state (AHA, SwiAttn), not a
        // module's output (L2A).
        let learned = |outputs: i64, bias: Option<f64>, inclusive: bool, reads_hidden: bool| {
            let rp = &p / "router";
            let weight = rp.var("weight", &[outputs, d], nn::Init::Const(0.0));
            let bias = bias.map(|b| rp.var("bias", &[outputs], nn::Init::Const(b)));
            let norm = (reads_hidden && m.norm_placement == NormPlacement::Post)
                .then(|| RmsNorm::new(&p / "router_norm", d, m.rms_norm_eps).with_kernels(kernels));
            GateSource::Learned {
                router: Linear { weight, bias },
                norm,
                tau: a.tau,
                inclusive,
                lambda: a.lambda,
            }
        };
        let source =
            |outputs: i64, bias: Option<f64>, inclusive: bool, reads_hidden: bool| match a.router {
                Router::Learned => learned(outputs, bias, inclusive, reads_hidden),
                Router::Bernoulli => GateSource::Bernoulli(a.bernoulli_p),
            };
        let route = match a.method {
            Method::Full | Method::Swa | Method::Ppa | Method::StaticHybrid => {
                Route::Static(layer_pattern(a, layer))
            }
            Method::L2a if a.pruned_layers.contains(&layer) => {
                Route::Static(KeyPattern::Window(a.window))
            }
            // The L2A router is W s with no bias, zero-initialised (d_hat = 0.5: every token global).
            Method::L2a => Route::Global {
                gates: source(1, None, true, false),
                global: Box::new(Projections::new(&(&p / "global_attn"), m)),
            },
            Method::Aha => Route::PerHead {
                gates: source(h, Some(a.router_init_bias), false, true),
            },
            Method::StaticHeads => {
                let on: Vec<f32> = fixed_heads
                    .expect("static_heads needs a head assignment")
                    .iter()
                    .map(|&b| b as u8 as f32)
                    .collect();
                Route::PerHead {
                    gates: GateSource::Fixed(Tensor::from_slice(&on).to_device(p.device())),
                }
            }
            Method::Swiattn => Route::Switch {
                gates: source(1, Some(a.router_init_bias), false, true),
                swa_o_proj: (!a.swiattn_shared_o_proj).then(|| {
                    Linear::new(
                        &p / "swa_o_proj",
                        h * m.head_dim() as i64,
                        d,
                        false,
                        m.initializer_range,
                    )
                }),
                reg: SwiAttnReg {
                    gamma_base: a.swiattn_gamma_base,
                    eps: a.swiattn_eps,
                    alpha: a.swiattn_alpha,
                    adaptive: a.swiattn_adaptive,
                    nll: a.swiattn_nll,
                    disagreement: a.swiattn_disagreement,
                },
            },
        };
        SelfAttention {
            proj,
            route,
            window: a.window,
            ste_sample: a.ste_sample,
            layer,
            prefix: format!("model.layers.{layer}.self_attn"),
            kernels,
        }
    }

    /// `pattern` for every query of the chunk: windows and PPA go to the kernels when the
    /// library is loaded and the keys are the chunk's own.
    fn attend_all(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        pattern: KeyPattern,
        keys: &Keys,
        slot: usize,
    ) -> Tensor {
        match (self.kernels, pattern, keys) {
            (Some(kern), KeyPattern::Window(w), Keys::Chunk(_)) => kern
                .list_attention(q, k, v, None, w as i64)
                .expect(KERNEL_FAILED),
            (Some(kern), KeyPattern::Ppa { window, .. }, Keys::Chunk(cache)) => {
                match cache.ppa_offsets(pattern) {
                    None => kern.list_attention(q, k, v, None, window as i64),
                    Some(offsets) => kern.ppa_attention(q, k, v, window as i64, &offsets),
                }
                .expect(KERNEL_FAILED)
            }
            _ => keys.attend(slot, q, k, v, pattern),
        }
    }

    /// AHA's per-(token, head) mix `g * full + (1 - g) * local`, `[B, H, T, D]`, for hard
    /// choices `on` and gate values `g` (`[B, T, H]`; `g` equals `on` in value and carries the
    /// straight-through gradient). `values` says which queries that picked the window also need
    /// the full path's output for the router's gradient `dy . (full - local)`.
    ///
    /// With kernels and the chunk's own keys it is computed as `chosen + (g - on) * sg(full -
    /// local)`: `chosen` is one routed launch (each query runs only the path it picked, with
    /// gradient; the path it did not pick reaches the loss multiplied by a hard 0, so its
    /// gradient is exactly zero), and `full - local` needs the other path only where the
    /// router's gradient reads it, from a second routed launch without gradient: the window
    /// for queries on the full path, the full prefix for the window queries `values` marks,
    /// nothing for the rest.
    /// Without gradient this is `chosen` alone, exact for gates that are 0 or 1
    /// (`GateOverride::Relaxed` gates are not, and are meant for gradients).
    #[allow(clippy::too_many_arguments)]
    fn per_head(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        on: &Tensor,
        g: &Tensor,
        keys: &Keys,
        values: Values,
    ) -> Tensor {
        let w = self.window as i64;
        let gv = |t: &Tensor| t.to_kind(q.kind()).transpose(1, 2).unsqueeze(-1);
        match (self.kernels, keys) {
            (Some(kern), Keys::Chunk(_)) => {
                let full = on.transpose(1, 2).gt(0.5);
                let chosen = routed_attention(kern, q, k, v, &full, w);
                if !q.requires_grad() {
                    return chosen;
                }
                let flip = match values {
                    Values::None => return chosen,
                    Values::All => full.logical_not(),
                    Values::Some(rows) => rows
                        .transpose(1, 2)
                        .gt(0.5)
                        .logical_and(&full.logical_not()),
                };
                let paths = query_paths(&flip, Some(&full));
                let other = tch::no_grad(|| kern.routed_attention(q, k, v, &paths, w))
                    .expect(KERNEL_FAILED);
                // full - local is chosen minus the other path on the full path's rows and the
                // other way round on the window's: the sign goes on the per-row weight (rows
                // where neither is needed get a finite value that a zero gradient weight
                // multiplies). One fused kernel each way (`Kernels::st_mix`).
                let weight = ((g - on) * (on * 2.0 - 1.0)).transpose(1, 2);
                kern.st_mix(&chosen, &other, &weight).expect(KERNEL_FAILED)
            }
            _ => {
                let (full, local) = self.branches(q, k, v, on, keys, false);
                let g = gv(g);
                &g * full + (1.0 - &g) * local
            }
        }
    }

    /// AHA's layer with a learned router on the kernels, over the chunk's own keys: what the
    /// generic branch of `forward` and `per_head` compute, with the gates, probes, paths and
    /// pairs in one kernel (`Kernels::aha_gates`) and the router's scores in one
    /// (`Kernels::router`), where ATen took some fifty launches a layer,
    /// whose host cost bounded the training step's forward at L 8192 (PERFORMANCE.md).
    #[allow(clippy::too_many_arguments)]
    fn per_head_fused(
        &self,
        x: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        router: &Linear,
        tau: f64,
        lambda: f64,
        start: i64,
        ctx: &ForwardCtx,
    ) -> AttnOutput {
        let kern = self.kernels.expect("the fused path runs on the kernels");
        // In fp32, as `gates` computes them (`Kernels::router` reads x in its own dtype).
        let scores = kern
            .router(x, &router.weight, router.bias.as_ref())
            .expect(KERNEL_FAILED);
        let grad = q.requires_grad();
        // Without gradient no query is probed; with it, `ste_sample` 1 probes every window
        // query (the exact straight-through gradient).
        let sample = if grad { self.ste_sample } else { 1.0 };
        let w = self.window as i64;
        let g = kern
            .aha_gates(&scores, tau, sample, ctx.gate_seed, self.layer, start, w)
            .expect(KERNEL_FAILED);
        let chosen = kern
            .routed_attention(q, k, v, &g.chosen, w)
            .expect(KERNEL_FAILED);
        let y = if grad {
            let other =
                tch::no_grad(|| kern.routed_attention(q, k, v, &g.other, w)).expect(KERNEL_FAILED);
            kern.st_mix(&chosen, &other, &g.weight)
                .expect(KERNEL_FAILED)
        } else {
            chosen
        };
        AttnOutput {
            y: self.proj.out(&y, Some(kern)),
            pairs: g.pairs,
            reg: Some(Regulariser::Term(scores.mean(Kind::Float) * lambda)),
            gates: Some(g.hard),
            scores: Some(scores),
        }
    }

    /// Full-prefix and window outputs `[B, H, T, D]` for a per-token choice `on: [B, T, H]`,
    /// combined by the caller as `g * full + (1 - g) * local` with `g` numerically equal to
    /// `on`. `all_values`: the queries that picked the window also need the full path's output
    /// (for a router's gradient).
    ///
    /// SwiAttn's branches, and AHA's without kernels (`per_head` handles AHA's kernel path).
    /// With kernels and the chunk's own keys, the full path runs with gradient only for the
    /// queries that picked it (one routed list): the other rows of `full` reach the loss
    /// multiplied by a hard 0, so their gradient is exactly zero and skipping it changes
    /// nothing; `all_values` fills them by a dense forward without gradient.
    /// Without gradient, each query runs only its own path, and both outputs are that one
    /// routed output: the caller's mix then returns it for gates that are exactly 0 or 1.
    fn branches(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        on: &Tensor,
        keys: &Keys,
        all_values: bool,
    ) -> (Tensor, Tensor) {
        let window = KeyPattern::Window(self.window);
        match (self.kernels, keys) {
            (Some(kern), Keys::Chunk(_)) => {
                let on = on.transpose(1, 2).gt(0.5);
                if !q.requires_grad() {
                    // Each query's row holds the output of the path it picked; the gates are
                    // hard here, so the caller's mix of the two returns it.
                    let y = routed_attention(kern, q, k, v, &on, self.window as i64);
                    return (y.shallow_clone(), y);
                }
                let full = full_rows(kern, q, k, v, &on);
                let full = if all_values {
                    let rest = tch::no_grad(|| keys.attend(0, q, k, v, KeyPattern::Full));
                    full + rest * on.logical_not().unsqueeze(-1).to_kind(q.kind())
                } else {
                    full
                };
                (full, self.attend_all(q, k, v, window, keys, 0))
            }
            // Decoding: a path that no query of the chunk picked is not run.
            (_, Keys::Cache { .. }) if !q.requires_grad() => {
                let picked = |t: Tensor| t.any().int64_value(&[]) != 0;
                let full = match picked(on.gt(0.5)) {
                    true => keys.attend(0, q, k, v, KeyPattern::Full),
                    false => q.zeros_like(),
                };
                let local = match picked(on.le(0.5)) {
                    true => self.attend_all(q, k, v, window, keys, 0),
                    false => q.zeros_like(),
                };
                (full, local)
            }
            _ => (
                keys.attend(0, q, k, v, KeyPattern::Full),
                self.attend_all(q, k, v, window, keys, 0),
            ),
        }
    }

    /// Parameters a method adds that start as copies of base parameters, `(new, base)`:
    /// L2A's global module and SwiAttn's window-branch output projection.
    pub fn derived_params(&self) -> Vec<(String, String)> {
        let p = &self.prefix;
        match &self.route {
            Route::Global { global, .. } => {
                let mut v: Vec<(String, String)> = ["q_proj", "k_proj", "v_proj", "o_proj"]
                    .iter()
                    .map(|n| {
                        (
                            format!("{p}.global_attn.{n}.weight"),
                            format!("{p}.{n}.weight"),
                        )
                    })
                    .collect();
                if global.q_norm.is_some() {
                    v.extend(["q_norm", "k_norm"].iter().map(|n| {
                        (
                            format!("{p}.global_attn.{n}.weight"),
                            format!("{p}.{n}.weight"),
                        )
                    }));
                }
                if global.q_proj.bias.is_some() {
                    v.extend(
                        ["q_proj", "k_proj", "v_proj"].iter().map(|n| {
                            (format!("{p}.global_attn.{n}.bias"), format!("{p}.{n}.bias"))
                        }),
                    );
                }
                v
            }
            Route::Switch {
                swa_o_proj: Some(_),
                ..
            } => vec![(
                format!("{p}.swa_o_proj.weight"),
                format!("{p}.o_proj.weight"),
            )],
            _ => vec![],
        }
    }

    /// Bytes of the key-value cache this layer needs for a context of `len` tokens at
    /// decode time (`elt` bytes per value).
    pub fn kv_cache_bytes(&self, len: usize, elt: usize) -> f64 {
        let per = self.proj.kv_bytes_per_position(elt);
        let window = self.window.min(len) as f64 * per;
        match &self.route {
            Route::Static(KeyPattern::Window(w)) => (*w).min(len) as f64 * per,
            // PPA reaches back to the oldest offset, so it keeps everything.
            Route::Static(_) => len as f64 * per,
            // Any token may route to the full path, which reads the one shared cache.
            Route::PerHead { .. } | Route::Switch { .. } => len as f64 * per,
            // The local module's window plus the global module's own full cache.
            Route::Global { global, .. } => window + len as f64 * global.kv_bytes_per_position(elt),
        }
    }

    /// Hard gates and the gate value used in the forward pass, shaped like `like`
    /// (`[B, L, outputs]`), for learned routers with their soft scores.
    fn gates(
        &self,
        source: &GateSource,
        x: &Tensor,
        like: [i64; 3],
        start: i64,
        ctx: &ForwardCtx,
    ) -> Gate {
        // Routers run in fp32 so thresholding does not depend on the compute dtype.
        let logits = match source {
            GateSource::Learned { router, norm, .. } => {
                Some(router.forward(&upcast(&router_input(norm, x))))
            }
            _ => None,
        };
        let scores = logits.as_ref().map(|r| r.sigmoid());
        let ste = |hard: Tensor| match &scores {
            Some(s) => straight_through(&hard, s),
            None => hard,
        };
        let opts = (Kind::Float, x.device());
        let (hard, value) = match &ctx.gate_override {
            Some(GateOverride::Constant(c)) => {
                let hard = Tensor::full(like, *c, opts);
                (hard.shallow_clone(), ste(hard))
            }
            Some(GateOverride::Relaxed(layers)) => {
                let (hard, anchor) = &layers[self.layer];
                let s = scores
                    .as_ref()
                    .expect("relaxed gates need a learned router");
                (hard.shallow_clone(), hard + s - anchor)
            }
            None => match source {
                GateSource::Learned { tau, inclusive, .. } => {
                    let hard = threshold(scores.as_ref().expect("scored"), *tau, *inclusive);
                    (hard.shallow_clone(), ste(hard))
                }
                GateSource::Bernoulli(p) => {
                    let mut draws = Vec::with_capacity((like[0] * like[1] * like[2]) as usize);
                    for b in 0..like[0] {
                        for t in 0..like[1] {
                            for h in 0..like[2] {
                                let key =
                                    [self.layer as u64, b as u64, (start + t) as u64, h as u64];
                                let mut r = Rng::new(Rng::derive(ctx.gate_seed, &key));
                                draws.push((r.uniform() < *p) as u8 as f32);
                            }
                        }
                    }
                    let hard = Tensor::from_slice(&draws).view(like).to_device(x.device());
                    (hard.shallow_clone(), hard)
                }
                GateSource::Fixed(heads) => {
                    let hard = heads.view([1, 1, like[2]]).expand(like, false).contiguous();
                    (hard.shallow_clone(), hard)
                }
            },
        };
        Gate {
            hard,
            value,
            scores,
            logits,
        }
    }

    /// `x: [B, L, hidden]`, already normalised.
    /// `x: [B, T, hidden]` (already normalised), the chunk of positions `keys.start() ..`;
    /// `rope` covers those positions.
    pub fn forward(&self, x: &Tensor, rope: &Rope, keys: &Keys, ctx: &ForwardCtx) -> AttnOutput {
        let (b, l, _) = x.size3().expect("attention input is [B, L, hidden]");
        let h = self.proj.n_heads;
        let start = keys.start();
        let window = KeyPattern::Window(self.window);
        let (q, k, v) = self.proj.qkv(x, rope, self.kernels);
        let (k, v) = keys.extend(0, k, v);
        let (first, end) = (start as usize, (start + l) as usize);
        let out = match &self.route {
            Route::Static(pattern) => {
                let pairs = (b * h) as f64 * pattern.pairs_between(first, end) as f64;
                AttnOutput {
                    y: self.proj.out(
                        &self.attend_all(&q, &k, &v, *pattern, keys, 0),
                        self.kernels,
                    ),
                    gates: None,
                    scores: None,
                    reg: None,
                    pairs: Tensor::from(pairs),
                }
            }
            Route::PerHead {
                gates:
                    GateSource::Learned {
                        router,
                        norm,
                        tau,
                        inclusive: false,
                        lambda,
                    },
            } if self.kernels.is_some()
                && matches!(keys, Keys::Chunk(_))
                && ctx.gate_override.is_none() =>
            {
                let input = router_input(norm, x);
                self.per_head_fused(&input, &q, &k, &v, router, *tau, *lambda, start, ctx)
            }
            Route::PerHead { gates } => {
                let g = self.gates(gates, x, [b, l, h], start, ctx);
                let learned = matches!(gates, GateSource::Learned { .. });
                // Sampled straight-through gradient (attention.ste_sample): a random subset
                // of the window-picking pairs computes the full path, and their router
                // gradient is scaled up by 1 / ste_sample; the other window pairs send none.
                let probe = (learned && self.ste_sample < 1.0 && q.requires_grad()).then(|| {
                    let u = hash_uniform(ctx.gate_seed, self.layer, [b, l, h], start, x.device());
                    u.lt(self.ste_sample).logical_and(&g.hard.le(0.5))
                });
                let values = match (&probe, learned) {
                    (Some(p), _) => Values::Some(p),
                    (None, true) => Values::All,
                    (None, false) => Values::None,
                };
                let value = match &probe {
                    Some(p) => {
                        let weight = g.hard.gt(0.5).to_kind(Kind::Float)
                            + p.to_kind(Kind::Float) / self.ste_sample;
                        &g.hard + weight * (&g.value - &g.hard)
                    }
                    None => g.value.shallow_clone(),
                };
                let y = self.per_head(&q, &k, &v, &g.hard, &value, keys, values);
                AttnOutput {
                    y: self.proj.out(&y, self.kernels),
                    pairs: routed_pairs(&g.hard, self.window, start),
                    reg: learned_lambda(gates).map(|lambda| {
                        Regulariser::Term(
                            g.scores.as_ref().expect("scored").mean(Kind::Float) * lambda,
                        )
                    }),
                    gates: Some(g.hard),
                    scores: g.scores,
                }
            }
            Route::Global { gates, global } => {
                let s = self
                    .proj
                    .out(&self.attend_all(&q, &k, &v, window, keys, 0), self.kernels);
                let g = self.gates(gates, &s, [b, l, 1], start, ctx);
                let (qg, kg, vg) = global.qkv(&s, rope, self.kernels);
                // Every token's s is a key of the global module, routed or not.
                let (kg, vg) = keys.extend(1, kg, vg);
                // Global attention runs only for routed tokens (all of them when forced), so an
                // unrouted token's a_t is zero and sends the router no language-model gradient.
                let executed = if ctx.force_global {
                    g.hard.ones_like()
                } else {
                    g.hard.shallow_clone()
                };
                let a = match (self.kernels, keys) {
                    (Some(kern), Keys::Chunk(_)) => {
                        let active = executed.transpose(1, 2).gt(0.5).expand([b, h, l], false);
                        global.out(&full_rows(kern, &qg, &kg, &vg, &active), self.kernels)
                    }
                    // Decoding: no token of the chunk routed, so global attention is skipped.
                    (_, Keys::Cache { .. })
                        if !qg.requires_grad() && executed.max().double_value(&[]) == 0.0 =>
                    {
                        s.zeros_like()
                    }
                    _ => {
                        global.out(
                            &keys.attend(1, &qg, &kg, &vg, KeyPattern::Full),
                            self.kernels,
                        ) * executed.to_kind(x.kind())
                    }
                };
                let y = &s + g.value.to_kind(x.kind()) * a;
                let local_pairs = (b * h) as f64 * window.pairs_between(first, end) as f64;
                let positions =
                    Tensor::arange_start(start + 1, start + l + 1, (Kind::Float, x.device()));
                let global_pairs =
                    (executed.squeeze_dim(-1) * positions).sum(Kind::Float) * h as f64;
                AttnOutput {
                    y,
                    pairs: global_pairs + local_pairs,
                    reg: learned_lambda(gates).map(|lambda| {
                        Regulariser::Term(
                            g.scores
                                .as_ref()
                                .expect("scored")
                                .square()
                                .mean(Kind::Float)
                                * lambda,
                        )
                    }),
                    gates: Some(g.hard.expand([b, l, h], false)),
                    scores: g.scores,
                }
            }
            Route::Switch {
                gates,
                swa_o_proj,
                reg,
            } => {
                let g = self.gates(gates, x, [b, l, 1], start, ctx);
                // The router's gradient and the regulariser's disagreement read both paths.
                let learned = matches!(gates, GateSource::Learned { .. });
                let (full, local) =
                    self.branches(&q, &k, &v, &g.hard.expand([b, l, h], false), keys, learned);
                let full = self.proj.out(&full, self.kernels);
                let local = match swa_o_proj {
                    Some(o) => o.forward(&self.proj.merge(&local, self.kernels)),
                    None => self.proj.out(&local, self.kernels),
                };
                let gv = g.value.to_kind(x.kind());
                let reg = match gates {
                    GateSource::Learned { .. } => {
                        let logits = g.logits.as_ref().expect("learned").squeeze_dim(-1);
                        Some(Regulariser::Adaptive {
                            logits,
                            disagreement: reg.disagreement(&full, &local),
                            params: *reg,
                        })
                    }
                    _ => None,
                };
                let hard = g.hard.expand([b, l, h], false);
                AttnOutput {
                    y: &gv * full + (1.0 - &gv) * local,
                    pairs: routed_pairs(&hard, self.window, start),
                    reg,
                    gates: Some(hard),
                    scores: g.scores,
                }
            }
        };
        // Keys that no later query can reach through this layer's window are dropped.
        if let Some(w) = self.window_only() {
            keys.trim(0, w, start + l);
        }
        out
    }

    /// The window of a layer whose (base) attention never looks further back, None when some
    /// query may read the whole prefix.
    fn window_only(&self) -> Option<usize> {
        match self.route {
            Route::Static(KeyPattern::Window(w)) => Some(w),
            // L2A's local module; the global module's keys (slot 1) are all kept.
            Route::Global { .. } => Some(self.window),
            _ => None,
        }
    }

    /// The pattern of a static layer, None for routed ones.
    pub fn static_pattern(&self) -> Option<KeyPattern> {
        match self.route {
            Route::Static(p) => Some(p),
            _ => None,
        }
    }
}

struct Gate {
    hard: Tensor,
    value: Tensor,
    scores: Option<Tensor>,
    logits: Option<Tensor>,
}

/// What a learned router reads: `x`, through the router's own norm where it has one.
fn router_input(norm: &Option<RmsNorm>, x: &Tensor) -> Tensor {
    match norm {
        Some(n) => n.forward(x),
        None => x.shallow_clone(),
    }
}

fn learned_lambda(source: &GateSource) -> Option<f64> {
    match source {
        GateSource::Learned { lambda, .. } => Some(*lambda),
        _ => None,
    }
}

/// Pairs attended when gate `[B, L, H]` for the positions from `start` on picks, per (token,
/// head), the whole prefix (i + 1 keys) or the window (min(w, i + 1) keys).
pub fn routed_pairs(hard: &Tensor, window: usize, start: i64) -> Tensor {
    let l = hard.size()[1];
    let full = Tensor::arange_start(start + 1, start + l + 1, (Kind::Float, hard.device()));
    let win = full.clamp_max(window as f64);
    let n = (hard.size()[0] * hard.size()[2]) as f64;
    (hard.to_kind(Kind::Float) * (&full - &win).view([1, l, 1])).sum(Kind::Float)
        + win.sum(Kind::Float) * n
}

#[cfg(test)]
mod tests {
    use super::*;

    /// PPA offsets from their closed form: floor(j^p) steps up by one exactly at
    /// j = ceil(m^(1/p)), m = 1, 2, ...; for p = 1/2 these are the perfect squares.
    fn squares_upto(n: usize) -> Vec<usize> {
        (1..).map(|m: usize| m * m).take_while(|&s| s < n).collect()
    }

    #[test]
    fn ppa_offsets_match_closed_forms() {
        let got: Vec<usize> = (0..1000).filter(|&j| is_power_offset(j, 0.5)).collect();
        assert_eq!(got, squares_upto(1000));
        let got: Vec<usize> = (0..5000).filter(|&j| is_power_offset(j, 0.25)).collect();
        let fourth: Vec<usize> = (1..)
            .map(|m: usize| m.pow(4))
            .take_while(|&s| s < 5000)
            .collect();
        assert_eq!(got, fourth);
        let got: Vec<usize> = (0..70_000).filter(|&j| is_power_offset(j, 0.125)).collect();
        let eighth: Vec<usize> = (1..)
            .map(|m: usize| m.pow(8))
            .take_while(|&s| s < 70_000)
            .collect();
        assert_eq!(got, eighth);
        assert!((1..200).all(|j| is_power_offset(j, 1.0)));
        assert!((0..200).all(|j| !is_power_offset(j, 0.0)));
    }

    #[test]
    fn mask_identities() {
        let len = 97;
        let full = KeyPattern::Full.mask(len, Device::Cpu);
        let ppa1 = KeyPattern::Ppa {
            power: 1.0,
            window: 8,
        }
        .mask(len, Device::Cpu);
        assert!(full.equal(&ppa1), "PPA p=1 is full attention");
        let swa = KeyPattern::Window(8).mask(len, Device::Cpu);
        let ppa0 = KeyPattern::Ppa {
            power: 0.0,
            window: 8,
        }
        .mask(len, Device::Cpu);
        assert!(swa.equal(&ppa0), "PPA p=0 is SWA");
        assert!(
            KeyPattern::Window(len).mask(len, Device::Cpu).equal(&full),
            "w >= L is full"
        );
        assert!(KeyPattern::Window(len + 5)
            .mask(len, Device::Cpu)
            .equal(&full));
        let tril = Tensor::ones([len as i64, len as i64], (Kind::Bool, Device::Cpu)).tril(0);
        assert!(full.equal(&tril));
        // Every query sees itself, and never a later key.
        let w1 = KeyPattern::Window(1).mask(len, Device::Cpu);
        assert!(w1.equal(&Tensor::eye(len as i64, (Kind::Bool, Device::Cpu))));
    }

    #[test]
    fn mask_entries_follow_the_definition() {
        let len = 300;
        for pattern in [
            KeyPattern::Window(5),
            KeyPattern::Ppa {
                power: 0.5,
                window: 4,
            },
        ] {
            let m = pattern.mask(len, Device::Cpu);
            let v: Vec<bool> = Vec::try_from(m.flatten(0, 1)).unwrap();
            for i in 0..len {
                for k in 0..len {
                    let want = k <= i
                        && match pattern {
                            KeyPattern::Window(w) => i - k < w,
                            KeyPattern::Ppa { window, .. } => {
                                let d = i - k;
                                d < window || squares_upto(len).contains(&d)
                            }
                            KeyPattern::Full => true,
                        };
                    assert_eq!(v[i * len + k], want, "{pattern:?} i={i} k={k}");
                }
            }
        }
    }

    #[test]
    fn pair_counts_match_closed_forms_and_masks() {
        for len in [1usize, 7, 64, 257] {
            let l = len as u64;
            assert_eq!(KeyPattern::Full.attended_pairs(len), l * (l + 1) / 2);
            for w in [1usize, 3, 16, 64, 300] {
                let we = w.min(len) as u64;
                assert_eq!(
                    KeyPattern::Window(w).attended_pairs(len),
                    we * l - we * (we - 1) / 2,
                    "w={w} L={len}"
                );
            }
            // PPA p=1/2, window w: window pairs plus, per square s >= w, the L - s queries that reach it.
            let w = 4usize;
            let extra: u64 = squares_upto(len)
                .iter()
                .filter(|&&s| s >= w)
                .map(|&s| (len - s) as u64)
                .sum();
            let we = w.min(len) as u64;
            assert_eq!(
                KeyPattern::Ppa {
                    power: 0.5,
                    window: w
                }
                .attended_pairs(len),
                we * l - we * (we - 1) / 2 + extra
            );
            for p in [
                KeyPattern::Full,
                KeyPattern::Window(5),
                KeyPattern::Ppa {
                    power: 0.75,
                    window: 3,
                },
            ] {
                let from_mask = p.mask(len, Device::Cpu).sum(Kind::Int64).int64_value(&[]) as u64;
                assert_eq!(p.attended_pairs(len), from_mask);
            }
        }
    }

    #[test]
    fn static_hybrid_layer_pattern() {
        let cfg = AttentionConfig {
            method: Method::StaticHybrid,
            window: 32,
            hybrid_every: 4,
            ..Default::default()
        };
        let full: Vec<usize> = (0..22)
            .filter(|&l| layer_pattern(&cfg, l) == KeyPattern::Full)
            .collect();
        // 0-based 3, 7, ... = the paper's 1-based 4, 8, 12, 16, 20.
        assert_eq!(full, vec![3, 7, 11, 15, 19]);
        assert!((0..22)
            .filter(|l| !full.contains(l))
            .all(|l| layer_pattern(&cfg, l) == KeyPattern::Window(32)));
    }

    /// Softmax over the allowed keys, one query at a time, in plain f64 Rust.
    fn explicit_attention(
        q: &[f64],
        k: &[f64],
        v: &[f64],
        len: usize,
        dim: usize,
        allowed: impl Fn(usize, usize) -> bool,
    ) -> Vec<f64> {
        let mut out = vec![0.0; len * dim];
        for i in 0..len {
            let keys: Vec<usize> = (0..=i).filter(|&kk| allowed(i, kk)).collect();
            let scores: Vec<f64> = keys
                .iter()
                .map(|&kk| {
                    (0..dim)
                        .map(|c| q[i * dim + c] * k[kk * dim + c])
                        .sum::<f64>()
                        / (dim as f64).sqrt()
                })
                .collect();
            let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = scores.iter().map(|s| (s - mx).exp()).sum();
            for (s, &kk) in scores.iter().zip(&keys) {
                for c in 0..dim {
                    out[i * dim + c] += (s - mx).exp() / z * v[kk * dim + c];
                }
            }
        }
        out
    }

    #[test]
    fn attention_matches_explicit_softmax_with_gqa() {
        tch::manual_seed(0);
        let (b, h, kv, len, dim) = (2i64, 4i64, 2i64, 40usize, 8i64);
        let opts = (Kind::Double, Device::Cpu);
        let q = Tensor::randn([b, h, len as i64, dim], opts);
        let k = Tensor::randn([b, kv, len as i64, dim], opts);
        let v = Tensor::randn([b, kv, len as i64, dim], opts);
        let patterns = [
            (
                KeyPattern::Full,
                Box::new(|_: usize, _: usize| true) as Box<dyn Fn(usize, usize) -> bool>,
            ),
            (
                KeyPattern::Window(6),
                Box::new(|i: usize, kk: usize| i - kk < 6),
            ),
            (
                KeyPattern::Ppa {
                    power: 0.5,
                    window: 3,
                },
                Box::new(|i: usize, kk: usize| i - kk < 3 || squares_upto(len).contains(&(i - kk))),
            ),
        ];
        for (pattern, allowed) in patterns.iter() {
            let y = attend(&q, &k, &v, pattern, None);
            for bi in 0..b {
                for hi in 0..h {
                    let kvh = hi / (h / kv);
                    let flat = |t: Tensor| Vec::<f64>::try_from(t.flatten(0, 1)).unwrap();
                    let want = explicit_attention(
                        &flat(q.get(bi).get(hi)),
                        &flat(k.get(bi).get(kvh)),
                        &flat(v.get(bi).get(kvh)),
                        len,
                        dim as usize,
                        allowed,
                    );
                    let got = flat(y.get(bi).get(hi));
                    for (g, w) in got.iter().zip(&want) {
                        assert!(
                            (g - w).abs() < 1e-10,
                            "{pattern:?} b={bi} h={hi}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }

    // ---- routed methods -------------------------------------------------------------

    use crate::config::Config;
    use crate::model::ForwardOutput;
    use crate::nn::token_nll;
    use crate::run::Built;

    fn routed_cfg(method: Method, f: impl FnOnce(&mut Config)) -> Config {
        let mut c = Config::default();
        c.model = ModelConfig {
            vocab_size: 13,
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            attention_bias: true,
            ..Default::default()
        };
        c.attention.method = method;
        c.attention.window = 3;
        c.train.device = "cpu".into();
        f(&mut c);
        c
    }

    fn ids() -> Tensor {
        Tensor::from_slice(&[1i64, 5, 3, 7, 2, 9, 4, 4, 11, 0, 6, 8, 12, 3, 5, 1, 2, 7])
            .view([2, 9])
    }

    fn run(b: &Built, ctx: &ForwardCtx) -> ForwardOutput {
        b.model.forward(&ids(), ctx)
    }

    fn forced(v: f64) -> ForwardCtx {
        ForwardCtx {
            gate_override: Some(GateOverride::Constant(v)),
            ..Default::default()
        }
    }

    /// The same base weights in a static model of `method`.
    fn static_twin(routed: &Built, cfg: &Config, method: Method) -> Built {
        let mut c = cfg.clone();
        c.attention.method = method;
        let mut twin = Built::new(&c, Device::Cpu).unwrap();
        twin.vs.copy(&routed.vs).unwrap();
        twin
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    /// Every parameter `std` gives a deviation for set to uniform noise of that deviation
    /// (around 1 for norm weights), from a generator of the test's own: tests running beside
    /// this one draw from tch's global generator, which would make the values vary.
    fn randomise(b: &Built, seed: u64, std: impl Fn(&str) -> Option<f64>) {
        let mut rng = Rng::new(seed);
        tch::no_grad(|| {
            for (name, p) in b.params() {
                let Some(std) = std(&name) else { continue };
                // Uniform on [-a, a] has deviation a / sqrt(3).
                let v: Vec<f32> = (0..p.numel())
                    .map(|_| ((2.0 * rng.uniform() - 1.0) * std * 3f64.sqrt()) as f32)
                    .collect();
                let base = if name.contains("norm") { 1.0 } else { 0.0 };
                p.shallow_clone()
                    .copy_(&(Tensor::from_slice(&v).view(p.size().as_slice()) + base));
            }
        });
    }

    /// Router weights set to random values so gates differ between tokens.
    fn randomise_routers(b: &Built, std: f64) {
        randomise(b, 7, |name| name.contains("router").then_some(std));
    }

    #[test]
    fn forced_gates_reduce_to_full_and_window() {
        for (method, shared) in [
            (Method::Aha, false),
            (Method::Swiattn, false),
            (Method::Swiattn, true),
        ] {
            let cfg = routed_cfg(method, |c| c.attention.swiattn_shared_o_proj = shared);
            let routed = Built::new(&cfg, Device::Cpu).unwrap();
            randomise_routers(&routed, 1.0);
            let full = static_twin(&routed, &cfg, Method::Full);
            let swa = static_twin(&routed, &cfg, Method::Swa);
            let none = ForwardCtx::default();
            let d1 = max_diff(
                &run(&routed, &forced(1.0)).logits,
                &run(&full, &none).logits,
            );
            let d0 = max_diff(&run(&routed, &forced(0.0)).logits, &run(&swa, &none).logits);
            assert!(
                d1 < 1e-5 && d0 < 1e-5,
                "{method:?} shared={shared}: gates=1 vs full {d1}, gates=0 vs SWA {d0}"
            );
            let mixed = run(&routed, &none).logits;
            assert!(
                max_diff(&mixed, &run(&full, &none).logits) > 1e-4,
                "{method:?}: learned gates should mix paths"
            );
        }
        // L2A with every d = 0 is its local path: the base attention with the window.
        let cfg = routed_cfg(Method::L2a, |_| {});
        let routed = Built::new(&cfg, Device::Cpu).unwrap();
        let swa = static_twin(&routed, &cfg, Method::Swa);
        let d0 = max_diff(
            &run(&routed, &forced(0.0)).logits,
            &run(&swa, &ForwardCtx::default()).logits,
        );
        assert!(d0 < 1e-5, "L2A with d = 0 vs SWA: {d0}");
    }

    #[test]
    fn l2a_zero_router_starts_all_global_and_global_module_copies_base() {
        let cfg = routed_cfg(Method::L2a, |_| {});
        let b = Built::new(&cfg, Device::Cpu).unwrap();
        let out = run(&b, &ForwardCtx::default());
        for l in &out.layers {
            assert!(
                l.gates.as_ref().unwrap().min().double_value(&[]) == 1.0,
                "every token global at start"
            );
            assert!(max_diff(l.scores.as_ref().unwrap(), &Tensor::from(0.5f32)) == 0.0);
        }
        let p = b.params();
        for n in ["q_proj.weight", "k_proj.bias", "o_proj.weight"] {
            assert!(p[&format!("model.layers.1.self_attn.global_attn.{n}")]
                .equal(&p[&format!("model.layers.1.self_attn.{n}")]));
        }
        assert!(
            p["model.layers.0.self_attn.router.weight"]
                .abs()
                .sum(Kind::Float)
                .double_value(&[])
                == 0.0
        );
        assert!(
            !p.contains_key("model.layers.0.self_attn.router.bias"),
            "L2A's router is W s, no bias"
        );
    }

    /// `sigmoid(sum_c x_c w_c + b)` in f64.
    fn sigmoid_dot(x: &[f64], w: &[f64], b: f64) -> f64 {
        1.0 / (1.0 + (-(x.iter().zip(w).map(|(a, c)| a * c).sum::<f64>() + b)).exp())
    }

    fn vec64(t: &Tensor) -> Vec<f64> {
        Vec::<f64>::try_from(t.to_kind(Kind::Double).contiguous().flatten(0, -1)).unwrap()
    }

    #[test]
    fn aha_and_l2a_regularisers_match_hand_computation() {
        let x = Tensor::randn([1, 5, 16], (Kind::Float, Device::Cpu));
        let rope = Rope::new(
            5,
            &crate::nn::inv_freq(&routed_cfg(Method::Full, |_| {}).model),
            Kind::Float,
            Device::Cpu,
        );
        let masks = MaskCache::new(5, Device::Cpu);
        let masks = Keys::Chunk(&masks);
        // AHA: lambda * mean over tokens and heads of sigmoid(x W^T + b).
        let cfg = routed_cfg(Method::Aha, |c| c.attention.lambda = 0.25);
        let b = Built::new(&cfg, Device::Cpu).unwrap();
        randomise_routers(&b, 0.5);
        let layer = &b.model.layers[0].self_attn;
        let out = layer.forward(&x, &rope, &masks, &ForwardCtx::default());
        let p = b.params();
        let (w, bias) = (
            vec64(&p["model.layers.0.self_attn.router.weight"]),
            vec64(&p["model.layers.0.self_attn.router.bias"]),
        );
        let xs = vec64(&x);
        let mut want = 0.0;
        for t in 0..5 {
            for h in 0..4 {
                want += sigmoid_dot(&xs[t * 16..t * 16 + 16], &w[h * 16..h * 16 + 16], bias[h]);
            }
        }
        want *= 0.25 / 20.0;
        let got = out
            .reg
            .unwrap()
            .term(&Tensor::zeros([1, 5], (Kind::Float, Device::Cpu)))
            .double_value(&[]);
        assert!((got - want).abs() < 1e-6, "AHA reg {got} vs {want}");

        // L2A: lambda * mean over tokens of d_hat^2, d_hat = sigmoid(W s), s the window output.
        let cfg = routed_cfg(Method::L2a, |c| c.attention.lambda = 0.5);
        let b = Built::new(&cfg, Device::Cpu).unwrap();
        randomise_routers(&b, 0.5);
        let out = b.model.layers[0]
            .self_attn
            .forward(&x, &rope, &masks, &ForwardCtx::default());
        let swa = static_twin(&b, &cfg, Method::Swa);
        let s = vec64(
            &swa.model.layers[0]
                .self_attn
                .forward(&x, &rope, &masks, &ForwardCtx::default())
                .y,
        );
        let w = vec64(&b.params()["model.layers.0.self_attn.router.weight"]);
        let want: f64 = (0..5)
            .map(|t| sigmoid_dot(&s[t * 16..t * 16 + 16], &w, 0.0).powi(2))
            .sum::<f64>()
            * 0.5
            / 5.0;
        let got = out
            .reg
            .unwrap()
            .term(&Tensor::zeros([1, 5], (Kind::Float, Device::Cpu)))
            .double_value(&[]);
        assert!((got - want).abs() < 1e-6, "L2A reg {got} vs {want}");
    }

    #[test]
    fn swiattn_adaptive_regulariser_matches_hand_computation() {
        let logits = [0.3f64, -1.2, 2.0];
        let dis = [0.01f64, 0.0, 0.2];
        let nll = [1.5f64, 0.2, 3.0];
        let t = |v: &[f64]| Tensor::from_slice(v).to_kind(Kind::Float).view([1, 3]);
        let softplus = |x: f64| (1.0 + x.exp()).ln();
        let base = SwiAttnReg {
            gamma_base: 1e-3,
            eps: 0.1,
            alpha: 100.0,
            adaptive: true,
            nll: true,
            disagreement: Reduction::Mean,
        };
        let cases: [(SwiAttnReg, Box<dyn Fn(usize) -> f64>); 4] = [
            (base, Box::new(|i| 1e-3 / (0.1 + nll[i] + 100.0 * dis[i]))),
            (
                SwiAttnReg {
                    adaptive: false,
                    ..base
                },
                Box::new(|_| 1e-3),
            ),
            (
                SwiAttnReg { nll: false, ..base },
                Box::new(|i| 1e-3 / (0.1 + 100.0 * dis[i])),
            ),
            (
                SwiAttnReg {
                    alpha: 0.0,
                    eps: 0.01,
                    ..base
                },
                Box::new(|i| 1e-3 / (0.01 + nll[i])),
            ),
        ];
        for (params, gamma) in cases {
            let r = Regulariser::Adaptive {
                logits: t(&logits),
                disagreement: t(&dis),
                params,
            };
            let want: f64 = (0..3).map(|i| gamma(i) * softplus(logits[i])).sum::<f64>() / 3.0;
            let got = r.term(&t(&nll)).double_value(&[]);
            assert!((got - want).abs() < 1e-9, "{params:?}: {got} vs {want}");
        }
        // The layer's disagreement is the per-token mean squared difference of the branches
        // (the paper's MSE), or with `swiattn_disagreement = "sum"` the squared norm.
        for (reduction, scale) in [(Reduction::Mean, 1.0), (Reduction::Sum, 16.0)] {
            let cfg = routed_cfg(Method::Swiattn, |c| {
                c.attention.swiattn_shared_o_proj = true;
                c.attention.swiattn_disagreement = reduction;
            });
            layer_disagreement_is_the_branches_difference(&cfg, scale);
        }
    }

    /// `scale` times the mean over the hidden dimension of the branches' squared difference.
    fn layer_disagreement_is_the_branches_difference(cfg: &Config, scale: f64) {
        let b = Built::new(cfg, Device::Cpu).unwrap();
        let x = Tensor::randn([1, 6, 16], (Kind::Float, Device::Cpu));
        let rope = Rope::new(
            6,
            &crate::nn::inv_freq(&routed_cfg(Method::Full, |_| {}).model),
            Kind::Float,
            Device::Cpu,
        );
        let masks = MaskCache::new(6, Device::Cpu);
        let masks = Keys::Chunk(&masks);
        let out = b.model.layers[0]
            .self_attn
            .forward(&x, &rope, &masks, &ForwardCtx::default());
        let Some(Regulariser::Adaptive { disagreement, .. }) = out.reg else {
            panic!("SwiAttn has an adaptive regulariser")
        };
        let y = |m: Method| {
            static_twin(&b, cfg, m).model.layers[0]
                .self_attn
                .forward(&x, &rope, &masks, &ForwardCtx::default())
                .y
        };
        let want = (y(Method::Full) - y(Method::Swa))
            .square()
            .mean_dim(-1, false, Kind::Float)
            * scale;
        assert!(max_diff(&disagreement, &want) < 1e-6 * scale);
    }

    /// Loss of a tiny fp64 model with the router's weight `at` shifted by `delta` and the
    /// gates given by `ctx`.
    fn loss_at(b: &Built, router: &str, at: i64, delta: f64, ctx: &ForwardCtx) -> f64 {
        let p = b.params();
        let w = &p[router];
        tch::no_grad(|| {
            let _ = w.view(-1).get(at).shallow_clone().g_add_scalar_(delta);
        });
        let out = b.model.forward(&ids().narrow(1, 0, 8), ctx);
        let loss = token_nll(&out.logits, &ids().narrow(1, 1, 8)).mean(Kind::Double);
        tch::no_grad(|| {
            let _ = w.view(-1).get(at).shallow_clone().g_sub_scalar_(delta);
        });
        loss.double_value(&[])
    }

    #[test]
    fn router_gradient_is_the_ste_gradient() {
        for method in [Method::Aha, Method::L2a, Method::Swiattn] {
            // Larger initial weights than a real model's, so gradients stand well above the
            // finite differences' rounding.
            let cfg = routed_cfg(method, |c| c.model.initializer_range = 0.3);
            let mut b = Built::new(&cfg, Device::Cpu).unwrap();
            b.vs.double();
            b.model = {
                // Rebuild the model view over the fp64 parameters with fp64 compute.
                let mut vs = nn::VarStore::new(Device::Cpu);
                let m = crate::model::Llama::new(
                    &vs.root(),
                    &cfg.model,
                    &cfg.attention,
                    Kind::Double,
                    None,
                )
                .unwrap();
                vs.double();
                vs.copy(&b.vs).unwrap();
                b.vs = vs;
                m
            };
            randomise_routers(&b, 2.0);
            let router = "model.layers.0.self_attn.router.weight";
            let p = b.params();
            let out = b
                .model
                .forward(&ids().narrow(1, 0, 8), &ForwardCtx::default());
            let per_token = method != Method::Aha;
            let recorded: Vec<(Tensor, Tensor)> = out
                .layers
                .iter()
                .map(|l| {
                    let g = l.gates.as_ref().unwrap().to_kind(Kind::Double);
                    let g = if per_token { g.narrow(2, 0, 1) } else { g };
                    (g, l.scores.as_ref().unwrap().detach())
                })
                .collect();
            let hard = vec64(&recorded[0].0);
            assert!(
                hard.iter().any(|&g| g == 1.0) && hard.iter().any(|&g| g == 0.0),
                "{method:?}: gates should differ"
            );
            let loss = token_nll(&out.logits, &ids().narrow(1, 1, 8)).mean(Kind::Double);
            loss.backward();
            let grad = vec64(&p[router].grad());
            let scale = grad.iter().fold(0.0f64, |m, g| m.max(g.abs()));
            assert!(scale > 0.0, "{method:?}: router weights get no gradient");
            let top = grad
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
                .unwrap()
                .0 as i64;
            let relaxed = ForwardCtx {
                gate_override: Some(GateOverride::Relaxed(recorded)),
                ..Default::default()
            };
            let eps = 1e-5;
            for at in [top, 1, 9] {
                let fd = (loss_at(&b, router, at, eps, &relaxed)
                    - loss_at(&b, router, at, -eps, &relaxed))
                    / (2.0 * eps);
                let g = grad[at as usize];
                assert!(
                    (fd - g).abs() < 1e-4 * scale,
                    "{method:?} w[{at}]: STE {g} vs finite difference {fd}"
                );
            }
        }
    }

    #[test]
    fn p_force_keeps_output_and_reaches_masked_tokens() {
        // tau above the zero router's 0.5: every token masked.
        let cfg = routed_cfg(Method::L2a, |c| {
            c.attention.tau = 0.9;
            c.attention.lambda = 0.0;
        });
        let b = Built::new(&cfg, Device::Cpu).unwrap();
        let router = "model.layers.1.self_attn.router.weight";
        let mut grads = Vec::new();
        let mut logits = Vec::new();
        for force in [false, true] {
            let ctx = ForwardCtx {
                force_global: force,
                ..Default::default()
            };
            b.vs.trainable_variables().iter().for_each(|v| {
                let mut g = v.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            });
            let out = run(&b, &ctx);
            assert_eq!(
                out.layers[1]
                    .gates
                    .as_ref()
                    .unwrap()
                    .max()
                    .double_value(&[]),
                0.0
            );
            token_nll(&out.logits, &ids()).mean(Kind::Float).backward();
            grads.push(
                b.params()[router]
                    .grad()
                    .abs()
                    .sum(Kind::Float)
                    .double_value(&[]),
            );
            logits.push(out.logits);
        }
        assert!(
            max_diff(&logits[0], &logits[1]) == 0.0,
            "forcing must not change the forward output"
        );
        assert_eq!(
            grads[0], 0.0,
            "unforced: masked tokens send the router no LM gradient"
        );
        assert!(
            grads[1] > 0.0,
            "forced: the router gets an LM gradient on masked tokens"
        );
    }

    #[test]
    fn bernoulli_and_static_head_gates() {
        let cfg = routed_cfg(Method::L2a, |c| {
            c.attention.router = Router::Bernoulli;
            c.attention.bernoulli_p = 0.2;
        });
        let b = Built::new(&cfg, Device::Cpu).unwrap();
        assert!(
            !b.params().keys().any(|n| n.contains("router")),
            "context-free gates have no router"
        );
        let x = Tensor::randint(13, [8, 200], (Kind::Int64, Device::Cpu));
        let ctx = || ForwardCtx {
            gate_seed: 9,
            ..Default::default()
        };
        let out = b.model.forward(&x, &ctx());
        let mu = out.full_usage().unwrap().double_value(&[]);
        assert!((mu - 0.2).abs() < 0.02, "Bernoulli(0.2) gates average {mu}");
        assert!(out.layers[0].gates.as_ref().unwrap().equal(
            b.model.forward(&x, &ctx()).layers[0]
                .gates
                .as_ref()
                .unwrap()
        ));
        assert!(out
            .regulariser(&Tensor::zeros([8, 200], (Kind::Float, Device::Cpu)))
            .is_none());

        let dir = std::env::temp_dir().join(format!("attnsweep-heads-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ranking = dir.join("head_ranking.csv");
        std::fs::write(
            &ranking,
            "rank,layer,head,mu_f\n1,1,2,0.9\n2,0,0,0.5\n3,0,1,0.1\n",
        )
        .unwrap();
        let cfg = routed_cfg(Method::StaticHeads, |c| {
            c.attention.head_ranking = ranking.clone();
            c.attention.top_k = 2;
        });
        let b = Built::new(&cfg, Device::Cpu).unwrap();
        let out = run(&b, &ForwardCtx::default());
        let per_head = |l: usize| {
            vec64(&out.layers[l].gates.as_ref().unwrap().mean_dim(
                [0i64, 1].as_slice(),
                false,
                Kind::Float,
            ))
        };
        assert_eq!(per_head(0), vec![1.0, 0.0, 0.0, 0.0]);
        assert_eq!(per_head(1), vec![0.0, 0.0, 1.0, 0.0]);
        let too_many = routed_cfg(Method::StaticHeads, |c| {
            c.attention.head_ranking = ranking.clone();
            c.attention.top_k = 4;
        });
        assert!(
            format!("{:#}", Built::new(&too_many, Device::Cpu).err().unwrap())
                .contains("fewer than attention.top_k")
        );
    }

    /// A post-norm model (OLMo-2) hands attention the raw residual stream; AHA's and
    /// SwiAttn's routers read it through their own RMSNorm, so scaling the stream leaves
    /// their scores as they are. L2A's router reads the local output and has no norm.
    #[test]
    fn post_norm_routers_read_a_normalised_hidden_state() {
        for method in [Method::Aha, Method::Swiattn, Method::L2a] {
            let cfg = routed_cfg(method, |c| c.model.norm_placement = NormPlacement::Post);
            let b = Built::new(&cfg, Device::Cpu).unwrap();
            let has_norm = b.params().keys().any(|n| n.contains("router_norm"));
            assert_eq!(has_norm, method != Method::L2a, "{method:?}");
            if method == Method::L2a {
                continue;
            }
            randomise_routers(&b, 1.0);
            let x = Tensor::randn([1, 6, 16], (Kind::Float, Device::Cpu));
            let rope = Rope::new(
                6,
                &crate::nn::inv_freq(&cfg.model),
                Kind::Float,
                Device::Cpu,
            );
            let masks = MaskCache::new(6, Device::Cpu);
            let scores = |x: &Tensor| {
                b.model.layers[0]
                    .self_attn
                    .forward(x, &rope, &Keys::Chunk(&masks), &ForwardCtx::default())
                    .scores
                    .unwrap()
            };
            assert!(
                max_diff(&scores(&x), &scores(&(&x * 7.0))) < 1e-5,
                "{method:?}"
            );
        }
        // In a pre-norm model the block's own norm does this, and the router has none.
        let b = Built::new(&routed_cfg(Method::Aha, |_| {}), Device::Cpu).unwrap();
        assert!(!b.params().keys().any(|n| n.contains("router_norm")));
    }

    #[test]
    fn routed_pairs_count_the_executed_path() {
        let g = Tensor::from_slice(&[1f32, 0., 0., 1., 1., 0.]).view([1, 3, 2]);
        // Window 2: token t sees min(2, t+1) keys locally, t+1 keys on the full path.
        let want = (1 + 1) + (2 + 2) + (3 + 2);
        assert_eq!(routed_pairs(&g, 2, 0).double_value(&[]), want as f64);
        // L2A: every token's window plus the global prefix of routed tokens.
        let cfg = routed_cfg(Method::L2a, |_| {});
        let b = Built::new(&cfg, Device::Cpu).unwrap();
        let out = run(&b, &ForwardCtx::default());
        let local = KeyPattern::Window(3).attended_pairs(9) as f64 * 2.0 * 4.0;
        assert_eq!(
            out.layers[0].pairs.double_value(&[]),
            local + KeyPattern::Full.attended_pairs(9) as f64 * 2.0 * 4.0
        );
        let out = run(&b, &forced(0.0));
        assert_eq!(out.layers[0].pairs.double_value(&[]), local);
    }

    #[test]
    fn kv_cache_bytes_follow_each_layer_kind() {
        // 2 KV heads of 4 dims, keys and values, fp32: 64 bytes per cached position.
        let len = 100;
        let kv = |cfg: Config| {
            Built::new(&cfg, Device::Cpu)
                .unwrap()
                .model
                .kv_cache_bytes(len)
        };
        assert_eq!(kv(routed_cfg(Method::Full, |_| {})), vec![6400.0; 2]);
        assert_eq!(kv(routed_cfg(Method::Swa, |_| {})), vec![192.0; 2]);
        assert_eq!(kv(routed_cfg(Method::Aha, |_| {})), vec![6400.0; 2]);
        assert_eq!(kv(routed_cfg(Method::L2a, |_| {})), vec![6592.0; 2]);
        assert_eq!(
            kv(routed_cfg(Method::L2a, |c| c.attention.pruned_layers = vec![1])),
            vec![6592.0, 192.0]
        );
    }

    /// The kernel wiring (band attention for windows, routed lists for routed paths) computes
    /// what the reference path computes, in training (gradients through the kernels; AHA as
    /// one routed launch plus the other path without gradient) and in evaluation (each query
    /// on its own path).
    /// On the CPU the library runs its ATen reference, so this checks the wiring; the CUDA
    /// kernels themselves are checked in kernels.rs.
    #[test]
    fn kernel_path_matches_reference_path_for_every_method() {
        use crate::config::AttnImpl;
        let bernoulli = |c: &mut Config| {
            c.attention.router = Router::Bernoulli;
            c.attention.bernoulli_p = 0.3;
        };
        for (method, cfg) in [
            (Method::Swa, routed_cfg(Method::Swa, |_| {})),
            (
                Method::Ppa,
                routed_cfg(Method::Ppa, |c| c.attention.ppa_power = 0.5),
            ),
            (
                Method::StaticHybrid,
                routed_cfg(Method::StaticHybrid, |c| c.attention.hybrid_every = 2),
            ),
            (Method::Aha, routed_cfg(Method::Aha, |_| {})),
            // No router gradient: the full path runs for the picked queries only.
            (Method::Aha, routed_cfg(Method::Aha, bernoulli)),
            // Sampled straight-through gradient: full path for the picked and probed queries.
            (
                Method::Aha,
                routed_cfg(Method::Aha, |c| c.attention.ste_sample = 0.5),
            ),
            (Method::L2a, routed_cfg(Method::L2a, |_| {})),
            (Method::Swiattn, routed_cfg(Method::Swiattn, |_| {})),
        ] {
            let reference = Built::new(&cfg, Device::Cpu).unwrap();
            randomise_routers(&reference, 1.0);
            let mut kc = cfg.clone();
            kc.attention.attn_impl = AttnImpl::Cuda;
            let kernel = Built::new(&kc, Device::Cpu).unwrap();
            assert!(kernel.model.kernels.is_some() && reference.model.kernels.is_none());
            let mut kvs = kernel.vs;
            kvs.copy(&reference.vs).unwrap();
            let kernel = Built {
                vs: kvs,
                model: kernel.model,
            };
            let ctx = ForwardCtx::default();
            let (a, b) = (run(&reference, &ctx), run(&kernel, &ctx));
            assert!(
                max_diff(&a.logits, &b.logits) < 1e-5,
                "{method:?} train-mode logits"
            );
            let grads = |m: &Built, out: &ForwardOutput| {
                token_nll(&out.logits, &ids()).mean(Kind::Float).backward();
                m.params()
                    .into_iter()
                    .filter(|(_, p)| p.grad().defined())
                    .map(|(n, p)| (n, p.grad()))
                    .collect::<Vec<_>>()
            };
            for ((n, ga), (_, gb)) in grads(&reference, &a).iter().zip(grads(&kernel, &b).iter()) {
                assert!(max_diff(ga, gb) < 1e-5, "{method:?}: gradient of {n}");
            }
            let (a, b) = tch::no_grad(|| (run(&reference, &ctx), run(&kernel, &ctx)));
            assert!(
                max_diff(&a.logits, &b.logits) < 1e-5,
                "{method:?} eval-mode logits"
            );
            assert_eq!(a.attended_pairs(), b.attended_pairs());
        }
    }

    #[test]
    fn hash_uniform_is_uniform_and_independent_of_chunking() {
        let whole = hash_uniform(42, 3, [2, 500, 8], 0, Device::Cpu);
        let (lo, hi) = (whole.min().double_value(&[]), whole.max().double_value(&[]));
        assert!(lo >= 0.0 && hi < 1.0, "range [{lo}, {hi}]");
        let mean = whole.mean(Kind::Double).double_value(&[]);
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
        // Each decile holds about a tenth of the 8000 draws.
        for d in 0..10 {
            let frac = whole
                .ge(d as f64 / 10.0)
                .logical_and(&whole.lt((d + 1) as f64 / 10.0))
                .to_kind(Kind::Double)
                .mean(Kind::Double)
                .double_value(&[]);
            assert!((frac - 0.1).abs() < 0.015, "decile {d}: {frac}");
        }
        let piece = hash_uniform(42, 3, [2, 7, 8], 100, Device::Cpu);
        assert!(piece.equal(&whole.narrow(1, 100, 7)));
        assert!(!hash_uniform(43, 3, [2, 7, 8], 100, Device::Cpu).equal(&piece));
        assert!(!hash_uniform(42, 4, [2, 7, 8], 100, Device::Cpu).equal(&piece));
    }

    /// With ste_sample < 1 the router gradient is an unbiased estimate of the exact
    /// straight-through gradient: its mean over many draws approaches the exact one, while
    /// a single draw differs from it.
    #[test]
    fn sampled_straight_through_gradient_is_unbiased() {
        let cfg = routed_cfg(Method::Aha, |c| c.model.num_hidden_layers = 1);
        let b = Built::new(&cfg, Device::Cpu).unwrap();
        randomise(&b, 11, |name| {
            Some(if name.contains("router") { 1.0 } else { 0.3 })
        });
        let router = &b.params()["model.layers.0.self_attn.router.weight"];
        let grad = |ste_sample: f64, seed: u64| {
            let mut c = cfg.clone();
            c.attention.ste_sample = ste_sample;
            let mut m = Built::new(&c, Device::Cpu).unwrap();
            m.vs.copy(&b.vs).unwrap();
            let ctx = ForwardCtx {
                gate_seed: seed,
                ..Default::default()
            };
            let out = m.model.forward(&ids(), &ctx);
            token_nll(&out.logits, &ids()).mean(Kind::Float).backward();
            m.params()["model.layers.0.self_attn.router.weight"].grad()
        };
        let exact = grad(1.0, 0);
        let draws = 400;
        let mean = (0..draws)
            .map(|s| grad(0.5, s))
            .fold(router.zeros_like(), |a, g| a + g)
            / draws as f64;
        let rel =
            |a: &Tensor| (a - &exact).norm().double_value(&[]) / exact.norm().double_value(&[]);
        assert!(
            rel(&grad(0.5, 7)) > 0.2,
            "one draw should differ from the exact gradient"
        );
        let e = rel(&mean);
        assert!(
            e < 0.1,
            "mean of {draws} draws is {e:.3} away from the exact gradient"
        );
    }

    /// On the GPU, training through the CUDA kernels (routed lists; the other path, where the
    /// router's gradient reads it, without gradient) gives the reference path's logits and
    /// gradients within bf16 noise, AHA with the exact and the sampled straight-through
    /// gradient. One layer, so both paths' routers see the same inputs and no gate flips
    /// between them.
    #[test]
    #[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
    fn cuda_routed_training_matches_reference() {
        use crate::config::{AttnImpl, Dtype};
        crate::kernels::tests::on_cuda("cuda_routed_training_matches_reference", |_| {
            let dev = Device::Cuda(0);
            let rel = |a: &Tensor, b: &Tensor| {
                let b = b.to_kind(Kind::Double);
                (a.to_kind(Kind::Double) - &b).norm().double_value(&[])
                    / b.norm().double_value(&[]).max(1e-6)
            };
            for (method, ste_sample) in [
                (Method::Aha, 1.0),
                (Method::Aha, 0.5),
                (Method::Swiattn, 1.0),
                (Method::L2a, 1.0),
            ] {
                let mut cfg = routed_cfg(method, |c| {
                    c.attention.ste_sample = ste_sample;
                    c.model.hidden_size = 128;
                    c.model.intermediate_size = 256;
                    c.model.num_hidden_layers = 1;
                    c.model.num_attention_heads = 2;
                    c.model.num_key_value_heads = 2;
                    c.model.attention_bias = false;
                    c.attention.window = 37;
                    c.attention.tau = 0.5;
                    c.train.dtype = Dtype::Bf16;
                    c.train.device = "cuda".into();
                });
                let reference = Built::new(&cfg, dev).unwrap();
                randomise_routers(&reference, 0.5);
                cfg.attention.attn_impl = AttnImpl::Cuda;
                let mut kernel = Built::new(&cfg, dev).unwrap();
                assert!(kernel.model.kernels.is_some());
                kernel.vs.copy(&reference.vs).unwrap();
                tch::manual_seed(11);
                let ids = Tensor::randint(13, [2, 301], (Kind::Int64, dev));
                let ctx = ForwardCtx::default();
                let step = |m: &Built| {
                    let out = m.model.forward(&ids, &ctx);
                    let nll = token_nll(&out.logits, &ids);
                    let loss = match out.regulariser(&nll) {
                        Some(r) => nll.mean(Kind::Float) + r,
                        None => nll.mean(Kind::Float),
                    };
                    loss.backward();
                    let mu = out.full_usage().unwrap().double_value(&[]);
                    (out.logits.detach(), mu)
                };
                let ((la, mua), (lb, mub)) = (step(&reference), step(&kernel));
                assert!(
                    mua > 0.05 && mua < 0.95,
                    "{method:?} (ste_sample {ste_sample}): gates all alike ({mua})"
                );
                assert_eq!(
                    mua, mub,
                    "{method:?} (ste_sample {ste_sample}): gates differ between paths"
                );
                let e = rel(&lb, &la);
                assert!(
                    e < 1e-2,
                    "{method:?} (ste_sample {ste_sample}): logits differ by {e:.2e}"
                );
                for ((n, pa), (_, pb)) in reference.params().iter().zip(kernel.params().iter()) {
                    if pa.grad().defined() {
                        let e = rel(&pb.grad(), &pa.grad());
                        assert!(
                            e < 5e-2,
                            "{method:?} (ste_sample {ste_sample}): gradient of {n} differs by {e:.2e}"
                        );
                    }
                }
            }
        });
    }

    /// Decoding with a cache, a prefill chunk then single tokens then a chunk of two, gives
    /// the logits and gates of one forward over the whole sequence, for every method; the
    /// cache then holds what each layer kind needs and no more.
    #[test]
    fn cached_decoding_matches_the_whole_sequence_forward() {
        let cases: Vec<(&str, Config)> = vec![
            ("full", routed_cfg(Method::Full, |_| {})),
            ("swa", routed_cfg(Method::Swa, |_| {})),
            (
                "ppa",
                routed_cfg(Method::Ppa, |c| c.attention.ppa_power = 0.5),
            ),
            (
                "static_hybrid",
                routed_cfg(Method::StaticHybrid, |c| c.attention.hybrid_every = 2),
            ),
            ("aha", routed_cfg(Method::Aha, |_| {})),
            ("l2a", routed_cfg(Method::L2a, |c| c.attention.tau = 0.5)),
            (
                "l2a_pruned",
                routed_cfg(Method::L2a, |c| c.attention.pruned_layers = vec![1]),
            ),
            ("swiattn", routed_cfg(Method::Swiattn, |_| {})),
            (
                "aha_bernoulli",
                routed_cfg(Method::Aha, |c| {
                    c.attention.router = Router::Bernoulli;
                    c.attention.bernoulli_p = 0.4;
                }),
            ),
        ];
        let len = 9;
        for (name, cfg) in cases {
            let b = Built::new(&cfg, Device::Cpu).unwrap();
            randomise_routers(&b, 1.0);
            let ctx = ForwardCtx {
                gate_seed: 5,
                ..Default::default()
            };
            let (whole, pieces, cache) = tch::no_grad(|| {
                let whole = b.model.forward(&ids(), &ctx);
                let mut cache = b.model.new_cache();
                let mut pieces = Vec::new();
                for (at, n) in [(0, 4), (4, 1), (5, 1), (6, 2), (8, 1)] {
                    pieces.push(
                        b.model
                            .forward_cached(&ids().narrow(1, at, n), &mut cache, &ctx),
                    );
                }
                (whole, pieces, cache)
            });
            let logits = Tensor::cat(&pieces.iter().map(|p| &p.logits).collect::<Vec<_>>(), 1);
            assert!(
                max_diff(&whole.logits, &logits) < 1e-5,
                "{name}: cached logits"
            );
            if let Some(g) = &whole.layers[0].gates {
                let cached = Tensor::cat(
                    &pieces
                        .iter()
                        .map(|p| p.layers[0].gates.as_ref().unwrap())
                        .collect::<Vec<_>>(),
                    1,
                );
                assert!(g.equal(&cached), "{name}: cached gates");
                let pairs: f64 = pieces
                    .iter()
                    .map(|p| p.layers[0].pairs.double_value(&[]))
                    .sum();
                assert_eq!(
                    pairs,
                    whole.layers[0].pairs.double_value(&[]),
                    "{name}: pairs"
                );
            }
            assert_eq!(cache.len, len);
            // Two sequences in the batch; kv_cache_bytes is per sequence.
            let want: Vec<f64> = b
                .model
                .kv_cache_bytes(len as usize)
                .iter()
                .map(|x| 2.0 * x)
                .collect();
            let held: Vec<f64> = cache.layers.iter().map(|l| l.borrow().bytes()).collect();
            assert_eq!(held, want, "{name}: cache bytes per layer");
        }
    }
}
