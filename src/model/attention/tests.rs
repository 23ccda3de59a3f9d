//! Tests of every method's attention against independent computations.

use super::gates::hash_uniform;
use super::methods::{hybrid_pattern, SwiAttnReg};
use super::patterns::is_power_offset;
use super::*;
use crate::config::{
    AttentionConfig, AttnImpl, Method, ModelConfig, NormPlacement, QkNorm, Reduction, Router,
};
use crate::model::nn::Rope;
use crate::util::rng::Rng;
use tch::{nn, Device, Kind, Tensor};

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
        KeyPattern::Sinks {
            sinks: 3,
            window: 6,
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
                        KeyPattern::Sinks { sinks, window } => i - k < window || k < sinks,
                        KeyPattern::Full => true,
                    };
                assert_eq!(v[i * len + k], want, "{pattern:?} i={i} k={k}");
                if k <= i {
                    assert_eq!(pattern.sees(i, k), want, "{pattern:?} sees i={i} k={k}");
                }
            }
        }
        // Over a cache's positions (its first keys, then a suffix, as `Keep::Ends` keeps
        // them), the queries of a chunk see what the whole sequence's mask says.
        let keys: Vec<i64> = (0..3).chain(250..300).collect();
        let kpos = Tensor::from_slice(&keys);
        let qpos = Tensor::arange_start(280, 300, (Kind::Int64, Device::Cpu));
        let want = m.index_select(0, &qpos).index_select(1, &kpos);
        assert!(
            pattern.seen(&qpos, &kpos, len).equal(&want),
            "{pattern:?} over cached positions"
        );
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
        // Sinks: each query i its window's min(i + 1, w) keys and the sinks beyond it.
        for (sinks, w) in [(4usize, 16usize), (1, 1), (70, 32)] {
            let want: u64 = (0..len)
                .map(|i| (i + 1).min(w) + sinks.min((i + 1).saturating_sub(w)))
                .sum::<usize>() as u64;
            assert_eq!(
                KeyPattern::Sinks { sinks, window: w }.attended_pairs(len),
                want,
                "sinks={sinks} w={w} L={len}"
            );
        }
        for p in [
            KeyPattern::Full,
            KeyPattern::Window(5),
            KeyPattern::Ppa {
                power: 0.75,
                window: 3,
            },
            KeyPattern::Sinks {
                sinks: 2,
                window: 4,
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
        .filter(|&l| hybrid_pattern(&cfg, l) == KeyPattern::Full)
        .collect();
    // 0-based 3, 7, ... = the paper's 1-based 4, 8, 12, 16, 20.
    assert_eq!(full, vec![3, 7, 11, 15, 19]);
    assert!((0..22)
        .filter(|l| !full.contains(l))
        .all(|l| hybrid_pattern(&cfg, l) == KeyPattern::Window(32)));
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
use crate::model::kernels::tests;
use crate::model::nn::inv_freq;
use crate::model::nn::token_nll;
use crate::model::ForwardOutput;
use crate::model::Llama;
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
    Tensor::from_slice(&[1i64, 5, 3, 7, 2, 9, 4, 4, 11, 0, 6, 8, 12, 3, 5, 1, 2, 7]).view([2, 9])
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

/// The window alone on `x`: layer 0's attention output of `routed`'s SWA twin (the same
/// weights), as the reference a routed method's window path is checked against.
fn window_output(routed: &Built, cfg: &Config, x: &Tensor, rope: &Rope, keys: &Keys) -> Vec<f64> {
    let swa = static_twin(routed, cfg, Method::Swa);
    vec64(
        &swa.model.layers[0]
            .self_attn
            .forward(x, None, rope, keys, &ForwardCtx::default())
            .y,
    )
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
    // Its norm starts as the block's input norm (here after the base's gain changed).
    tch::no_grad(|| {
        let g = &p["model.layers.1.input_layernorm.weight"];
        g.shallow_clone().copy_(&g.rand_like());
    });
    b.copy_derived(|_| true);
    assert!(p["model.layers.1.self_attn.global_attn.norm.weight"]
        .equal(&p["model.layers.1.input_layernorm.weight"]));
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

/// A layer's regulariser term, its language-model losses zero (5 tokens).
fn reg_term(out: AttnOutput) -> f64 {
    out.reg
        .expect("a penalised layer")
        .term(&Tensor::zeros([1, 5], (Kind::Float, Device::Cpu)))
        .double_value(&[])
}

/// `RMSNorm(v) * gain` in f64.
fn rms_norm64(v: &[f64], gain: &[f64], eps: f64) -> Vec<f64> {
    let rms = (v.iter().map(|a| a * a).sum::<f64>() / v.len() as f64 + eps).sqrt();
    v.iter().zip(gain).map(|(a, g)| a / rms * g).collect()
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
        &inv_freq(&routed_cfg(Method::Full, |_| {}).model),
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
    let out = layer.forward(&x, None, &rope, &masks, &ForwardCtx::default());
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
    let got = reg_term(out);
    assert!((got - want).abs() < 1e-6, "AHA reg {got} vs {want}");

    // L2A: lambda * mean over tokens of d_hat^2, d_hat = sigmoid(W u), u = RMSNorm_g(x + s)
    // with s the window output (x is the stream here: no residual handed over).
    let cfg = routed_cfg(Method::L2a, |c| c.attention.lambda = 0.5);
    let b = Built::new(&cfg, Device::Cpu).unwrap();
    randomise_routers(&b, 0.5);
    tch::no_grad(|| {
        let gain = &b.params()["model.layers.0.self_attn.global_attn.norm.weight"];
        gain.shallow_clone().copy_(&(gain.rand_like() + 0.5));
    });
    let out = b.model.layers[0]
        .self_attn
        .forward(&x, None, &rope, &masks, &ForwardCtx::default());
    let s = window_output(&b, &cfg, &x, &rope, &masks);
    let w = vec64(&b.params()["model.layers.0.self_attn.router.weight"]);
    let gain = vec64(&b.params()["model.layers.0.self_attn.global_attn.norm.weight"]);
    let xs = vec64(&x);
    let eps = cfg.model.rms_norm_eps;
    let want: f64 = (0..5)
        .map(|t| {
            let h: Vec<f64> = (0..16).map(|c| xs[t * 16 + c] + s[t * 16 + c]).collect();
            sigmoid_dot(&rms_norm64(&h, &gain, eps), &w, 0.0).powi(2)
        })
        .sum::<f64>()
        * 0.5
        / 5.0;
    let got = reg_term(out);
    assert!((got - want).abs() < 1e-6, "L2A reg {got} vs {want}");
    // The router reads the stream the block hands over, not the layer's normalised input.
    let other = reg_term(b.model.layers[0].self_attn.forward(
        &x,
        Some(&(&x * 3.0 + 1.0)),
        &rope,
        &masks,
        &ForwardCtx::default(),
    ));
    assert!(
        (other - want).abs() > 1e-4,
        "the residual is read: {other} vs {want}"
    );
    // Under train.lambda_ramp the step's share scales the penalty and nothing else.
    let ramped = ForwardCtx {
        penalty_scale: Some(0.25),
        ..ForwardCtx::default()
    };
    let out = b.model.layers[0]
        .self_attn
        .forward(&x, None, &rope, &masks, &ramped);
    let got = reg_term(out);
    assert!(
        (got - 0.25 * want).abs() < 1e-6,
        "ramped L2A reg {got} vs {}",
        0.25 * want
    );
}

/// In a model, a block hands L2A the stream itself beside its normalised input: the router
/// scores `sigmoid(W RMSNorm_g(h + s))` with `h` the block's input, not its input norm's
/// output (the two differ here by the norm's gain of 3).
#[test]
fn a_block_hands_l2a_its_stream() {
    let cfg = routed_cfg(Method::L2a, |_| {});
    let b = Built::new(&cfg, Device::Cpu).unwrap();
    randomise_routers(&b, 0.5);
    tch::no_grad(|| {
        let g = &b.params()["model.layers.0.input_layernorm.weight"];
        let _ = g.shallow_clone().fill_(3.0);
    });
    let h = Tensor::randn([1, 5, 16], (Kind::Float, Device::Cpu));
    let seq = b.model.sequence(5, Device::Cpu);
    let keys = Keys::Chunk(&seq.masks);
    let (_, attn) = b
        .model
        .block(0, &h, &seq.rope, &keys, &ForwardCtx::default());
    let got = vec64(attn.scores.as_ref().unwrap());
    // By hand: x = RMSNorm(h) * 3, s the window attention of x, u = RMSNorm_g(h + s).
    let eps = cfg.model.rms_norm_eps;
    let hs = vec64(&h);
    let x: Vec<f64> = (0..5)
        .flat_map(|t| rms_norm64(&hs[t * 16..t * 16 + 16], &[3.0; 16], eps))
        .collect();
    let x = Tensor::from_slice(&x).view([1, 5, 16]).to_kind(Kind::Float);
    let s = window_output(&b, &cfg, &x, &seq.rope, &keys);
    let w = vec64(&b.params()["model.layers.0.self_attn.router.weight"]);
    for t in 0..5 {
        let stream: Vec<f64> = (0..16).map(|c| hs[t * 16 + c] + s[t * 16 + c]).collect();
        let want = sigmoid_dot(&rms_norm64(&stream, &[1.0; 16], eps), &w, 0.0);
        assert!(
            (got[t] - want).abs() < 1e-5,
            "token {t}: {} vs {want}",
            got[t]
        );
    }
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
        let want: f64 = (0..3).map(|i| gamma(i) * softplus(logits[i])).sum::<f64>() / 3.0;
        let got = params
            .term(&t(&logits), &t(&dis), &t(&nll))
            .double_value(&[]);
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

/// The layer's regulariser reads `scale` times the mean over the hidden dimension of the
/// branches' squared difference: at initialisation every router logit is the bias (1), so with
/// a zero NLL the term is `mean_t gamma_base * softplus(1) / (eps + alpha * D_t)`.
fn layer_disagreement_is_the_branches_difference(cfg: &Config, scale: f64) {
    let b = Built::new(cfg, Device::Cpu).unwrap();
    let x = Tensor::randn([1, 6, 16], (Kind::Float, Device::Cpu));
    let rope = Rope::new(
        6,
        &inv_freq(&routed_cfg(Method::Full, |_| {}).model),
        Kind::Float,
        Device::Cpu,
    );
    let masks = MaskCache::new(6, Device::Cpu);
    let masks = Keys::Chunk(&masks);
    let out = b.model.layers[0]
        .self_attn
        .forward(&x, None, &rope, &masks, &ForwardCtx::default());
    let Some(reg) = out.reg else {
        panic!("SwiAttn has a regulariser")
    };
    let got = reg
        .term(&Tensor::zeros([1, 6], (Kind::Float, Device::Cpu)))
        .double_value(&[]);
    let y = |m: Method| {
        static_twin(&b, cfg, m).model.layers[0]
            .self_attn
            .forward(&x, None, &rope, &masks, &ForwardCtx::default())
            .y
    };
    let d = (y(Method::Full) - y(Method::Swa))
        .square()
        .mean_dim(-1, false, Kind::Float)
        * scale;
    let a = &cfg.attention;
    assert_eq!(a.router_init_bias, 1.0);
    let softplus_1 = (1.0f64.exp() + 1.0).ln();
    let want = ((d * a.swiattn_alpha + a.swiattn_eps).reciprocal()
        * (a.swiattn_gamma_base * softplus_1))
        .mean(Kind::Double)
        .double_value(&[]);
    assert!((got - want).abs() < 1e-6 * want, "{got} vs {want}");
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
            let m = Llama::new(&vs.root(), &cfg.model, &cfg.attention, Kind::Double).unwrap();
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
    // Each layer's gates per head, averaged over tokens, of a static model taking `top_k`.
    let heads_on = |top_k: usize| -> Vec<Vec<f64>> {
        let cfg = routed_cfg(Method::StaticHeads, |c| {
            c.attention.head_ranking = ranking.clone();
            c.attention.top_k = top_k;
        });
        let out = run(
            &Built::new(&cfg, Device::Cpu).unwrap(),
            &ForwardCtx::default(),
        );
        out.layers
            .iter()
            .map(|l| {
                let g = l.gates.as_ref().unwrap();
                vec64(&g.mean_dim([0i64, 1].as_slice(), false, Kind::Float))
            })
            .collect()
    };
    let two = heads_on(2);
    assert_eq!(two[0], vec![1.0, 0.0, 0.0, 0.0]);
    assert_eq!(two[1], vec![0.0, 0.0, 1.0, 0.0]);
    // top_k 0: the ranked model's budget, 0.9 + 0.5 + 0.1 = 1.5 heads, rounded to the same 2.
    assert_eq!(heads_on(0), two);
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
/// their scores as they are. L2A's router reads the global module's own norm of the stream
/// after the window, so it has no `router_norm`.
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
        let rope = Rope::new(6, &inv_freq(&cfg.model), Kind::Float, Device::Cpu);
        let masks = MaskCache::new(6, Device::Cpu);
        let scores = |x: &Tensor| {
            b.model.layers[0]
                .self_attn
                .forward(x, None, &rope, &Keys::Chunk(&masks), &ForwardCtx::default())
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
    let positions = Tensor::arange(g.size()[1], (Kind::Int64, Device::Cpu));
    assert_eq!(
        routed_pairs(&g, 2, &positions).double_value(&[]),
        want as f64
    );
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

/// Every registered method at each of its examples (`MethodSpec::examples`) on the tests'
/// tiny model, `edit` applied first: (example's name, config). A new method is in every test
/// that takes its cases from here as soon as it is registered.
fn every_example(edit: impl Fn(&mut Config)) -> Vec<(&'static str, Config)> {
    all_methods()
        .flat_map(|s| s.examples.iter())
        .map(|e| {
            let c = routed_cfg(Method::Full, |c| {
                edit(c);
                (e.set)(&mut c.attention);
            });
            (e.name, c)
        })
        .collect()
}

/// `every_example` on the reference path and on the kernel library (its CPU build here), each
/// named with its path.
fn every_example_on_both_paths() -> Vec<(String, Config)> {
    [AttnImpl::Reference, AttnImpl::Cuda]
        .into_iter()
        .flat_map(|imp| {
            every_example(move |c| c.attention.attn_impl = imp)
                .into_iter()
                .map(move |(name, c)| (format!("{name} on {imp:?}"), c))
        })
        .collect()
}

/// The kernel wiring (band attention for windows, routed lists for routed paths) computes
/// what the reference path computes, in training (gradients through the kernels; AHA as
/// one routed launch plus the other path without gradient) and in evaluation (each query
/// on its own path), for every method's examples.
/// On the CPU the library runs its ATen reference, so this checks the wiring; the CUDA
/// kernels themselves are checked in `src/model/kernels/tests.rs`.
#[test]
fn kernel_path_matches_reference_path_for_every_method() {
    let mut cases = every_example(|_| {});
    // The q/k norms on the library too: OLMo-2's over the projection, Qwen3's per head (in
    // L2A's global module as well).
    cases.push((
        "full_olmo2_norms",
        routed_cfg(Method::Full, |c| {
            c.model.qk_norm = QkNorm::Full;
            c.model.norm_placement = NormPlacement::Post;
        }),
    ));
    cases.push((
        "l2a_qwen3_norms",
        routed_cfg(Method::L2a, |c| c.model.qk_norm = QkNorm::PerHead),
    ));
    for (name, cfg) in cases {
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
            "{name}: train-mode logits"
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
            assert!(max_diff(ga, gb) < 1e-5, "{name}: gradient of {n}");
        }
        let (a, b) = tch::no_grad(|| (run(&reference, &ctx), run(&kernel, &ctx)));
        assert!(
            max_diff(&a.logits, &b.logits) < 1e-5,
            "{name}: eval-mode logits"
        );
        assert_eq!(a.attended_pairs(), b.attended_pairs(), "{name}: pairs");
    }
}

#[test]
fn hash_uniform_is_uniform_and_independent_of_chunking() {
    let whole = hash_uniform(
        42,
        3,
        [2, 500, 8],
        &Tensor::arange(500, (Kind::Int64, Device::Cpu)),
    );
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
    let piece = hash_uniform(
        42,
        3,
        [2, 7, 8],
        &Tensor::arange_start(100, 107, (Kind::Int64, Device::Cpu)),
    );
    assert!(piece.equal(&whole.narrow(1, 100, 7)));
    assert!(!hash_uniform(
        43,
        3,
        [2, 7, 8],
        &Tensor::arange_start(100, 107, (Kind::Int64, Device::Cpu))
    )
    .equal(&piece));
    assert!(!hash_uniform(
        42,
        4,
        [2, 7, 8],
        &Tensor::arange_start(100, 107, (Kind::Int64, Device::Cpu))
    )
    .equal(&piece));
}

/// A pass's rows drawn with the seed of its first row (`seed_at_row`) are the step's rows
/// from that one: a pass joining micro-batches, or any one of them apart, draws the same gates
/// for the same sequence, at every layer (whose salt the seed sets differently).
#[test]
fn a_row_offset_folded_into_the_seed_draws_the_steps_rows() {
    use super::gates::seed_at_row;
    let positions = Tensor::arange(9, (Kind::Int64, Device::Cpu));
    for (seed, layer) in [(42u64, 0usize), (0xDEAD_BEEF_1234_5678, 7), (u64::MAX, 29)] {
        let step = hash_uniform(seed, layer, [12, 9, 3], &positions);
        for r0 in [0i64, 1, 4, 11] {
            let rows = 12 - r0;
            let pass = hash_uniform(
                seed_at_row(seed, layer, r0),
                layer,
                [rows, 9, 3],
                &positions,
            );
            assert!(
                pass.equal(&step.narrow(0, r0, rows)),
                "seed {seed}, layer {layer}, row {r0}"
            );
        }
        // Offsets add up, so a far row (a rank's share of a large step) draws what counting
        // from the step's first row would: 2^20 rows on, then 4 more, is 2^20 + 4 on.
        let far = 1i64 << 20;
        let draw = |seed| hash_uniform(seed, layer, [3, 9, 3], &positions);
        let stepped = seed_at_row(seed_at_row(seed, layer, far), layer, 4);
        assert!(draw(stepped).equal(&draw(seed_at_row(seed, layer, far + 4))));
        assert!(!draw(seed_at_row(seed, layer, far)).equal(&draw(seed)));
    }
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
    let rel = |a: &Tensor| (a - &exact).norm().double_value(&[]) / exact.norm().double_value(&[]);
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

/// On the GPU, training through the CUDA kernels (band and PPA lists, routed lists; the
/// other path, where the router's gradient reads it, without gradient) gives the reference
/// path's logits and gradients within bf16 noise, for every method's examples (AHA with the
/// exact and the sampled straight-through gradient among them). One layer, so both paths'
/// routers see the same inputs and no gate flips between them.
#[test]
#[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
fn cuda_training_matches_reference_for_every_method() {
    use crate::config::Dtype;
    tests::on_cuda("cuda_training_matches_reference_for_every_method", |_| {
        let dev = Device::Cuda(0);
        let rel = |a: &Tensor, b: &Tensor| {
            let b = b.to_kind(Kind::Double);
            (a.to_kind(Kind::Double) - &b).norm().double_value(&[])
                / b.norm().double_value(&[]).max(1e-6)
        };
        for (name, mut cfg) in every_example(|c| {
            c.model.hidden_size = 128;
            c.model.intermediate_size = 256;
            c.model.num_hidden_layers = 1;
            c.model.num_attention_heads = 2;
            c.model.num_key_value_heads = 2;
            c.model.attention_bias = false;
            c.attention.window = 37;
            c.train.dtype = Dtype::Bf16;
            c.train.device = "cuda".into();
        }) {
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
                let mu = out.full_usage().map(|u| u.double_value(&[]));
                (out.logits.detach(), mu)
            };
            let ((la, mua), (lb, mub)) = (step(&reference), step(&kernel));
            assert_eq!(mua, mub, "{name}: gates differ between paths");
            // A learned router's gates split the tokens, so both paths run.
            if spec(cfg.attention.method).gates != Gates::None
                && cfg.attention.router == Router::Learned
                && cfg.attention.method != Method::StaticHeads
            {
                let mu = mua.expect("a routed method reports its usage");
                assert!(mu > 0.05 && mu < 0.95, "{name}: gates all alike ({mu})");
            }
            let e = rel(&lb, &la);
            assert!(e < 1e-2, "{name}: logits differ by {e:.2e}");
            for ((n, pa), (_, pb)) in reference.params().iter().zip(kernel.params().iter()) {
                if pa.grad().defined() {
                    let e = rel(&pb.grad(), &pa.grad());
                    assert!(e < 5e-2, "{name}: gradient of {n} differs by {e:.2e}");
                }
            }
        }
    });
}

/// Decoding with a cache, a prefill chunk then single tokens then a chunk of two, gives
/// the logits and gates of one forward over the whole sequence, for every method's examples,
/// on the reference path and on the kernel library (its CPU build here: the prefill into the
/// empty cache runs the kernels, as the forward does); the cache then holds what each layer
/// states it keeps and no more.
#[test]
fn cached_decoding_matches_the_whole_sequence_forward() {
    let cases = every_example_on_both_paths();
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
            let mut cache = b.model.new_cache(len, Device::Cpu);
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
        assert_eq!(cache.state.len, len);
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

/// Greedy decoding over the cache (every step's token, pairs and gates recorded on the
/// device) gives what forwards over the whole growing sequence give: the argmax token at each
/// step, the pairs of its last query, its gates; for every method's examples, on the
/// reference path and the kernel library's CPU build. The cache's window rings wrap (window
/// 3, 14 positions).
#[test]
fn greedy_decoding_matches_forwards_over_the_growing_sequence() {
    use crate::run::generate::greedy;
    let cases = every_example_on_both_paths();
    let new = 5;
    for (name, cfg) in cases {
        let b = Built::new(&cfg, Device::Cpu).unwrap();
        randomise_routers(&b, 1.0);
        let ctx = ForwardCtx {
            gate_seed: 5,
            ..Default::default()
        };
        let g = greedy(&b.model, &ids(), new, None, &ctx, true);
        let mut seq = ids();
        for step in 0..new {
            let out = tch::no_grad(|| b.model.forward(&seq, &ctx));
            let next = out.logits.select(1, -1).argmax(-1, false);
            let want: Vec<i64> = Vec::try_from(&next).unwrap();
            for (row, t) in want.iter().enumerate() {
                assert_eq!(
                    g.tokens[row][step] as i64, *t,
                    "{name}: token {step} of row {row}"
                );
            }
            if step > 0 {
                // Pairs of the forward's last query: the whole forward's less the one before.
                let before = tch::no_grad(|| {
                    b.model
                        .forward(&seq.narrow(1, 0, seq.size()[1] - 1), &ctx)
                        .attended_pairs()
                });
                let want = out.attended_pairs() - before;
                assert_eq!(
                    g.decode_pairs[step - 1],
                    want,
                    "{name}: pairs of step {step}"
                );
            }
            if let Some(gates) = &g.gates {
                let at = out
                    .layers
                    .iter()
                    .filter_map(|l| l.gates.as_ref())
                    .map(|t| t.select(1, -1).mean_dim(-1, false, Kind::Double))
                    .reduce(|a, b| a + b)
                    .unwrap()
                    / out.layers.len() as f64;
                for (row, v) in Vec::<f64>::try_from(at).unwrap().iter().enumerate() {
                    assert!((gates[row][step] - v).abs() < 1e-6, "{name}: gate {step}");
                }
            }
            seq = Tensor::cat(&[&seq, &next.unsqueeze(1)], 1);
        }
        assert_eq!(g.decode_pairs.len(), new - 1, "{name}");
    }
}

/// On the GPU, decoding with one step captured as a CUDA graph and replayed gives exactly what
/// the same model decodes step by step (tokens, pairs, gates), for every method's examples.
#[test]
#[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
fn graph_decoding_matches_step_by_step_decoding() {
    use crate::config::Dtype;
    use crate::run::generate::greedy;
    let name = "graph_decoding_matches_step_by_step_decoding";
    tests::on_cuda(name, |_| {
        let cases = every_example(|c| {
            c.model.hidden_size = 256;
            c.model.vocab_size = 64;
            c.attention.window = 5;
            c.train.device = "cuda".into();
            c.train.dtype = Dtype::Bf16;
            c.attention.attn_impl = AttnImpl::Cuda;
        });
        let device = Device::Cuda(0);
        for (name, cfg) in cases {
            let b = Built::new(&cfg, device).unwrap();
            randomise_routers(&b, 1.0);
            tch::manual_seed(3);
            let prompts = Tensor::randint(64, [3, 40], (Kind::Int64, device));
            let ctx = ForwardCtx::default();
            let run = |graphs| greedy(&b.model, &prompts, 24, None, &ctx, graphs);
            let (eager, graph) = (run(false), run(true));
            assert_eq!(eager.tokens, graph.tokens, "{name}: tokens");
            assert_eq!(eager.decode_pairs, graph.decode_pairs, "{name}: pairs");
            assert_eq!(eager.gates, graph.gates, "{name}: gates");
            assert_eq!(eager.cache_bytes, graph.cache_bytes, "{name}: cache bytes");
        }
    });
}

/// L2A's inert start: the global module's output projection at zero (the rest copied), so at
/// the start the model is its window alone, the SWA model of the same weights, to the bit,
/// with every gate open; the default start (a copy of the base's projection) is not.
#[test]
fn an_inert_l2a_starts_as_its_window() {
    use crate::config::L2aStart;
    let cfg = routed_cfg(Method::L2a, |c| c.attention.l2a_start = L2aStart::Inert);
    let inert = Built::new(&cfg, Device::Cpu).unwrap();
    let swa = static_twin(&inert, &cfg, Method::Swa);
    let ctx = ForwardCtx::default();
    let (l2a_out, swa_out) = (run(&inert, &ctx), run(&swa, &ctx));
    assert!(l2a_out.logits.equal(&swa_out.logits));
    assert_eq!(l2a_out.full_usage().unwrap().double_value(&[]), 1.0);
    let derived = inert.model.derived_params();
    assert!(derived
        .iter()
        .all(|(new, _)| !new.ends_with("o_proj.weight")));
    let copy_cfg = routed_cfg(Method::L2a, |_| {});
    let copy = Built::new(&copy_cfg, Device::Cpu).unwrap();
    let swa = static_twin(&copy, &copy_cfg, Method::Swa);
    assert!(max_diff(&run(&copy, &ctx).logits, &run(&swa, &ctx).logits) > 1e-3);
    assert!(copy
        .model
        .derived_params()
        .iter()
        .any(|(new, _)| new.ends_with("global_attn.o_proj.weight")));
}
