//! GPU tests compare every kernel with its reference (run with --ignored on a GPU machine);
//! their CPU twins run everywhere.

use super::build::{newest_build, LIB};
use super::*;
use crate::model::attention::{attend, KeyPattern};
use crate::model::nn;
use crate::model::nn::Rope;
use crate::util;
use crate::util::rng::Rng;
use std::process::Command;

/// Reference for one case: dense attention with the window mask, then the rows of the
/// query list (zeros for inactive rows), in fp32 from the same (rounded) inputs.
fn reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    list: Option<(&Tensor, &Tensor)>,
    window: i64,
) -> Tensor {
    let (b, h, lq, d) = q.size4().unwrap();
    let len = k.size()[2];
    let f = |t: &Tensor| t.to_kind(Kind::Float);
    match list {
        None => attend(
            &f(q),
            &f(k),
            &f(v),
            &KeyPattern::Window(window as usize),
            None,
        ),
        Some((qpos, nq)) => {
            // Scatter the compacted queries to their positions, attend densely, gather back.
            let idx = qpos
                .to_kind(Kind::Int64)
                .unsqueeze(-1)
                .expand([b, h, lq, d], false);
            let dense_q =
                Tensor::zeros([b, h, len, d], (Kind::Float, q.device())).scatter(2, &idx, &f(q));
            let full = attend(
                &dense_q,
                &f(k),
                &f(v),
                &KeyPattern::Window(window as usize),
                None,
            );
            let active = Tensor::arange(lq, (Kind::Int64, q.device()))
                .view([1, 1, lq])
                .lt_tensor(&nq.to_kind(Kind::Int64).unsqueeze(-1));
            full.gather(2, &idx, false) * active.unsqueeze(-1).to_kind(Kind::Float)
        }
    }
}

/// A random ascending query list per (b, h) with the given active counts.
fn random_list(b: i64, h: i64, len: i64, counts: &[i64], device: Device) -> (Tensor, Tensor) {
    let lq = *counts.iter().max().unwrap_or(&0).max(&1);
    let mut pos = Vec::new();
    let mut rng = Rng::new(len as u64 * 31 + counts.len() as u64);
    for bh in 0..(b * h) as usize {
        let n = counts[bh % counts.len()];
        let mut chosen: Vec<i64> = (0..len).collect();
        rng.shuffle(&mut chosen);
        let mut c: Vec<i32> = chosen[..n as usize].iter().map(|&x| x as i32).collect();
        c.sort();
        c.resize(lq as usize, 0);
        pos.extend(c);
    }
    let qpos = Tensor::from_slice(&pos).view([b, h, lq]).to_device(device);
    let nq: Vec<i32> = (0..(b * h) as usize)
        .map(|i| counts[i % counts.len()] as i32)
        .collect();
    (qpos, Tensor::from_slice(&nq).view([b, h]).to_device(device))
}

/// ||a - b|| / ||b||, with a floor on ||b|| for gradients that are zero in exact
/// arithmetic (a window of 1 makes dq vanish).
fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_kind(Kind::Double);
    let b = b.to_kind(Kind::Double);
    let den = b
        .norm()
        .double_value(&[])
        .max(1e-2 * (b.numel() as f64).sqrt());
    (a - &b).norm().double_value(&[]) / den
}

/// Output and q, k, v gradients of `op` against `reference` (in fp32 from the same rounded
/// inputs) on fresh random q `[B, H, Lq, D]` and k, v `[B, Hkv, L, D]`; fails naming `case`
/// past a relative error of `tol`.
fn check_against(
    q_shape: [i64; 4],
    kv_shape: [i64; 4],
    (kind, device): (Kind, Device),
    tol: f64,
    case: &str,
    op: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
    reference: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
) {
    let opts = (kind, device);
    let q = Tensor::randn(q_shape, opts).set_requires_grad(true);
    let k = Tensor::randn(kv_shape, opts).set_requires_grad(true);
    let v = Tensor::randn(kv_shape, opts).set_requires_grad(true);
    let dout = Tensor::randn(q_shape, opts);
    let out = op(&q, &k, &v);
    (&out * &dout).sum(Kind::Float).backward();
    let got = [out.detach(), q.grad(), k.grad(), v.grad()];
    let f = |t: &Tensor| t.detach().to_kind(Kind::Float).set_requires_grad(true);
    let (q2, k2, v2) = (f(&q), f(&k), f(&v));
    let want = reference(&q2, &k2, &v2);
    (&want * dout.to_kind(Kind::Float))
        .sum(Kind::Float)
        .backward();
    let want = [want.detach(), q2.grad(), k2.grad(), v2.grad()];
    for (name, (g, w)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
        let e = rel_err(g, w);
        assert!(e < tol, "{name}: relative error {e:.2e} ({case})");
    }
}

/// Output and q, k, v gradients of the kernel op against the reference, on fresh random
/// inputs: lengths that are not tile multiples, windows at the boundaries, GQA, empty and
/// full query lists.
fn compare_with_reference(kern: &Kernels, device: Device, kind: Kind, head_dims: &[i64], tol: f64) {
    for &d in head_dims {
        // Heads (query, key-value): GQA 2, then Qwen2.5-1.5B's ratio (12 / 2) and plain
        // multi-head attention on a few cases.
        for &(h, hkv, len, window, sparse) in &[
            (4i64, 2i64, 37i64, 1i64, false),
            (4, 2, 130, 7, false),
            (4, 2, 200, 64, false),
            (4, 2, 333, 333, false),
            (4, 2, 70, 500, false),
            (4, 2, 600, 700, false),
            (4, 2, 2048, 128, false),
            (4, 2, 2048, 1 << 20, true),
            (4, 2, 333, 1000, true),
            (4, 2, 200, 17, true),
            (12, 2, 300, 1 << 20, false),
            (12, 2, 300, 64, true),
            (3, 3, 300, 100, false),
        ] {
            let b = 2i64;
            tch::manual_seed(len * 7 + window + d);
            let counts: Vec<i64> = if sparse {
                vec![0, len / 3, len, 5, 1, len - 1, 2, len / 2]
            } else {
                vec![]
            };
            let list = sparse.then(|| random_list(b, h, len, &counts, device));
            let lq = list.as_ref().map_or(len, |(p, _)| p.size()[2]);
            let l = list.as_ref().map(|(p, n)| (p, n));
            check_against(
                [b, h, lq, d],
                [b, hkv, len, d],
                (kind, device),
                tol,
                &format!("D={d} H={h}/{hkv} L={len} w={window} sparse={sparse}"),
                |q, k, v| kern.list_attention(q, k, v, l, window).unwrap(),
                |q, k, v| reference(q, k, v, l, window),
            );
        }
    }
}

/// Routed attention against the dense fp32 window and full-prefix attentions, picked per
/// (b, h, position), the other queries all on their window, all on nothing, or a random
/// half on each: per-(b, h) shares of full-prefix queries from none to all, and a single
/// one.
fn compare_routed_with_reference(
    kern: &Kernels,
    device: Device,
    kind: Kind,
    head_dims: &[i64],
    tol: f64,
) {
    let (b, h, hkv) = (2i64, 4i64, 2i64);
    // Share of full-prefix queries per (b, h); -1: only the last query.
    let shares = [0.0, 1.0, 0.1, 0.5, -1.0, 0.95, 0.2, 0.02];
    for &d in head_dims {
        for &(len, window) in &[(37i64, 1i64), (130, 7), (333, 64), (600, 700), (2048, 256)] {
            if device == Device::Cpu && len > 600 {
                continue;
            }
            // The other queries: all on their window, none, or a random half.
            for on_window in [1.0, 0.0, 0.5] {
                let mut rng = Rng::new((len * 131 + window) as u64);
                let mut path = Vec::with_capacity((b * h * len) as usize);
                for bh in 0..(b * h) as usize {
                    let share = shares[bh % shares.len()];
                    path.extend((0..len).map(|i| {
                        let full = match share < 0.0 {
                            true => i == len - 1,
                            false => rng.uniform() < share,
                        };
                        match (full, rng.uniform() < on_window) {
                            (true, _) => QueryPath::Full as u8,
                            (false, true) => QueryPath::Window as u8,
                            (false, false) => QueryPath::Nothing as u8,
                        }
                    }));
                }
                let path = Tensor::from_slice(&path)
                    .view([b, h, len])
                    .to_device(device);
                let is = |p: QueryPath| path.eq(p as i64).unsqueeze(-1).to_kind(Kind::Float);
                tch::manual_seed(len * 3 + window + d);
                check_against(
                    [b, h, len, d],
                    [b, hkv, len, d],
                    (kind, device),
                    tol,
                    &format!("routed D={d} L={len} w={window} on_window={on_window}"),
                    |q, k, v| kern.routed_attention(q, k, v, &path, window).unwrap(),
                    |q, k, v| {
                        attend(q, k, v, &KeyPattern::Full, None) * is(QueryPath::Full)
                            + attend(q, k, v, &KeyPattern::Window(window as usize), None)
                                * is(QueryPath::Window)
                    },
                );
            }
        }
    }
}

/// The fused cross-entropy against log-softmax in fp32 from the same (rounded) logits:
/// values and logits' gradient, for a vocabulary that takes the vectorised path (V % 8
/// == 0) and one that does not, and a row whose target is its largest logit.
fn cross_entropy_matches_log_softmax(kern: &Kernels, device: Device, kind: Kind, tol: f64) {
    for vocab in [32000i64, 1001] {
        tch::manual_seed(vocab);
        let x = (Tensor::randn([3, 7, vocab], (Kind::Float, device)) * 4.0)
            .to_kind(kind)
            .set_requires_grad(true);
        let y = Tensor::randint(vocab, [3, 7], (Kind::Int64, device));
        let y = y.index_put(
            &[Some(Tensor::from(0)), Some(Tensor::from(0))],
            &x.get(0).get(0).argmax(-1, false),
            false,
        );
        let g = Tensor::rand([3, 7], (Kind::Float, device));
        let got = kern.token_nll(&x, &y).unwrap();
        assert_eq!(got.size(), [3, 7]);
        (&got * &g).sum(Kind::Float).backward();
        let xr = x.detach().to_kind(Kind::Float).set_requires_grad(true);
        let want = nn::token_nll(&xr, &y);
        (&want * &g).sum(Kind::Float).backward();
        let e = rel_err(&got.detach(), &want.detach());
        assert!(e < tol, "V={vocab}: loss differs by {e:.2e}");
        let e = rel_err(&x.grad().to_kind(Kind::Float), &xr.grad());
        assert!(e < tol * 10.0, "V={vocab}: gradient differs by {e:.2e}");
        assert_eq!(x.grad().kind(), kind);
    }
}

/// The fused RMSNorm against the model's ATen form in fp32 from the same (rounded)
/// inputs: output and both gradients, for a width that is a multiple of 32 and one that
/// is not, the hidden sizes of 1-8B models (a block a row on the GPU, up to 16 columns a
/// thread of 256, then of 1024), OLMo-2's norm over its queries (2048) and one wider than
/// any kernel takes (ATen on the GPU too).
fn rms_norm_matches_reference(kern: &Kernels, device: Device, kind: Kind, tol: f64) {
    for d in [
        512i64, 100, 1536, 2048, 3584, 4100, 8192, 12000, 32768, 40000,
    ] {
        tch::manual_seed(d);
        let x = Tensor::randn([3, 67, d], (Kind::Float, device))
            .to_kind(kind)
            .set_requires_grad(true);
        let w = (Tensor::rand([d], (Kind::Float, device)) + 0.5).set_requires_grad(true);
        let dy = Tensor::randn([3, 67, d], (Kind::Float, device));
        // At d = 100 the kernel gets the weight as a strided view (of the same values).
        let w_in = match d {
            100 => Tensor::stack(&[&w, &w], 1).select(1, 0),
            _ => w.shallow_clone(),
        };
        let got = kern.rms_norm(&x, &w_in, 1e-5).unwrap();
        assert_eq!(got.kind(), kind);
        (got.to_kind(Kind::Float) * &dy).sum(Kind::Float).backward();
        let (xr, wr) = (
            x.detach().to_kind(Kind::Float).set_requires_grad(true),
            w.detach().set_requires_grad(true),
        );
        let rms = (xr.square().mean_dim(-1, true, Kind::Float) + 1e-5).rsqrt();
        let want = &wr * (&xr * rms);
        (&want * &dy).sum(Kind::Float).backward();
        for (name, g, r) in [
            ("y", got.detach().to_kind(Kind::Float), want.detach()),
            ("dx", x.grad().to_kind(Kind::Float), xr.grad()),
            ("dw", w.grad(), wr.grad()),
        ] {
            let e = rel_err(&g, &r);
            assert!(e < tol, "d={d}: {name} differs by {e:.2e}");
        }
    }
}

/// The fused rotary embedding (with the head transpose) against `Rope::apply` in fp32
/// from the same (rounded) inputs, with fp32 angles, angles in x's dtype and bf16 angles
/// (fp32 for the kernel where x is fp32): output and gradient. Head size 6 takes the
/// element-by-element path (its halves are not whole 16-byte moves).
fn rope_matches_reference(kern: &Kernels, device: Device, kind: Kind, tol: f64) {
    for (d, angles) in [
        (64i64, Kind::Float),
        (128, Kind::Float),
        (64, Kind::BFloat16),
        (64, kind),
        (6, kind),
    ] {
        tch::manual_seed(d);
        let inv: Vec<f64> = (0..d / 2)
            .map(|i| 10000f64.powf(-2.0 * i as f64 / d as f64))
            .collect();
        let rope = Rope::new(300, &inv, angles, device).slice(37, 203);
        let x = Tensor::randn([2, 203, 3, d], (Kind::Float, device))
            .to_kind(kind)
            .set_requires_grad(true);
        let dy = Tensor::randn([2, 3, 203, d], (Kind::Float, device));
        let got = rope.apply_transposed(&x, Some(kern));
        assert_eq!(got.size(), [2, 3, 203, d]);
        (got.to_kind(Kind::Float) * &dy).sum(Kind::Float).backward();
        let xr = x.detach().to_kind(Kind::Float).set_requires_grad(true);
        let want = rope.apply_transposed(&xr, None);
        (&want * &dy).sum(Kind::Float).backward();
        let e = rel_err(&got.detach().to_kind(Kind::Float), &want.detach());
        assert!(
            e < tol,
            "D={d}, {angles:?} angles: output differs by {e:.2e}"
        );
        let e = rel_err(&x.grad().to_kind(Kind::Float), &xr.grad());
        assert!(
            e < tol,
            "D={d}, {angles:?} angles: gradient differs by {e:.2e}"
        );
    }
}

/// The head transposes without rotation move data only: equal to ATen's transposed copies
/// bit for bit, both ways and in the gradient, on the 16-byte path and element by element
/// (head size 6, and a view starting one element into its storage).
fn head_moves_are_transposes(kern: &Kernels, device: Device, kind: Kind) {
    let shape = [2i64, 37, 3, 64];
    let n: i64 = shape.iter().product();
    let misaligned = Tensor::randn([n + 1], (Kind::Float, device))
        .to_kind(kind)
        .narrow(0, 1, n)
        .view(shape);
    let inputs = [
        Tensor::randn(shape, (Kind::Float, device)).to_kind(kind),
        Tensor::randn([2, 37, 3, 6], (Kind::Float, device)).to_kind(kind),
        misaligned,
    ];
    for x in inputs {
        let x = x.set_requires_grad(true);
        let y = kern.to_heads(&x).unwrap();
        assert!(y.equal(&x.transpose(1, 2)), "to_heads {:?}", x.size());
        assert!(y.is_contiguous());
        let back = kern.from_heads(&y).unwrap();
        assert!(back.equal(&x), "from_heads {:?}", x.size());
        let dy = Tensor::randn(back.size(), (Kind::Float, device)).to_kind(kind);
        (&back * &dy).sum(Kind::Float).backward();
        assert!(x.grad().equal(&dy), "gradient {:?}", x.size());
    }
}

#[test]
fn cpu_rope_matches_reference() {
    let kern = cpu().expect("the CPU kernel library builds");
    rope_matches_reference(kern, Device::Cpu, Kind::Float, 1e-6);
    head_moves_are_transposes(kern, Device::Cpu, Kind::Float);
}

#[test]
#[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
fn cuda_rope_matches_reference() {
    on_cuda("cuda_rope_matches_reference", |k| {
        rope_matches_reference(k, Device::Cuda(0), Kind::BFloat16, 1e-2);
        rope_matches_reference(k, Device::Cuda(0), Kind::Float, 1e-5);
        head_moves_are_transposes(k, Device::Cuda(0), Kind::BFloat16);
        head_moves_are_transposes(k, Device::Cuda(0), Kind::Float);
    });
}

/// The straight-through mix against its ATen form in fp32 from the same (rounded) inputs:
/// output (exactly `c` where the weight is 0) and the gradients of `c` and `w`, at both
/// head_dims the row kernels take.
fn st_mix_matches_reference(kern: &Kernels, device: Device, kind: Kind, tol: f64) {
    for d in [64i64, 128] {
        tch::manual_seed(d);
        let shape = [2, 3, 77, d];
        let c = Tensor::randn(shape, (Kind::Float, device))
            .to_kind(kind)
            .set_requires_grad(true);
        let o = Tensor::randn(shape, (Kind::Float, device)).to_kind(kind);
        // A third of the rows at weight 0, as AHA's forward has them all; transposed, as
        // the layer passes it ([B, T, H] to [B, H, T]).
        let w = (Tensor::randn([2, 77, 3], (Kind::Float, device))
            * Tensor::rand([2, 77, 3], (Kind::Float, device)).gt(0.33))
        .set_requires_grad(true);
        let wt = w.transpose(1, 2);
        let dy = Tensor::randn(shape, (Kind::Float, device));
        let got = kern.st_mix(&c, &o, &wt).unwrap();
        assert_eq!(got.kind(), kind);
        (got.to_kind(Kind::Float) * &dy).sum(Kind::Float).backward();
        let (cr, wr) = (
            c.detach().to_kind(Kind::Float).set_requires_grad(true),
            w.detach().set_requires_grad(true),
        );
        let want = &cr + wr.transpose(1, 2).unsqueeze(-1) * (cr.detach() - o.to_kind(Kind::Float));
        (&want * &dy).sum(Kind::Float).backward();
        let zero = wt.detach().eq(0.0).unsqueeze(-1);
        let (g0, c0) = (
            got.detach().masked_select(&zero),
            c.detach().masked_select(&zero),
        );
        assert!(g0.equal(&c0), "D={d}: rows at weight 0 are not c exactly");
        for (name, g, r) in [
            ("y", got.detach().to_kind(Kind::Float), want.detach()),
            ("dc", c.grad().to_kind(Kind::Float), cr.grad()),
            ("dw", w.grad(), wr.grad()),
        ] {
            let e = rel_err(&g, &r);
            assert!(e < tol, "D={d}: {name} differs by {e:.2e}");
        }
    }
}

/// The fused SwiGLU gate against `silu(g) * u` in fp32 from the same (rounded) inputs:
/// output and both gradients, over a size that is not a multiple of the block.
fn swiglu_matches_reference(kern: &Kernels, device: Device, kind: Kind, tol: f64) {
    tch::manual_seed(7);
    let mk = || {
        (Tensor::randn([3, 37, 100], (Kind::Float, device)) * 3.0)
            .to_kind(kind)
            .set_requires_grad(true)
    };
    let (g, u) = (mk(), mk());
    let dy = Tensor::randn([3, 37, 100], (Kind::Float, device));
    let got = kern.swiglu(&g, &u).unwrap();
    assert_eq!(got.kind(), kind);
    (got.to_kind(Kind::Float) * &dy).sum(Kind::Float).backward();
    let (gr, ur) = (
        g.detach().to_kind(Kind::Float).set_requires_grad(true),
        u.detach().to_kind(Kind::Float).set_requires_grad(true),
    );
    let want = gr.silu() * &ur;
    (&want * &dy).sum(Kind::Float).backward();
    for (name, a, b) in [
        ("y", got.detach().to_kind(Kind::Float), want.detach()),
        ("dg", g.grad().to_kind(Kind::Float), gr.grad()),
        ("du", u.grad().to_kind(Kind::Float), ur.grad()),
    ] {
        let e = rel_err(&a, &b);
        assert!(e < tol, "{name} differs by {e:.2e}");
    }
}

#[test]
fn cpu_swiglu_matches_reference() {
    let kern = cpu().expect("the CPU kernel library builds");
    swiglu_matches_reference(kern, Device::Cpu, Kind::Float, 1e-6);
    let x = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
    let err = kern.swiglu(&x, &Tensor::zeros([3, 2], (Kind::Float, Device::Cpu)));
    assert!(err.unwrap_err().to_string().contains("one shape"));
}

#[test]
#[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
fn cuda_swiglu_matches_reference() {
    on_cuda("cuda_swiglu_matches_reference", |k| {
        swiglu_matches_reference(k, Device::Cuda(0), Kind::BFloat16, 1e-2)
    });
}

#[test]
fn cpu_st_mix_matches_reference() {
    let kern = cpu().expect("the CPU kernel library builds");
    st_mix_matches_reference(kern, Device::Cpu, Kind::Float, 1e-6);
    let c = Tensor::zeros([1, 2, 3, 8], (Kind::Float, Device::Cpu));
    let err = kern.st_mix(
        &c,
        &c,
        &Tensor::zeros([1, 2, 4], (Kind::Float, Device::Cpu)),
    );
    assert!(err
        .unwrap_err()
        .to_string()
        .contains("weight must be [B, H, L]"));
}

#[test]
#[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
fn cuda_st_mix_matches_reference() {
    on_cuda("cuda_st_mix_matches_reference", |k| {
        st_mix_matches_reference(k, Device::Cuda(0), Kind::BFloat16, 1e-2)
    });
}

/// AHA's gates against the layer's ATen reference (`attention/gates.rs`: `threshold`,
/// `hash_uniform`'s probes, `routed_pairs`) and the straight-through weight's gradient,
/// for gates open at random, all open and all closed, at two chunk starts.
fn aha_gates_match_reference(kern: &Kernels, device: Device) {
    use crate::model::attention::{hash_uniform, routed_pairs, threshold};
    let (b, l, h, window) = (2i64, 150i64, 3i64, 16i64);
    tch::manual_seed(5);
    let mut s = Tensor::rand([b, l, h], (Kind::Float, device)).set_requires_grad(true);
    let dw = Tensor::randn([b, h, l], (Kind::Float, device));
    for (tau, sample, start) in [(0.5, 0.3, 0), (0.5, 1.0, 37), (-1.0, 0.3, 5), (2.0, 0.3, 0)] {
        let (seed, layer) = (0x1234_5678_9abc_def0u64, 3);
        let g = kern
            .aha_gates(&s, tau, sample, seed, layer, start, window)
            .unwrap();
        let on = threshold(&s.detach(), tau, false);
        let positions = Tensor::arange_start(start, start + l, (Kind::Int64, device));
        let probe = hash_uniform(seed, layer, [b, l, h], &positions)
            .lt(sample)
            .logical_and(&on.le(0.5))
            .to_kind(Kind::Float);
        let at = |t: &Tensor| t.transpose(1, 2).to_kind(Kind::Float);
        let case = format!("tau {tau}, sample {sample}, start {start}");
        assert!(g.hard.equal(&on), "{case}: hard gates");
        assert!(
            at(&(&on + 1.0)).equal(&g.chosen.to_kind(Kind::Float)),
            "{case}"
        );
        assert!(
            at(&(&on + &probe * 2.0)).equal(&g.other.to_kind(Kind::Float)),
            "{case}"
        );
        let pairs = routed_pairs(&on, window as usize, &positions).double_value(&[]);
        assert_eq!(g.pairs.double_value(&[]), pairs, "{case}: pairs");
        assert_eq!(
            g.weight.abs().max().double_value(&[]),
            0.0,
            "{case}: weight"
        );
        s.zero_grad();
        (&g.weight * &dw).sum(Kind::Float).backward();
        let want = (&dw * at(&(&on - &probe / sample))).transpose(1, 2);
        let e = rel_err(&s.grad(), &want);
        assert!(e < 1e-6, "{case}: gradient differs by {e:.2e}");
    }
}

/// A router's scores and gradients against `Linear::forward` on the fp32 input and a
/// sigmoid: with and without bias, one head and several, a width the kernels take in
/// 16-byte chunks of a few lanes, the per-head routers of Qwen2.5-1.5B (12 x 1536) and
/// OLMo-2-1B (16 x 2048, a weight of 128 KiB in shared memory), and shapes they leave to
/// ATen (17 heads; Qwen2.5-7B's 28 x 3584).
fn router_matches_reference(kern: &Kernels, device: Device, kind: Kind) {
    use crate::model::nn::Linear;
    // 20001 tokens a row: on a GPU of up to ~150 SMs, blocks of the weight's gradient take
    // more than one chunk of tokens, and the last one a part of one.
    for (heads, d, bias, len) in [
        (8i64, 512i64, true, 33i64),
        (1, 72, false, 33),
        (3, 40, true, 33),
        (17, 64, true, 33),
        (4, 64, true, 20001),
        (12, 1536, true, 300),
        (16, 2048, true, 300),
        (28, 3584, true, 33),
    ] {
        tch::manual_seed(heads * 1000 + d);
        let x = (Tensor::randn([2, len, d], (Kind::Float, device)))
            .to_kind(kind)
            .set_requires_grad(true);
        let w = (Tensor::randn([heads, d], (Kind::Float, device)) * 0.1).set_requires_grad(true);
        let b = bias.then(|| Tensor::randn([heads], (Kind::Float, device)).set_requires_grad(true));
        let ds = Tensor::randn([2, len, heads], (Kind::Float, device));
        // With 17 heads the kernel gets the bias as a strided view (of the same values).
        let b_in = b.as_ref().map(|b| match heads {
            17 => Tensor::stack(&[b, b], 1).select(1, 0),
            _ => b.shallow_clone(),
        });
        let got = kern.router(&x, &w, b_in.as_ref()).unwrap();
        (&got * &ds).sum(Kind::Float).backward();
        let (xr, wr) = (
            x.detach().set_requires_grad(true),
            w.detach().set_requires_grad(true),
        );
        let br = b.as_ref().map(|b| b.detach().set_requires_grad(true));
        let lin = Linear {
            weight: wr.shallow_clone(),
            bias: br.as_ref().map(|b| b.shallow_clone()),
        };
        let want = lin.forward(&xr.to_kind(Kind::Float)).sigmoid();
        (&want * &ds).sum(Kind::Float).backward();
        let case = format!("{heads} heads, d {d}, {kind:?}");
        let mut pairs = vec![
            ("s", got.detach(), want.detach()),
            (
                "dx",
                x.grad().to_kind(Kind::Float),
                xr.grad().to_kind(Kind::Float),
            ),
            ("dw", w.grad(), wr.grad()),
        ];
        if let (Some(b), Some(br)) = (&b, &br) {
            pairs.push(("db", b.grad(), br.grad()));
        }
        for (name, g, r) in pairs {
            // dx is rounded to x's dtype: the sums' order moves bf16 results by an ulp.
            let tol = if name == "dx" && kind == Kind::BFloat16 {
                1e-2
            } else {
                1e-5
            };
            let e = rel_err(&g, &r);
            assert!(e < tol, "{case}: {name} differs by {e:.2e}");
        }
    }
}

#[test]
fn cpu_router_matches_reference() {
    let kern = cpu().expect("the CPU kernel library builds");
    router_matches_reference(kern, Device::Cpu, Kind::Float);
    let x = Tensor::zeros([4, 8], (Kind::Float, Device::Cpu));
    let err = kern.router(&x, &Tensor::zeros([2, 9], (Kind::Float, Device::Cpu)), None);
    assert!(err.unwrap_err().to_string().contains("[..., d]"));
}

#[test]
#[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
fn cuda_router_matches_reference() {
    on_cuda("cuda_router_matches_reference", |k| {
        for kind in [Kind::BFloat16, Kind::Float] {
            router_matches_reference(k, Device::Cuda(0), kind)
        }
    });
}

#[test]
fn cpu_aha_gates_match_reference() {
    let kern = cpu().expect("the CPU kernel library builds");
    aha_gates_match_reference(kern, Device::Cpu);
    let s = Tensor::zeros([1, 4, 2], (Kind::Float, Device::Cpu));
    let err = kern.aha_gates(&s, 0.5, 0.0, 1, 0, 0, 8);
    assert!(err.unwrap_err().to_string().contains("probe rate"));
    let err = kern.aha_gates(&s.to_kind(Kind::Double), 0.5, 0.5, 1, 0, 0, 8);
    assert!(err.unwrap_err().to_string().contains("fp32"));
}

#[test]
#[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
fn cuda_aha_gates_match_reference() {
    on_cuda("cuda_aha_gates_match_reference", |k| {
        aha_gates_match_reference(k, Device::Cuda(0))
    });
}

#[test]
fn cpu_rms_norm_matches_reference() {
    let kern = cpu().expect("the CPU kernel library builds");
    rms_norm_matches_reference(kern, Device::Cpu, Kind::Float, 1e-5);
    let x = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
    let err = kern.rms_norm(&x, &Tensor::ones([4], (Kind::Float, Device::Cpu)), 1e-5);
    assert!(err.unwrap_err().to_string().contains("weight must be [d]"));
    let (x, w) = (
        Tensor::zeros([2, 0], (Kind::Float, Device::Cpu)),
        Tensor::ones([0], (Kind::Float, Device::Cpu)),
    );
    let err = kern.rms_norm(&x, &w, 1e-5);
    assert!(err.unwrap_err().to_string().contains("d >= 1"));
}

#[test]
#[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
fn cuda_rms_norm_matches_reference() {
    on_cuda("cuda_rms_norm_matches_reference", |k| {
        rms_norm_matches_reference(k, Device::Cuda(0), Kind::BFloat16, 1e-2)
    });
}

#[test]
fn cpu_cross_entropy_matches_log_softmax() {
    let kern = cpu().expect("the CPU kernel library builds");
    cross_entropy_matches_log_softmax(kern, Device::Cpu, Kind::Float, 1e-6);
    let x = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
    let err = kern.token_nll(&x, &Tensor::zeros([3], (Kind::Int64, Device::Cpu)));
    assert!(err.unwrap_err().to_string().contains("targets' shape"));
}

#[test]
#[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
fn cuda_cross_entropy_matches_log_softmax() {
    on_cuda("cuda_cross_entropy_matches_log_softmax", |k| {
        cross_entropy_matches_log_softmax(k, Device::Cuda(0), Kind::BFloat16, 1e-3)
    });
}

/// PPA (window plus power offsets) output and gradients against the dense reference with
/// the PPA mask: lengths that are not tile multiples, window 1 and the window at a tile
/// size, powers from sparse to dense offsets (long sparse cases, where the kernels skip
/// most far tiles), GQA.
fn compare_ppa_with_reference(
    kern: &Kernels,
    device: Device,
    kind: Kind,
    head_dims: &[i64],
    tol: f64,
) {
    let (b, h, hkv) = (2i64, 4i64, 2i64);
    for &d in head_dims {
        for &(len, window, power) in &[
            (300i64, 16usize, 0.5f64),
            (200, 7, 0.75),
            (517, 64, 0.25),
            (130, 1, 0.9),
            (2048, 64, 0.5),
            (4100, 128, 0.25),
            (1000, 5, 0.6),
        ] {
            // The dense fp32 reference of the long case is slow on a CPU.
            if device == Device::Cpu && len > 600 {
                continue;
            }
            tch::manual_seed(len + window as i64 + d);
            let pattern = KeyPattern::Ppa { power, window };
            let all = pattern.offsets_beyond_window(len as usize);
            assert!(
                !all.is_empty(),
                "L={len} w={window} p={power}: no offsets to test"
            );
            // The split the kernels pick, and on the GPU also every far distance in the
            // tile kernels and every one pair by pair.
            let mut splits = vec![PpaOffsets::new(&all, window, device).pairs_from];
            if device != Device::Cpu {
                splits.extend([0, all.len()]);
                splits.sort();
                splits.dedup();
            }
            for pairs_from in splits {
                let offsets = PpaOffsets::split_at(&all, pairs_from, device);
                check_against(
                    [b, h, len, d],
                    [b, hkv, len, d],
                    (kind, device),
                    tol,
                    &format!(
                        "PPA D={d} L={len} w={window} p={power}, pairs from {pairs_from} of {}",
                        all.len()
                    ),
                    |q, k, v| {
                        kern.ppa_attention(q, k, v, window as i64, &offsets)
                            .unwrap()
                    },
                    |q, k, v| attend(q, k, v, &pattern, None),
                );
            }
        }
    }
}

/// Attention sinks (the window, and the sequence's first keys beyond it pair by pair) output
/// and gradients against the dense reference with the sinks' mask: lengths that are not tile
/// multiples, window 1, sinks inside the window only (no pairs), more sinks than a tile, long
/// sequences (many query chunks per sink key in dK and dV), GQA.
fn compare_sinks_with_reference(
    kern: &Kernels,
    device: Device,
    kind: Kind,
    head_dims: &[i64],
    tol: f64,
) {
    let (b, h, hkv) = (2i64, 4i64, 2i64);
    for &d in head_dims {
        for &(len, window, sinks) in &[
            (300i64, 16usize, 4usize),
            (200, 1, 1),
            (130, 64, 8),
            (90, 100, 4),
            (517, 32, 70),
            (4100, 128, 4),
        ] {
            // The dense fp32 reference of the long case is slow on a CPU.
            if device == Device::Cpu && len > 600 {
                continue;
            }
            tch::manual_seed(len + window as i64 + d);
            let pattern = KeyPattern::Sinks { sinks, window };
            check_against(
                [b, h, len, d],
                [b, hkv, len, d],
                (kind, device),
                tol,
                &format!("sinks D={d} L={len} w={window} sinks={sinks}"),
                |q, k, v| {
                    kern.sink_attention(q, k, v, window as i64, sinks as i64)
                        .unwrap()
                },
                |q, k, v| attend(q, k, v, &pattern, None),
            );
        }
    }
}

/// The pair kernels take over PPA's far distances from the last one lying closer than
/// PPA_PAIR_GAP to both neighbours: squares from 256 (225 - 196 = 29, 256 - 225 = 31,
/// 289 - 256 = 33), all of p = 0.25's fourth powers (81 lies 18 past the window's edge but
/// 175 before 256), none of the dense p = 0.75.
#[test]
fn ppa_pairs_start_where_the_gaps_stay_wide() {
    assert_eq!(PPA_PAIR_GAP, 32, "the cases below assume it");
    let split = |power, window: usize, len: usize| {
        let all = KeyPattern::Ppa { power, window }.offsets_beyond_window(len);
        let from = PpaOffsets::new(&all, window, Device::Cpu).pairs_from;
        (all.get(from).copied(), all.len() - from)
    };
    assert_eq!(split(0.5, 64, 4096), (Some(256), 64 - 16));
    assert_eq!(split(0.25, 64, 4096), (Some(81), 5));
    assert_eq!(split(0.25, 200, 4096), (Some(256), 4));
    assert_eq!(split(0.75, 64, 32768), (None, 0));
    // Offsets close on both sides keep those before them in the tiles; the first offset
    // counts its gap from the window's edge.
    let from = |o: &[i32]| PpaOffsets::new(o, 64, Device::Cpu).pairs_from;
    assert_eq!(from(&[90, 200, 300, 310, 320, 400]), 4);
    assert_eq!(from(&[70, 80, 200]), 1);
    assert_eq!(from(&[96, 200]), 0);
    assert_eq!(from(&[]), 0);
}

#[test]
fn only_finished_builds_are_found() {
    let cache = util::scratch_dir("find");
    let lib = |dir: &str| {
        std::fs::create_dir_all(cache.join(dir)).unwrap();
        std::fs::write(cache.join(dir).join(LIB), b"").unwrap();
        cache.join(dir).join(LIB)
    };
    let done = lib("cpu-0123abcd-89abcdef");
    assert_eq!(newest_build(&cache, "cpu-0123abcd-"), Some(done.clone()));
    // Written later, but in progress, of other sources, or of another variant.
    std::thread::sleep(std::time::Duration::from_millis(20));
    lib("cpu-0123abcd-89abcdef.tmp-77-0");
    lib("cpu-0123abcd-0000ffff.tmp-78-1");
    lib("cpu-99999999-89abcdef");
    lib("cuda-sm90-0123abcd-89abcdef");
    assert_eq!(newest_build(&cache, "cpu-0123abcd-"), Some(done));
    std::thread::sleep(std::time::Duration::from_millis(20));
    let other_torch = lib("cpu-0123abcd-fedcba98");
    assert_eq!(newest_build(&cache, "cpu-0123abcd-"), Some(other_torch));
    assert_eq!(newest_build(&cache, "cpu-00000000-"), None);
    std::fs::remove_dir_all(&cache).unwrap();
}

/// Empty batches give empty outputs and gradients, and key-value tensors without heads an
/// error, on either device (the CUDA launchers must not launch grids of zero blocks).
fn empty_and_headless_inputs(kern: &Kernels, device: Device, kind: Kind, d: i64) {
    let q = Tensor::zeros([0, 2, 4, d], (kind, device)).set_requires_grad(true);
    let out = kern.list_attention(&q, &q, &q, None, 4).unwrap();
    assert_eq!(out.size(), [0, 2, 4, d]);
    out.sum(Kind::Float).backward();
    assert_eq!(q.grad().size(), [0, 2, 4, d]);
    let path = Tensor::zeros([0, 2, 4], (Kind::Uint8, device));
    let out = kern.routed_attention(&q, &q, &q, &path, 4).unwrap();
    assert_eq!(out.size(), [0, 2, 4, d]);
    let q = Tensor::zeros([1, 2, 4, d], (kind, device));
    let k = Tensor::zeros([1, 0, 4, d], (kind, device));
    let err = kern
        .list_attention(&q, &k, &k, None, 4)
        .unwrap_err()
        .to_string();
    assert!(err.contains("at least one key-value head"), "{err}");
}

/// Runs a GPU test with the CUDA library. GPU tests are `#[ignore]`d, so the runner
/// reports them as ignored on machines without a GPU; run on purpose (`--ignored`) where
/// there is none, they fail rather than pass unseen.
pub(crate) fn on_cuda(test: &str, f: impl FnOnce(&'static Kernels)) {
    match cuda() {
        Some(k) if tch::Cuda::is_available() => f(k),
        _ => panic!(
            "{test} needs a CUDA device and a built kernel library (attnsweep kernels build)"
        ),
    }
}

/// The PPA tile walks and masks of every attention kernel, emulated on the host with the
/// kernels' own helpers (`kernels/walk_test.cpp` over `kernels/walk.cuh`), keep exactly
/// the PPA mask's pairs; a GPU-free check of what the GPU tests compare numerically.
#[test]
fn ppa_tile_walks_keep_exactly_the_mask() {
    let dir = std::env::temp_dir().join(format!("attnsweep-walk-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("walk_test");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let built = Command::new(cxx)
        .args(["-std=c++17", "-O2"])
        .arg(format!("-I{}", src.display()))
        .arg(src.join("walk_test.cpp"))
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("a C++ compiler (g++ or $CXX)");
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let ran = Command::new(&exe).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        ran.status.success(),
        "{}",
        String::from_utf8_lossy(&ran.stdout)
    );
}

#[test]
fn cpu_library_matches_reference() {
    let kern = cpu().expect("the CPU kernel library builds (g++ and torch headers)");
    assert!(!kern.cuda);
    compare_with_reference(kern, Device::Cpu, Kind::Float, &[8, 16], 1e-4);
    compare_ppa_with_reference(kern, Device::Cpu, Kind::Float, &[8], 1e-4);
    compare_sinks_with_reference(kern, Device::Cpu, Kind::Float, &[8], 1e-4);
    compare_routed_with_reference(kern, Device::Cpu, Kind::Float, &[8], 1e-4);
    let (q, off) = (
        Tensor::zeros([1, 2, 10, 8], (Kind::Float, Device::Cpu)),
        |o: &[i32], pairs_from| PpaOffsets::split_at(o, pairs_from, Device::Cpu),
    );
    for (offsets, needle) in [
        (off(&[2, 5], 0), "[window, L)"),
        (off(&[4, 10], 0), "[window, L)"),
        (off(&[6, 5], 0), "strictly ascending"),
        (off(&[4, 5], 3), "pairs_from must lie in [0, 2]"),
    ] {
        let err = kern
            .ppa_attention(&q, &q, &q, 3, &offsets)
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{err}");
    }
    let q = Tensor::zeros([1, 2, 4, 8], (Kind::Float, Device::Cpu));
    let k = Tensor::zeros([1, 3, 4, 8], (Kind::Float, Device::Cpu));
    let err = kern
        .list_attention(&q, &k, &k, None, 4)
        .unwrap_err()
        .to_string();
    assert!(err.contains("multiple of key-value heads"), "{err}");
    empty_and_headless_inputs(kern, Device::Cpu, Kind::Float, 8);
    let qpos = Tensor::zeros([1, 2, 4], (Kind::Int, Device::Cpu));
    let nq = Tensor::from_slice(&[4i32, 5]).view([1, 2]);
    let err = kern
        .list_attention(&q, &q, &q, Some((&qpos, &nq)), 4)
        .unwrap_err()
        .to_string();
    assert!(err.contains("nq must lie in [0, Lq]"), "{err}");
    assert!(kern
        .list_attention(&q, &q, &q, None, 0)
        .unwrap_err()
        .to_string()
        .contains("window"));
    let path = Tensor::ones([1, 2, 4], (Kind::Uint8, Device::Cpu));
    for (path, window, needle) in [
        (path.to_kind(Kind::Float), 2, "path must be uint8"),
        (path.narrow(2, 0, 3), 2, "path must be [B, H, L]"),
        (&path * 3, 2, "path values must be 0"),
        (path.shallow_clone(), 0, "window must be at least 1"),
    ] {
        let err = kern
            .routed_attention(&q, &q, &q, &path, window)
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{err}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
fn cuda_kernels_match_reference() {
    on_cuda("cuda_kernels_match_reference", |kern| {
        compare_with_reference(kern, Device::Cuda(0), Kind::BFloat16, &[64, 128], 2e-2);
        compare_ppa_with_reference(kern, Device::Cuda(0), Kind::BFloat16, &[64, 128], 2e-2);
        compare_sinks_with_reference(kern, Device::Cuda(0), Kind::BFloat16, &[64, 128], 2e-2);
        compare_routed_with_reference(kern, Device::Cuda(0), Kind::BFloat16, &[64, 128], 2e-2);
        empty_and_headless_inputs(kern, Device::Cuda(0), Kind::BFloat16, 64);
        // A list on the host for queries on the GPU would hand the kernels host pointers.
        let q = Tensor::zeros([1, 2, 4, 64], (Kind::BFloat16, Device::Cuda(0)));
        let qpos = Tensor::zeros([1, 2, 4], (Kind::Int, Device::Cpu));
        let nq = Tensor::zeros([1, 2], (Kind::Int, Device::Cpu));
        let err = kern
            .list_attention(&q, &q, &q, Some((&qpos, &nq)), 4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("another device than q"), "{err}");
    });
}

/// The decode kernel (one query a row over a cache slot) against attention computed from the
/// pattern's own predicate (`KeyPattern::sees`) over the slot's entries: entries in ring
/// order, empty ones, GQA groups, every pattern, a slot long enough to be split into runs.
fn decode_attention_matches_reference(kern: &Kernels, device: Device, slots: i64) {
    let (b, kv) = (2, 2);
    let mut rng = Rng::new(slots as u64);
    for (heads, d) in [(6, 64), (4, 128), (2, 64)] {
        for pattern in [
            KeyPattern::Full,
            KeyPattern::Window(37),
            KeyPattern::Sinks {
                sinks: 3,
                window: 29,
            },
            KeyPattern::Ppa {
                power: 0.5,
                window: 17,
            },
        ] {
            // A ring that has wrapped: entry i holds position qpos - ((i + shift) % slots),
            // and a few entries were never written.
            let qpos = 3 * slots;
            let shift = slots / 3;
            // The first entries hold the sequence's first positions, as a sinks slot keeps
            // them, so the sinks' test has keys to see.
            let kpos: Vec<i64> = (0..slots)
                .map(|i| match (i, rng.below(10)) {
                    (0..3, _) => i,
                    (_, 0) => -1,
                    _ => qpos - (i + shift) % slots,
                })
                .collect();
            let opts = (Kind::Float, device);
            let bf = |t: Tensor| t.to_kind(Kind::BFloat16);
            let q = bf(Tensor::randn([b, heads, 1, d], opts));
            let k = bf(Tensor::randn([b, kv, slots, d], opts));
            let v = bf(Tensor::randn([b, kv, slots, d], opts));
            let seen: Vec<bool> = kpos
                .iter()
                .map(|&p| p >= 0 && pattern.sees(qpos as usize, p as usize))
                .collect();
            let mask = Tensor::from_slice(&seen).to_device(device).view([1, slots]);
            let f = |t: &Tensor| t.to_kind(Kind::Float);
            let want = Tensor::scaled_dot_product_attention(
                &f(&q),
                &f(&k),
                &f(&v),
                Some(&mask),
                0.0,
                false,
                None,
                true,
            );
            let near = pattern.near_table(qpos as usize + 1, device);
            let (window, sinks) = pattern.reach();
            let got = kern
                .decode_attention(
                    &q,
                    &k,
                    &v,
                    &Tensor::from_slice(&kpos).to_device(device),
                    &Tensor::from_slice(&[qpos]).to_device(device),
                    window,
                    sinks,
                    near.as_ref(),
                )
                .unwrap();
            let err = (f(&got) - &want).abs().max().double_value(&[]);
            assert!(
                err < 2e-2,
                "{pattern:?}, {heads} heads, D {d}: max error {err}"
            );
        }
    }
}

#[test]
fn cpu_decode_attention_matches_reference() {
    let kern = cpu().expect("the CPU kernel library builds");
    decode_attention_matches_reference(kern, Device::Cpu, 90);
    let q = Tensor::zeros([1, 2, 2, 64], (Kind::Float, Device::Cpu));
    let k = Tensor::zeros([1, 1, 5, 64], (Kind::Float, Device::Cpu));
    let pos = Tensor::zeros([5], (Kind::Int64, Device::Cpu));
    let err = kern.decode_attention(&q, &k, &k, &pos, &pos.narrow(0, 0, 1), -1, 0, None);
    assert!(err.unwrap_err().to_string().contains("one query a row"));
}

#[test]
#[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
fn cuda_decode_attention_matches_reference() {
    on_cuda("cuda_decode_attention_matches_reference", |k| {
        for slots in [90, 5000] {
            decode_attention_matches_reference(k, Device::Cuda(0), slots)
        }
    });
}

/// A decoding step's joined projections into q and the cache in one launch, against what it
/// replaces: the head move with its rotation and index copies of the key, the value and the
/// position into the entry. On the GPU the rotation is the rope kernel's, bit for bit; on the
/// CPU (where the library's reference is the rope kernel's own reference) it is
/// `Rope::apply`'s, in ATen.
fn decode_step_matches_unfused(kern: &Kernels, device: Device, kind: Kind) {
    let (b, slots) = (3, 11);
    for (heads, kv, d) in [(9, 3, 64), (4, 2, 128), (2, 2, 64)] {
        let randn = |shape: &[i64]| Tensor::randn(shape, (Kind::Float, device)).to_kind(kind);
        let qkv = randn(&[b, 1, (heads + 2 * kv) * d]);
        let (k, v) = (randn(&[b, kv, slots, d]), randn(&[b, kv, slots, d]));
        let kpos = Tensor::full([slots], -1, (Kind::Int64, device));
        let entry = Tensor::from_slice(&[7i64]).to_device(device);
        let pos = Tensor::from_slice(&[40i64]).to_device(device);
        let inv: Vec<f64> = (0..d / 2)
            .map(|i| 10_000f64.powf(-2.0 * i as f64 / d as f64))
            .collect();
        let rope = Rope::new(41, &inv, kind, device).at(&pos);
        let (cos, sin) = rope.angles();
        let (k2, v2, kpos2) = (k.copy(), v.copy(), kpos.copy());
        let q = kern
            .decode_step(&qkv, cos, sin, &entry, &pos, heads, &k2, &v2, &kpos2)
            .unwrap();
        let x = qkv.view([b, 1, heads + 2 * kv, d]);
        let by = device.is_cuda().then_some(kern);
        let rot = |t: Tensor| rope.apply_transposed(&t.contiguous(), by);
        let want_k = k.index_copy(2, &entry, &rot(x.narrow(2, heads, kv)));
        let want_v = v.index_copy(2, &entry, &x.narrow(2, heads + kv, kv).transpose(1, 2));
        let case = format!("{heads}/{kv} heads, D {d}");
        let tol = if device.is_cuda() { 0.0 } else { 1e-6 };
        let close = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]) <= tol;
        assert!(close(&q, &rot(x.narrow(2, 0, heads))), "{case}: q");
        assert!(close(&k2, &want_k), "{case}: k");
        assert!(v2.equal(&want_v), "{case}: v");
        let mut want_pos = vec![-1i64; slots as usize];
        want_pos[7] = 40;
        assert_eq!(Vec::<i64>::try_from(&kpos2).unwrap(), want_pos, "{case}");
    }
}

#[test]
fn cpu_decode_step_matches_unfused() {
    let kern = cpu().expect("the CPU kernel library builds");
    decode_step_matches_unfused(kern, Device::Cpu, Kind::Float);
    let k = Tensor::zeros([1, 1, 5, 64], (Kind::Float, Device::Cpu));
    let pos = Tensor::zeros([5], (Kind::Int64, Device::Cpu));
    let one = pos.narrow(0, 0, 1);
    let angles = Tensor::zeros([1, 64], (Kind::Float, Device::Cpu));
    let qkv = Tensor::zeros([1, 1, 3 * 64], (Kind::Float, Device::Cpu));
    let err = kern.decode_step(&qkv, &angles, &angles, &one, &one, 2, &k, &k, &pos);
    assert!(err.unwrap_err().to_string().contains("qkv must be"));
}

#[test]
#[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
fn cuda_decode_step_matches_unfused() {
    on_cuda("cuda_decode_step_matches_unfused", |k| {
        decode_step_matches_unfused(k, Device::Cuda(0), Kind::BFloat16)
    });
}

/// The residual add fused with the norm after it, forward and backward. Forward: the sum
/// exactly as the add rounds it, the norm as the RMSNorm kernel computes it from that sum.
/// Backward: the gradients of x, r and the weight against plain tensor operations' autograd of
/// the unfused add and norm (in fp32 from the inputs' values), the loss reading both outputs,
/// or only the stream (the norm's gradient arriving as zeros). Rows of a decoding step (a
/// block a row), of training (a warp a row) and rows wider than a warp's registers.
fn add_rms_norm_matches_unfused(kern: &Kernels, device: Device, kind: Kind, tol: f64) {
    for (rows, d, reads_norm) in [
        (1, 576, true),
        (8, 576, true),
        (4096, 576, true),
        (3, 2048, true),
        (5, 7, true),
        (6, 64, false),
    ] {
        let randn = |shape: &[i64]| Tensor::randn(shape, (Kind::Float, device)).to_kind(kind);
        let (x0, r0) = (randn(&[rows, 1, d]), randn(&[rows, 1, d]));
        let (a, b) = (randn(&[rows, 1, d]), randn(&[rows, 1, d]));
        let w0 = Tensor::rand([d], (Kind::Float, device)) + 0.5;
        let leaf = |t: &Tensor| t.detach().set_requires_grad(true);
        let (x, r, w) = (leaf(&x0), leaf(&r0), leaf(&w0));
        let (h, y) = kern.add_rms_norm(&x, &r, &w, 1e-5).unwrap();
        let f = |t: &Tensor| t.to_kind(Kind::Float);
        let want_h = &x0 + &r0;
        assert!(h.equal(&want_h), "{rows} x {d}: h");
        let want_y = kern.rms_norm(&want_h, &w0, 1e-5).unwrap();
        let err = (f(&y) - f(&want_y)).abs().max().double_value(&[]);
        assert!(err < tol, "{rows} x {d}: y's max error {err}");
        let loss = |h: &Tensor, y: &Tensor| {
            let l = (f(h) * f(&a)).sum(Kind::Float);
            if reads_norm {
                l + (f(y) * f(&b)).sum(Kind::Float)
            } else {
                l
            }
        };
        loss(&h, &y).backward();
        let (x2, r2, w2) = (leaf(&x0), leaf(&r0), leaf(&w0));
        let h2 = &x2 + &r2;
        let hf = f(&h2);
        let rms = (hf.square().mean_dim(-1, true, Kind::Float) + 1e-5).rsqrt();
        let y2 = &w2 * (hf * rms);
        loss(&h2, &y2).backward();
        // Unread, the norm leaves the weight no gradient in the unfused graph: zeros here.
        if !reads_norm {
            assert_eq!(
                f(&w.grad()).abs().max().double_value(&[]),
                0.0,
                "{rows} x {d}: dw"
            );
        }
        let pairs: &[(&str, &Tensor, &Tensor)] = match reads_norm {
            true => &[("x", &x, &x2), ("r", &r, &r2), ("w", &w, &w2)],
            false => &[("x", &x, &x2), ("r", &r, &r2)],
        };
        for &(name, got, want) in pairs {
            let (g, e) = (f(&got.grad()), f(&want.grad()));
            let err = ((&g - &e).abs().max() / (e.abs().max() + 1e-6)).double_value(&[]);
            assert!(
                err < tol,
                "{rows} x {d} (norm read: {reads_norm}): d{name} relative error {err}"
            );
        }
    }
}

#[test]
fn cpu_add_rms_norm_matches_unfused() {
    let kern = cpu().expect("the CPU kernel library builds");
    add_rms_norm_matches_unfused(kern, Device::Cpu, Kind::Float, 1e-5);
    let x = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
    let err = kern.add_rms_norm(
        &x,
        &x.narrow(1, 0, 2),
        &Tensor::ones([3], (Kind::Float, Device::Cpu)),
        1e-5,
    );
    assert!(err.unwrap_err().to_string().contains("one shape"));
    let empty = Tensor::zeros([2, 0], (Kind::Float, Device::Cpu));
    let err = kern.add_rms_norm(
        &empty,
        &empty,
        &Tensor::ones([0], (Kind::Float, Device::Cpu)),
        1e-5,
    );
    assert!(err.unwrap_err().to_string().contains("d >= 1"));
}

#[test]
#[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
fn cuda_add_rms_norm_matches_unfused() {
    on_cuda("cuda_add_rms_norm_matches_unfused", |k| {
        add_rms_norm_matches_unfused(k, Device::Cuda(0), Kind::BFloat16, 3e-2)
    });
}

/// Inference's gate from one joined projection against the gate of its two halves.
fn swiglu_joined_matches_halves(kern: &Kernels, device: Device, kind: Kind, tol: f64) {
    // Rows of a decoding step, a prefill's, and halves too narrow for 16-byte loads.
    for shape in [[8, 1, 2 * 1536], [2, 33, 2 * 64], [3, 1, 2 * 5]] {
        let gu = Tensor::randn(shape, (Kind::Float, device)).to_kind(kind);
        let f = shape[2] / 2;
        let want = kern
            .swiglu(
                &gu.narrow(-1, 0, f).contiguous(),
                &gu.narrow(-1, f, f).contiguous(),
            )
            .unwrap();
        let got = kern.swiglu_joined(&gu).unwrap();
        assert_eq!(got.size(), want.size(), "{shape:?}");
        let err = (got.to_kind(Kind::Float) - want.to_kind(Kind::Float))
            .abs()
            .max()
            .double_value(&[]);
        assert!(err < tol, "{shape:?}: max error {err}");
    }
}

#[test]
fn cpu_swiglu_joined_matches_halves() {
    let kern = cpu().expect("the CPU kernel library builds");
    swiglu_joined_matches_halves(kern, Device::Cpu, Kind::Float, 1e-6);
    let odd = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
    let err = kern.swiglu_joined(&odd).unwrap_err().to_string();
    assert!(err.contains("even last dimension"), "{err}");
}

#[test]
#[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
fn cuda_swiglu_joined_matches_halves() {
    on_cuda("cuda_swiglu_joined_matches_halves", |k| {
        swiglu_joined_matches_halves(k, Device::Cuda(0), Kind::BFloat16, 2e-2)
    });
}
