//! `attnsweep bench attention`: the attention kernels beside their peers, timed in one run on
//! the same shapes: our sliding-window and sparse-query kernels here, SDPA (cuDNN, flash) and
//! FlexAttention in `kernels/bench_peers.py`, run by this command. Writes one CSV and the
//! speed-up-against-sparsity figure (L2A Fig. 8).

use crate::kernels::Kernels;
use crate::plot::{Figure, Series};
use anyhow::{ensure, Context, Result};
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

pub struct AttentionBench {
    pub lengths: Vec<i64>,
    pub head_dims: Vec<i64>,
    pub windows: Vec<i64>,
    pub sparsities: Vec<f64>,
    pub heads: i64,
    pub reps: usize,
    pub out: PathBuf,
    pub python: String,
    pub peers: bool,
}

#[derive(Clone, Debug)]
struct Row {
    imp: String,
    case: String,
    len: i64,
    dim: i64,
    window: i64,
    sparsity: f64,
    fwd_ms: f64,
    fwdbwd_ms: f64,
}

/// Median wall time of `f` in milliseconds, the device synchronised around each call.
fn median_ms(reps: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    tch::Cuda::synchronize(0);
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            tch::Cuda::synchronize(0);
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn time_op(
    reps: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    op: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
) -> (f64, f64) {
    let fwd = tch::no_grad(|| median_ms(reps, || drop(op(q, k, v))));
    let (qg, kg, vg) = (
        q.detach().set_requires_grad(true),
        k.detach().set_requires_grad(true),
        v.detach().set_requires_grad(true),
    );
    let dout = op(&qg, &kg, &vg).detach().randn_like();
    let both = median_ms(reps, || {
        (op(&qg, &kg, &vg) * &dout).sum(Kind::Float).backward()
    });
    (fwd, both)
}

/// (query, key) pairs of a case, for TFLOP/s: 4 * pairs * D forward.
fn pairs(r: &Row, heads: i64) -> f64 {
    let l = r.len as f64;
    let per_seq = match r.case.as_str() {
        "swa" => {
            let w = (r.window as f64).min(l);
            w * l - w * (w - 1.0) / 2.0
        }
        // Active queries spread uniformly: each sees about L/2 keys on average.
        "sparse" => (1.0 - r.sparsity) * l * (l + 1.0) / 2.0,
        _ => l * (l + 1.0) / 2.0,
    };
    per_seq * heads as f64
}

pub fn run(b: &AttentionBench, kern: &Kernels) -> Result<PathBuf> {
    ensure!(
        kern.cuda && tch::Cuda::is_available(),
        "bench attention needs a GPU and the CUDA kernel library"
    );
    std::fs::create_dir_all(&b.out)?;
    let dev = Device::Cuda(0);
    let mut rows: Vec<Row> = Vec::new();
    // The peers first: their process must find the GPU's memory free.
    if b.peers {
        let script = b.out.join("bench_peers.py");
        std::fs::write(&script, include_str!("../kernels/bench_peers.py"))?;
        let join = |v: Vec<String>| v.join(",");
        let out = Command::new(&b.python)
            .arg(&script)
            .args([
                "--lengths",
                &join(b.lengths.iter().map(|x| x.to_string()).collect()),
            ])
            .args([
                "--head-dims",
                &join(b.head_dims.iter().map(|x| x.to_string()).collect()),
            ])
            .args([
                "--windows",
                &join(b.windows.iter().map(|x| x.to_string()).collect()),
            ])
            .args([
                "--sparsities",
                &join(b.sparsities.iter().map(|x| x.to_string()).collect()),
            ])
            .args([
                "--heads",
                &b.heads.to_string(),
                "--reps",
                &b.reps.to_string(),
            ])
            .output()
            .with_context(|| format!("cannot run {} for the peers", b.python))?;
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
        ensure!(out.status.success(), "the peer script failed");
        for line in String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.starts_with('#'))
        {
            let f: Vec<&str> = line.split(',').collect();
            if f.len() == 8 {
                rows.push(Row {
                    imp: f[0].into(),
                    case: f[1].into(),
                    len: f[2].parse()?,
                    dim: f[3].parse()?,
                    window: f[4].parse()?,
                    sparsity: f[5].parse()?,
                    fwd_ms: f[6].parse()?,
                    fwdbwd_ms: f[7].parse()?,
                });
            }
        }
    }
    for &len in &b.lengths {
        for &d in &b.head_dims {
            tch::manual_seed(0);
            let mk = || Tensor::randn([1, b.heads, len, d], (Kind::BFloat16, dev));
            let (q, k, v) = (mk(), mk(), mk());
            for &w in &b.windows {
                let (f, fb) = time_op(b.reps, &q, &k, &v, |q, k, v| {
                    kern.list_attention(q, k, v, None, w).expect("kernel")
                });
                rows.push(Row {
                    imp: "ours".into(),
                    case: "swa".into(),
                    len,
                    dim: d,
                    window: w,
                    sparsity: 0.0,
                    fwd_ms: f,
                    fwdbwd_ms: fb,
                });
            }
            for &s in &b.sparsities {
                let n = ((len as f64 * (1.0 - s)).round() as i64).max(1);
                let pos = Tensor::randperm(len, (Kind::Int64, dev))
                    .narrow(0, 0, n)
                    .sort(0, false)
                    .0;
                let qpos = pos
                    .to_kind(Kind::Int)
                    .view([1, 1, n])
                    .expand([1, b.heads, n], false)
                    .contiguous();
                let nq = Tensor::full([1, b.heads], n, (Kind::Int, dev));
                let qc = q.index_select(2, &pos).contiguous();
                let (f, fb) = time_op(b.reps, &qc, &k, &v, |q, k, v| {
                    kern.list_attention(q, k, v, Some((&qpos, &nq)), len)
                        .expect("kernel")
                });
                rows.push(Row {
                    imp: "ours".into(),
                    case: "sparse".into(),
                    len,
                    dim: d,
                    window: len,
                    sparsity: s,
                    fwd_ms: f,
                    fwdbwd_ms: fb,
                });
            }
        }
    }
    let csv_path = b.out.join("attention_bench.csv");
    let mut w = csv::Writer::from_path(&csv_path)?;
    w.write_record([
        "impl",
        "case",
        "L",
        "D",
        "window",
        "sparsity",
        "fwd_ms",
        "fwdbwd_ms",
        "fwd_tflops",
        "fwd_vs_cudnn_causal",
        "fwdbwd_vs_cudnn_causal",
    ])?;
    let cudnn = |r: &Row| {
        rows.iter()
            .find(|c| c.imp == "sdpa_cudnn" && c.len == r.len && c.dim == r.dim)
            .cloned()
    };
    for r in &rows {
        let tflops = 4.0 * pairs(r, b.heads) * r.dim as f64 / (r.fwd_ms * 1e-3) / 1e12;
        let (sf, sb) = cudnn(r).map_or((f64::NAN, f64::NAN), |c| {
            (c.fwd_ms / r.fwd_ms, c.fwdbwd_ms / r.fwdbwd_ms)
        });
        w.write_record([
            r.imp.clone(),
            r.case.clone(),
            r.len.to_string(),
            r.dim.to_string(),
            r.window.to_string(),
            r.sparsity.to_string(),
            format!("{:.4}", r.fwd_ms),
            format!("{:.4}", r.fwdbwd_ms),
            format!("{:.1}", tflops),
            format!("{:.3}", sf),
            format!("{:.3}", sb),
        ])?;
    }
    w.flush()?;
    // Speed-up of sparse-query attention over dense causal cuDNN, against sparsity.
    let mut series = Vec::new();
    for imp in ["ours", "flex"] {
        for &len in &b.lengths {
            for &d in &b.head_dims {
                let pts: Vec<(f64, f64)> = rows
                    .iter()
                    .filter(|r| r.imp == imp && r.case == "sparse" && r.len == len && r.dim == d)
                    .filter_map(|r| cudnn(r).map(|c| (r.sparsity, c.fwd_ms / r.fwd_ms)))
                    .collect();
                if !pts.is_empty() {
                    series.push(Series {
                        name: format!("{imp} L={len} D={d}"),
                        points: pts,
                        line: true,
                        labels: vec![],
                    });
                }
            }
        }
    }
    if !series.is_empty() {
        Figure::Lines {
            title: "Sparse-query attention: forward speed-up over cuDNN causal".into(),
            x: "fraction of queries skipped".into(),
            y: "speed-up (x)".into(),
            series,
            log_x: false,
        }
        .save(&b.out.join("attention_speedup"))?;
    }
    Ok(csv_path)
}
