//! Attention: which keys each query sees, how many (query, key) pairs that is, and the layer
//! that computes it.
//!
//! Every static pattern here (full, sliding window, PPA) depends only on the distance
//! `d = i - k` between query `i` and key `k`, so one predicate `KeyPattern::sees(d)` defines
//! each of them; the dense mask, the pair count and the per-layer assignment of
//! `static_hybrid` are all derived from it. Routed methods choose between two patterns per
//! token or per head; `AttnOutput` already carries the gate and regulariser slots they fill.

use crate::config::{AttentionConfig, Method, ModelConfig};
use crate::model::{Linear, Rope};
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
    }
}

/// What one attention layer hands back to the model.
pub struct AttnOutput {
    /// `[B, L, hidden]`, ready for the residual add.
    pub y: Tensor,
    /// Hard gates (1 = full path) per token `[B, L]` or per token and head `[B, L, H]`;
    /// None for static methods.
    pub gates: Option<Tensor>,
    /// The method's regulariser term for this layer (a scalar), None when it has none.
    pub reg: Option<Tensor>,
    /// (query, key) pairs actually attended, summed over batch and query heads.
    pub pairs: f64,
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

/// Llama self-attention with Hugging Face parameter names (`q_proj`, `k_proj`, `v_proj`,
/// `o_proj`) and a fixed key pattern.
pub struct SelfAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    n_heads: i64,
    n_kv_heads: i64,
    head_dim: i64,
    pub pattern: KeyPattern,
}

impl SelfAttention {
    pub fn new(p: nn::Path, m: &ModelConfig, pattern: KeyPattern) -> Self {
        let (h, kv, hd) = (
            m.num_attention_heads as i64,
            m.num_key_value_heads as i64,
            m.head_dim() as i64,
        );
        let d = m.hidden_size as i64;
        let std = m.initializer_range;
        SelfAttention {
            q_proj: Linear::new(&p / "q_proj", d, h * hd, m.attention_bias, std),
            k_proj: Linear::new(&p / "k_proj", d, kv * hd, m.attention_bias, std),
            v_proj: Linear::new(&p / "v_proj", d, kv * hd, m.attention_bias, std),
            o_proj: Linear::new(&p / "o_proj", h * hd, d, false, std),
            n_heads: h,
            n_kv_heads: kv,
            head_dim: hd,
            pattern,
        }
    }

    /// `x: [B, L, hidden]` (already normalised). `mask` is this layer's pattern mask when the
    /// caller has built it once for all layers that share it.
    pub fn forward(&self, x: &Tensor, rope: &Rope, mask: Option<&Tensor>) -> AttnOutput {
        let (b, l, _) = x.size3().expect("attention input is [B, L, hidden]");
        let heads = |t: Tensor, n: i64| t.view([b, l, n, self.head_dim]).transpose(1, 2);
        let q = rope.apply(&heads(self.q_proj.forward(x), self.n_heads));
        let k = rope.apply(&heads(self.k_proj.forward(x), self.n_kv_heads));
        let v = heads(self.v_proj.forward(x), self.n_kv_heads);
        let y = attend(&q, &k, &v, &self.pattern, mask);
        let y = y
            .transpose(1, 2)
            .reshape([b, l, self.n_heads * self.head_dim]);
        AttnOutput {
            y: self.o_proj.forward(&y),
            gates: None,
            reg: None,
            pairs: (b * self.n_heads) as f64 * self.pattern.attended_pairs(l as usize) as f64,
        }
    }
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
}
