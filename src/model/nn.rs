//! Layers every part of the model shares: linear maps, RMSNorm, rotary position embedding,
//! and the per-token loss. Parameters are fp32 (the optimizer's master copy); inputs come in
//! the compute dtype, and weights are cast on use, so autograd delivers fp32 gradients, as
//! autocast does in PyTorch. Where a kernel library is loaded, RMSNorm and the rotary
//! embedding run as its fused kernels.

use crate::config::ModelConfig;
use crate::model::kernels;
use crate::model::kernels::Kernels;
use std::cell::RefCell;
use std::collections::HashMap;
use tch::{nn, Kind, Tensor};

/// Weights cast (or joined and cast) once, by the data address of the (first) weight, the
/// dtype of the cast and how many weights were joined.
type CastWeights = HashMap<(usize, Kind, usize), Tensor>;

thread_local! {
    /// The weights cast so far inside `with_cast_weights` (None outside it).
    static CAST: RefCell<Option<CastWeights>> = const { RefCell::new(None) };
}

/// Runs `f` (which computes no gradient) with each weight cast to another dtype once, at its
/// first use, and the copy read at every later use: decoding would otherwise cast every weight
/// again at each step (4 bytes read and 2 written a parameter, and a launch each). The copies
/// are dropped when `f` returns, so a later optimizer step is never missed.
pub(crate) fn with_cast_weights<R>(f: impl FnOnce() -> R) -> R {
    let outer = CAST.with(|c| c.borrow().is_some());
    if !outer {
        CAST.with(|c| *c.borrow_mut() = Some(HashMap::new()));
    }
    // Dropped however `f` ends, a panic included.
    struct Clear(bool);
    impl Drop for Clear {
        fn drop(&mut self) {
            if self.0 {
                CAST.with(|c| *c.borrow_mut() = None);
            }
        }
    }
    let _clear = Clear(!outer);
    f()
}

/// The weight `w` in `kind`: inside `with_cast_weights`, the copy cast at its first use.
pub(crate) fn cast(w: &Tensor, kind: Kind) -> Tensor {
    if w.kind() == kind {
        return w.shallow_clone();
    }
    CAST.with(|c| match c.borrow_mut().as_mut() {
        Some(all) => all
            .entry((w.data_ptr() as usize, kind, 1))
            .or_insert_with(|| w.to_kind(kind))
            .shallow_clone(),
        None => w.to_kind(kind),
    })
}

/// The weight `w`'s copy in `kind` where `with_cast_weights` is in force (cast now if this is
/// its first use), else None.
pub(crate) fn cast_copy(w: &Tensor, kind: Kind) -> Option<Tensor> {
    decoding().then(|| cast(w, kind))
}

/// Whether `with_cast_weights` is in force: decoding, where nothing needs a gradient.
pub(crate) fn decoding() -> bool {
    CAST.with(|c| c.borrow().is_some())
}

/// Inside `with_cast_weights`, the weights (and biases, where every map has one) of `maps`,
/// which share their input, joined along the outputs and cast to `kind` once: one product for
/// several maps (a decoding step's q, k and v). None outside it, where joining them at every
/// call would cost more than the launches it saves.
pub(crate) fn joined(maps: &[&Linear], kind: Kind) -> Option<(Tensor, Option<Tensor>)> {
    if !decoding() {
        return None;
    }
    let join = |ts: Vec<&Tensor>| -> Tensor {
        CAST.with(|c| {
            c.borrow_mut()
                .as_mut()
                .expect("inside with_cast_weights")
                .entry((ts[0].data_ptr() as usize, kind, ts.len()))
                .or_insert_with(|| Tensor::cat(&ts, 0).to_kind(kind))
                .shallow_clone()
        })
    };
    let weight = join(maps.iter().map(|m| &m.weight).collect());
    let biases: Option<Vec<&Tensor>> = maps.iter().map(|m| m.bias.as_ref()).collect();
    Some((weight, biases.map(join)))
}

pub(crate) struct Linear {
    pub(crate) weight: Tensor,
    pub(crate) bias: Option<Tensor>,
}

impl Linear {
    pub(crate) fn new(p: nn::Path, in_dim: i64, out_dim: i64, bias: bool, std: f64) -> Self {
        let weight = p.var(
            "weight",
            &[out_dim, in_dim],
            nn::Init::Randn {
                mean: 0.0,
                stdev: std,
            },
        );
        let bias = bias.then(|| p.var("bias", &[out_dim], nn::Init::Const(0.0)));
        Linear { weight, bias }
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Tensor {
        let k = x.kind();
        x.linear(
            &cast(&self.weight, k),
            self.bias.as_ref().map(|b| cast(b, k)),
        )
    }
}

/// `x` in at least fp32 (fp64 stays fp64), for reductions and thresholds that must not
/// depend on the compute dtype.
pub(crate) fn upcast(x: &Tensor) -> Tensor {
    match x.kind() {
        Kind::Double | Kind::Float => x.shallow_clone(),
        _ => x.to_kind(Kind::Float),
    }
}

pub(crate) struct RmsNorm {
    weight: Tensor,
    eps: f64,
    /// The fused kernel (`kernels/norm.cu`) computes it where a library is loaded.
    kernels: Option<&'static Kernels>,
}

impl RmsNorm {
    pub(crate) fn new(p: nn::Path, dim: i64, eps: f64) -> Self {
        RmsNorm {
            weight: p.var("weight", &[dim], nn::Init::Const(1.0)),
            eps,
            kernels: None,
        }
    }

    pub(crate) fn with_kernels(self, kernels: Option<&'static Kernels>) -> Self {
        RmsNorm { kernels, ..self }
    }

    /// The kernel library that normalises `x`, where one is loaded for its device and the
    /// weight is fp32 as the kernels take it.
    fn kernel(&self, x: &Tensor) -> Option<&'static Kernels> {
        kernels::kernel_for(self.kernels, x).filter(|_| self.weight.kind() == Kind::Float)
    }

    /// `(h, norm(h))` for the residual stream `h = x + r`: one kernel forward (and backward)
    /// where a kernel library is loaded, else the add and `forward`.
    pub(crate) fn add_forward(&self, x: &Tensor, r: &Tensor) -> (Tensor, Tensor) {
        if let Some(k) = self.kernel(x) {
            return k
                .add_rms_norm(x, r, &self.weight, self.eps)
                .expect("residual add and RMSNorm kernel on the model's own activations");
        }
        let h = x + r;
        let y = self.forward(&h);
        (h, y)
    }

    /// Normalises in at least fp32 whatever the compute dtype (as Hugging Face's
    /// LlamaRMSNorm does).
    pub(crate) fn forward(&self, x: &Tensor) -> Tensor {
        if let Some(k) = self.kernel(x) {
            return k
                .rms_norm(x, &self.weight, self.eps)
                .expect("RMSNorm kernel on the model's own activations");
        }
        let xf = upcast(x);
        let k = xf.kind();
        let rms = (xf.square().mean_dim(-1, true, k) + self.eps).rsqrt();
        (self.weight.to_kind(k) * (xf * rms)).to_kind(x.kind())
    }
}

/// Rotary position embedding in Hugging Face's "rotate half" layout: dimension c is paired
/// with c + head_dim/2.
pub(crate) struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    /// Angles position * inv_freq for positions 0 .. len.
    pub(crate) fn new(len: i64, inv_freq: &[f64], kind: Kind, device: tch::Device) -> Self {
        let opts = (Kind::Float, device);
        let inv_freq = Tensor::from_slice(inv_freq)
            .to_kind(Kind::Float)
            .to_device(device);
        let freqs = Tensor::arange(len, opts).outer(&inv_freq);
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        Rope {
            cos: emb.cos().to_kind(kind),
            sin: emb.sin().to_kind(kind),
        }
    }

    /// The angles of positions `start .. start + len`.
    #[cfg(test)]
    pub(crate) fn slice(&self, start: i64, len: i64) -> Rope {
        Rope {
            cos: self.cos.narrow(0, start, len),
            sin: self.sin.narrow(0, start, len),
        }
    }

    /// The angles of the positions in `pos` (int64 `[n]`, on the device): what a decoding
    /// step reads, with no position from the host.
    pub(crate) fn at(&self, pos: &Tensor) -> Rope {
        Rope {
            cos: self.cos.index_select(0, pos),
            sin: self.sin.index_select(0, pos),
        }
    }

    /// The angles' `(cos, sin)`, `[positions, D]`.
    pub(crate) fn angles(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    /// `x: [B, L, H, D]` rotated and transposed to `[B, H, L, D]`, by the fused kernel where
    /// a library is given.
    pub(crate) fn apply_transposed(&self, x: &Tensor, kernels: Option<&Kernels>) -> Tensor {
        match kernels::kernel_for(kernels, x) {
            Some(k) => k
                .rope(x, &self.cos, &self.sin)
                .expect("rope kernel on the model's own projections"),
            None => self.apply(&x.transpose(1, 2)),
        }
    }

    /// `x: [B, H, L, D]`.
    pub(crate) fn apply(&self, x: &Tensor) -> Tensor {
        let half = x.size()[3] / 2;
        let rotated = Tensor::cat(&[-x.narrow(3, half, half), x.narrow(3, 0, half)], 3);
        x * &self.cos + rotated * &self.sin
    }
}

/// Rotary frequencies theta^(-2i/d), with Hugging Face's rope_scaling applied (linear:
/// divided by the factor; llama3: long wavelengths divided by the factor, short ones kept,
/// a smooth blend between).
pub(crate) fn inv_freq(m: &ModelConfig) -> Vec<f64> {
    let d = m.head_dim();
    let base: Vec<f64> = (0..d / 2)
        .map(|i| 1.0 / m.rope_theta.powf((2 * i) as f64 / d as f64))
        .collect();
    let Some(s) = &m.rope_scaling else {
        return base;
    };
    match s.rope_type.as_str() {
        "linear" => base.iter().map(|f| f / s.factor).collect(),
        _ => {
            // llama3 (validated by the config).
            let (lo, hi) = (
                s.low_freq_factor.unwrap_or(1.0),
                s.high_freq_factor.unwrap_or(4.0),
            );
            let orig = s.original_max_position_embeddings.unwrap_or(8192.0);
            let (low_wavelen, high_wavelen) = (orig / lo, orig / hi);
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / s.factor
                    } else {
                        let smooth = (orig / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * f / s.factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// Per-position next-token negative log-likelihood, `[B, L]`, in fp32 (fp64 for fp64 logits).
pub(crate) fn token_nll(logits: &Tensor, targets: &Tensor) -> Tensor {
    let logits = upcast(logits);
    let logp = logits.log_softmax(-1, logits.kind());
    -logp
        .gather(-1, &targets.unsqueeze(-1), false)
        .squeeze_dim(-1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn llama3_rope_scaling_keeps_short_and_stretches_long_wavelengths() {
        use crate::config::RopeScaling;
        let base = ModelConfig {
            hidden_size: 64,
            num_attention_heads: 1,
            rope_theta: 10_000.0,
            ..Default::default()
        };
        let scaled = ModelConfig {
            rope_scaling: Some(RopeScaling {
                rope_type: "llama3".into(),
                factor: 8.0,
                low_freq_factor: Some(1.0),
                high_freq_factor: Some(4.0),
                original_max_position_embeddings: Some(64.0),
            }),
            ..base.clone()
        };
        let (a, b) = (inv_freq(&base), inv_freq(&scaled));
        for (x, y) in a.iter().zip(&b) {
            let wavelen = 2.0 * std::f64::consts::PI / x;
            if wavelen < 16.0 {
                assert_eq!(x, y);
            } else if wavelen > 64.0 {
                assert!((x / 8.0 - y).abs() < 1e-15);
            } else {
                assert!(*y < *x && *y > x / 8.0);
            }
        }
        let linear = ModelConfig {
            rope_scaling: Some(RopeScaling {
                rope_type: "linear".into(),
                factor: 2.0,
                low_freq_factor: None,
                high_freq_factor: None,
                original_max_position_embeddings: None,
            }),
            ..base
        };
        assert!(inv_freq(&linear)
            .iter()
            .zip(&a)
            .all(|(y, x)| (x / 2.0 - y).abs() < 1e-15));
    }

    #[test]
    fn rope_rotates_pairs_by_position_times_frequency() {
        let cfg = ModelConfig {
            hidden_size: 4,
            num_attention_heads: 1,
            rope_theta: 100.0,
            ..Default::default()
        };
        let rope = Rope::new(5, &inv_freq(&cfg), Kind::Double, Device::Cpu);
        let x = Tensor::from_slice(&[1.0f64, 2.0, 3.0, 4.0])
            .view([1, 1, 1, 4])
            .expand([1, 1, 5, 4], false);
        let y = rope.apply(&x);
        for pos in 0..5 {
            // Pairs (0, 2) and (1, 3); frequencies 1 and 100^(-1/2).
            for (c, f) in [(0usize, 1.0f64), (1, 0.1)] {
                let (a, b) = ([1.0, 2.0][c], [3.0, 4.0][c]);
                let ang = pos as f64 * f;
                let want = (a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos());
                let got = (
                    y.double_value(&[0, 0, pos, c as i64]),
                    y.double_value(&[0, 0, pos, c as i64 + 2]),
                );
                assert!(
                    (got.0 - want.0).abs() < 1e-6 && (got.1 - want.1).abs() < 1e-6,
                    "{pos} {c}"
                );
            }
        }
    }

    #[test]
    fn rmsnorm_and_nll_match_hand_computation() {
        let vs = nn::VarStore::new(Device::Cpu);
        let n = RmsNorm::new(vs.root() / "n", 2, 0.0);
        let y = n.forward(&Tensor::from_slice(&[3.0f32, 4.0]).view([1, 2]));
        let r = (12.5f64).sqrt();
        assert!(
            (y.double_value(&[0, 0]) - 3.0 / r).abs() < 1e-6
                && (y.double_value(&[0, 1]) - 4.0 / r).abs() < 1e-6
        );
        let logits = Tensor::from_slice(&[0.0f32, 1.0, 2.0]).view([1, 1, 3]);
        let nll = token_nll(&logits, &Tensor::from_slice(&[2i64]).view([1, 1]));
        let want = -(2.0f64.exp() / (1.0 + 1f64.exp() + 2f64.exp())).ln();
        assert!((nll.double_value(&[0, 0]) - want).abs() < 1e-6);
    }
}
