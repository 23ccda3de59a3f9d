//! `attnsweep bench attention`: the attention kernels beside their peers, timed in one run on
//! the same shapes: our sliding-window and sparse-query kernels here, SDPA (cuDNN, flash) and
//! FlexAttention in `kernels/bench_peers.py`, run by this command; it writes one CSV and the
//! speed-up-against-sparsity figure (L2A Fig. 8). What the training bench (`bench_train.rs`)
//! shares with it: running a peer script, writing a CSV.

use crate::model::attention::{routed_paths, KeyPattern};
use crate::model::kernels::{self, Kernels, PpaOffsets};
use crate::sweep::{Figure, Look, Panel, Series, XAxis};
use crate::util::atomic;
use crate::util::flags::finite_flag;
use crate::util::stats::median;
use anyhow::{ensure, Context, Result};
use clap::Args;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

#[derive(Args)]
pub(crate) struct BenchAttentionCmd {
    /// Sequence lengths.
    #[arg(long, value_delimiter = ',', default_value = "4096,16384,32768")]
    lengths: Vec<i64>,
    /// Head dimensions.
    #[arg(long, value_delimiter = ',', default_value = "64,128")]
    head_dims: Vec<i64>,
    /// Sliding windows.
    #[arg(long, value_delimiter = ',', default_value = "256,1024")]
    windows: Vec<i64>,
    /// Fractions of queries skipped by sparse-query attention.
    #[arg(long, value_parser = finite_flag, value_delimiter = ',', default_value = "0.5,0.8,0.9,0.95")]
    sparsities: Vec<f64>,
    /// Routed attention (AHA): fractions of (token, head) pairs on the full prefix, the rest
    /// on each of the windows.
    #[arg(long, value_parser = finite_flag, value_delimiter = ',', default_value = "0.1")]
    routed_usages: Vec<f64>,
    /// PPA powers p (window plus the power offsets S_p).
    #[arg(long, value_parser = finite_flag, value_delimiter = ',', default_value = "0.25,0.5,0.75")]
    ppa_powers: Vec<f64>,
    /// Sliding window of the PPA cases.
    #[arg(long, default_value_t = 64)]
    ppa_window: i64,
    /// Query (and key-value) heads; batch 1.
    #[arg(long, default_value_t = 16)]
    heads: i64,
    /// Calls per measurement, for ours and the peers alike: the fwd_ms / fwdbwd_ms columns time
    /// this many calls back to back between two CUDA events (launch time hidden; the median of
    /// three such batches, per call), the *_host_ms columns each call alone between
    /// synchronisations (launch time included; the median).
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// Output directory.
    #[arg(long, default_value = "results/bench")]
    out: PathBuf,
    /// Python with torch for the peers.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Skip the peers (our kernels only).
    #[arg(long)]
    no_peers: bool,
    /// Run no case: draw the figure in --out again from the attention_bench.csv a run wrote
    /// there (the other flags are not read).
    #[arg(long)]
    redraw: bool,
}

/// `attnsweep bench attention`.
pub(crate) fn run_cmd(c: BenchAttentionCmd) -> Result<()> {
    if c.redraw {
        println!("{}", redraw(&c.out)?.display());
        return Ok(());
    }
    let b = AttentionBench {
        lengths: c.lengths,
        head_dims: c.head_dims,
        windows: c.windows,
        sparsities: c.sparsities,
        routed_usages: c.routed_usages,
        ppa_powers: c.ppa_powers,
        ppa_window: c.ppa_window,
        heads: c.heads,
        reps: c.reps,
        out: c.out,
        python: c.python,
        peers: !c.no_peers,
    };
    b.validate()?;
    let kern = kernels::cuda().context(
        "bench attention needs a GPU and a CUDA kernel library (attnsweep kernels build)",
    )?;
    println!("{}", run(&b, kern)?.display());
    Ok(())
}

pub(crate) struct AttentionBench {
    pub(crate) lengths: Vec<i64>,
    pub(crate) head_dims: Vec<i64>,
    pub(crate) windows: Vec<i64>,
    pub(crate) sparsities: Vec<f64>,
    /// Fractions of (token, head) pairs routed to the full prefix (the rest to the window).
    pub(crate) routed_usages: Vec<f64>,
    /// PPA powers, each with `ppa_window`.
    pub(crate) ppa_powers: Vec<f64>,
    pub(crate) ppa_window: i64,
    pub(crate) heads: i64,
    pub(crate) reps: usize,
    pub(crate) out: PathBuf,
    pub(crate) python: String,
    pub(crate) peers: bool,
}

/// Every value of `flag` satisfies `ok`, or an error names the flag, what it needs and the
/// value.
fn check_each<T: std::fmt::Display + Copy>(
    flag: &str,
    values: &[T],
    ok: impl Fn(T) -> bool,
    need: &str,
) -> Result<()> {
    for &v in values {
        ensure!(ok(v), "{flag} {need} (got {v})");
    }
    Ok(())
}

/// At least one length, each at least 1, none twice (each is a point of the fitted
/// exponents).
pub(super) fn check_lengths(lengths: &[i64]) -> Result<()> {
    ensure!(!lengths.is_empty(), "--lengths needs at least one length");
    check_each("--lengths", lengths, |l| l >= 1, "must be at least 1")?;
    let mut distinct = lengths.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    ensure!(
        distinct.len() == lengths.len(),
        "--lengths repeats a length ({lengths:?})"
    );
    Ok(())
}

impl AttentionBench {
    /// The flags, checked before anything runs or is written.
    pub(crate) fn validate(&self) -> Result<()> {
        check_lengths(&self.lengths)?;
        ensure!(
            !self.head_dims.is_empty(),
            "--head-dims needs at least one head_dim"
        );
        check_each(
            "--head-dims",
            &self.head_dims,
            |d| d == 64 || d == 128,
            "must be 64 or 128, the kernels' head dims",
        )?;
        check_each("--windows", &self.windows, |w| w >= 1, "must be at least 1")?;
        check_each(
            "--sparsities",
            &self.sparsities,
            |s| (0.0..1.0).contains(&s),
            "must lie in [0, 1)",
        )?;
        check_each(
            "--routed-usages",
            &self.routed_usages,
            |u| (0.0..=1.0).contains(&u),
            "must lie in [0, 1]",
        )?;
        check_each(
            "--ppa-powers",
            &self.ppa_powers,
            |p| (0.0..=1.0).contains(&p),
            "must lie in [0, 1]",
        )?;
        ensure!(self.ppa_window >= 1, "--ppa-window must be at least 1");
        ensure!(self.heads >= 1, "--heads must be at least 1");
        ensure!(self.reps >= 1, "--reps must be at least 1");
        Ok(())
    }
}

/// Values as one comma-separated flag value.
pub(super) fn joined<T: std::fmt::Display>(values: &[T]) -> String {
    values
        .iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Runs the peer script `kernels/<name>` (its text as built into this binary) with its
/// `flags` and returns what it printed. The script runs from a scratch file; `out` records
/// which one ran, `<name>.sha256` (`sha256sum -c` reads it from the repository's root) with the
/// commit the binary was built from, rather than a copy. A peer that cannot start or fails is
/// reported and leaves its rows out (those printed before it failed are kept): our own cases
/// still run and are written.
pub(super) fn run_peer(
    out: &Path,
    python: &str,
    name: &str,
    text: &str,
    flags: &[(&str, String)],
) -> Result<String> {
    let digest: String = Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    atomic::write_bytes(
        &out.join(format!("{name}.sha256")),
        format!(
            "{digest}  kernels/{name}\n# kernels/{name} of commit {}, built into the attnsweep that ran it\n",
            env!("ATTNSWEEP_COMMIT")
        )
        .as_bytes(),
    )?;
    let scratch = std::env::temp_dir().join(format!(
        "attnsweep-peer-{}-{digest}-{name}",
        std::process::id()
    ));
    std::fs::write(&scratch, text)
        .with_context(|| format!("cannot write the peer script to {}", scratch.display()))?;
    let args = flags.iter().flat_map(|(f, v)| [*f, v.as_str()]);
    let ran = Command::new(python).arg(&scratch).args(args).output();
    let _ = std::fs::remove_file(&scratch);
    match ran {
        Ok(o) => {
            eprint!("{}", String::from_utf8_lossy(&o.stderr));
            if !o.status.success() {
                eprintln!(
                    "warning: the peer {name} failed ({}); its missing rows are left out",
                    o.status
                );
            }
            Ok(String::from_utf8_lossy(&o.stdout).into_owned())
        }
        Err(e) => {
            eprintln!(
                "warning: cannot run {python} for the peer {name} ({e}); its rows are left out"
            );
            Ok(String::new())
        }
    }
}

#[derive(Clone, Debug)]
struct Row {
    imp: String,
    case: String,
    len: i64,
    dim: i64,
    window: i64,
    sparsity: f64,
    /// One call's time with the host's launch time hidden (calls back to back, see `times`).
    fwd_ms: f64,
    fwdbwd_ms: f64,
    /// One call alone between synchronisations, on the host's clock: launch time included.
    fwd_host_ms: f64,
    fwdbwd_host_ms: f64,
}

/// Forward and forward-and-backward times of one operation under both protocols.
struct Times {
    fwd: (f64, f64),
    fwdbwd: (f64, f64),
}

impl Row {
    /// A row of our kernels' times.
    fn ours(case: String, len: i64, dim: i64, window: i64, sparsity: f64, t: Times) -> Row {
        Row {
            imp: "ours".into(),
            case,
            len,
            dim,
            window,
            sparsity,
            fwd_ms: t.fwd.0,
            fwdbwd_ms: t.fwdbwd.0,
            fwd_host_ms: t.fwd.1,
            fwdbwd_host_ms: t.fwdbwd.1,
        }
    }

    /// The backward's share of the timed forward-and-backward pair.
    fn bwd_ms(&self) -> f64 {
        self.fwdbwd_ms - self.fwd_ms
    }
}

/// Milliseconds one call of `f` takes, by the protocol every implementation in the bench is
/// timed with (ours here, the peers in `kernels/bench_peers.py`), after three calls to warm
/// up: (device, host). Device: `reps` calls back to back between one pair of CUDA events,
/// divided by `reps`, the median of three such batches; the host queues the next call while
/// the GPU runs the last, so launch overhead (large for a compiled Python call, small for ours)
/// is hidden for every implementation alike. Host: each call alone between synchronisations
/// on the host's clock, the median over `reps`: what a caller waiting on each call sees. Without
/// CUDA both are host time.
fn times(kern: &Kernels, reps: usize, mut f: impl FnMut()) -> (f64, f64) {
    for _ in 0..3 {
        f();
    }
    let sync = || {
        if kern.cuda {
            tch::Cuda::synchronize(0)
        }
    };
    let host = |f: &mut dyn FnMut()| {
        sync();
        let start = Instant::now();
        f();
        sync();
        start.elapsed().as_secs_f64() * 1e3
    };
    let device = match kern.cuda {
        true => {
            let (start, end) = (
                kern.event().expect("CUDA event"),
                kern.event().expect("CUDA event"),
            );
            sync();
            (0..3)
                .map(|_| {
                    start.record().expect("CUDA event");
                    for _ in 0..reps {
                        f();
                    }
                    end.record().expect("CUDA event");
                    end.ms_since(&start).expect("CUDA event") / reps as f64
                })
                .collect()
        }
        false => (0..reps).map(|_| host(&mut f)).collect(),
    };
    let host_ms = median((0..reps).map(|_| host(&mut f)).collect());
    (median(device), host_ms)
}

/// The rows a peer script printed: `impl,case,L,D,window,sparsity,fwd_ms,fwdbwd_ms,
/// fwd_host_ms,fwdbwd_host_ms`; comment lines (`#`) and lines of another shape are skipped.
fn peer_rows(printed: &str) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for line in printed.lines().filter(|l| !l.starts_with('#')) {
        let f: Vec<&str> = line.split(',').collect();
        if f.len() != 10 {
            continue;
        }
        let num = |i: usize| -> Result<f64> {
            let v: f64 = f[i].parse()?;
            ensure!(
                v.is_finite(),
                "the peer printed a non-finite time in {line:?}"
            );
            Ok(v)
        };
        rows.push(Row {
            imp: f[0].into(),
            case: f[1].into(),
            len: f[2].parse()?,
            dim: f[3].parse()?,
            window: f[4].parse()?,
            sparsity: num(5)?,
            fwd_ms: num(6)?,
            fwdbwd_ms: num(7)?,
            fwd_host_ms: num(8)?,
            fwdbwd_host_ms: num(9)?,
        });
    }
    Ok(rows)
}

/// Forward, and forward with the gradients of q, k and v, of one operation. The backward is
/// seeded with dO = 1 (a fill inside the timed call) and returns the gradients instead of adding
/// them to `.grad`: the peers' script does the same (`torch.autograd.grad`), so neither side
/// pays for a loss product or for accumulating into earlier gradients, work that is not
/// attention (at L 16384, D 128 about 0.1 ms each). The kernels' time does not depend on dO's
/// values.
fn time_op(
    kern: &Kernels,
    reps: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    op: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
) -> Times {
    let fwd = tch::no_grad(|| times(kern, reps, || drop(op(q, k, v))));
    let (qg, kg, vg) = (
        q.detach().set_requires_grad(true),
        k.detach().set_requires_grad(true),
        v.detach().set_requires_grad(true),
    );
    let fwdbwd = times(kern, reps, || {
        drop(Tensor::run_backward(
            &[op(&qg, &kg, &vg)],
            &[&qg, &kg, &vg],
            false,
            false,
        ))
    });
    Times { fwd, fwdbwd }
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
        c if c.starts_with("ppa_p") => {
            let power = c["ppa_p".len()..].parse().expect("ppa_p<power>");
            let pattern = KeyPattern::Ppa {
                power,
                window: r.window as usize,
            };
            pattern.attended_pairs(r.len as usize) as f64
        }
        "routed" => {
            let w = (r.window as f64).min(l);
            let window = w * l - w * (w - 1.0) / 2.0;
            (1.0 - r.sparsity) * l * (l + 1.0) / 2.0 + r.sparsity * window
        }
        _ => l * (l + 1.0) / 2.0,
    };
    per_seq * heads as f64
}

/// Least-squares slope of ln y against ln x: e in y ~ x^e.
fn log_slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0.ln()).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1.ln()).sum::<f64>() / n;
    let sxy: f64 = points
        .iter()
        .map(|p| (p.0.ln() - mx) * (p.1.ln() - my))
        .sum();
    let sxx: f64 = points.iter().map(|p| (p.0.ln() - mx).powi(2)).sum();
    sxy / sxx
}

/// How one case's time grows with L over the bench's lengths: the fitted exponents of
/// forward and forward+backward time and of the attended pairs (PPA's should grow like
/// L^(1+p), as its pairs do).
#[derive(Debug)]
struct Scaling {
    imp: String,
    case: String,
    dim: i64,
    window: i64,
    sparsity: f64,
    lengths: Vec<i64>,
    fwd: f64,
    fwdbwd: f64,
    pairs: f64,
}

/// One `Scaling` per (impl, case, D, window, sparsity) timed at two or more lengths (a
/// failed measurement, not finite, is left out); a window of L or more (causal, sparse
/// queries) is the whole prefix at every length, window -1. In the order the rows first name
/// them.
fn scaling(rows: &[Row], heads: i64) -> Vec<Scaling> {
    let window_of = |r: &Row| if r.window >= r.len { -1 } else { r.window };
    let key = |r: &Row| {
        (
            r.imp.clone(),
            r.case.clone(),
            r.dim,
            window_of(r),
            r.sparsity.to_bits(),
        )
    };
    let mut done = Vec::new();
    let mut out: Vec<Scaling> = Vec::new();
    for r in rows {
        if done.contains(&key(r)) {
            continue;
        }
        done.push(key(r));
        let group: Vec<&Row> = rows
            .iter()
            .filter(|c| key(c) == key(r))
            .filter(|c| {
                c.fwd_ms.is_finite()
                    && c.fwdbwd_ms.is_finite()
                    && c.fwd_ms > 0.0
                    && c.fwdbwd_ms > 0.0
            })
            .collect();
        if group.len() < 2 {
            continue;
        }
        let fit = |f: &dyn Fn(&Row) -> f64| {
            log_slope(
                &group
                    .iter()
                    .map(|c| (c.len as f64, f(c)))
                    .collect::<Vec<_>>(),
            )
        };
        out.push(Scaling {
            imp: r.imp.clone(),
            case: r.case.clone(),
            dim: r.dim,
            window: window_of(r),
            sparsity: r.sparsity,
            lengths: group.iter().map(|c| c.len).collect(),
            fwd: fit(&|c| c.fwd_ms),
            fwdbwd: fit(&|c| c.fwdbwd_ms),
            pairs: fit(&|c| pairs(c, heads)),
        });
    }
    out
}

/// `attention_scaling.csv`.
fn write_scaling(rows: &[Scaling], path: &Path) -> Result<()> {
    let header = [
        "impl",
        "case",
        "D",
        "window",
        "sparsity",
        "lengths",
        "fwd_exponent",
        "fwdbwd_exponent",
        "pairs_exponent",
    ];
    let records: Vec<Vec<String>> = rows
        .iter()
        .map(|s| {
            let lengths: Vec<String> = s.lengths.iter().map(|l| l.to_string()).collect();
            vec![
                s.imp.clone(),
                s.case.clone(),
                s.dim.to_string(),
                s.window.to_string(),
                s.sparsity.to_string(),
                lengths.join(" "),
                format!("{:.3}", s.fwd),
                format!("{:.3}", s.fwdbwd),
                format!("{:.3}", s.pairs),
            ]
        })
        .collect();
    atomic::write_csv(path, &header, &records)
}

pub(crate) fn run(b: &AttentionBench, kern: &Kernels) -> Result<PathBuf> {
    ensure!(
        kern.cuda && tch::Cuda::is_available(),
        "bench attention needs a GPU and the CUDA kernel library"
    );
    std::fs::create_dir_all(&b.out)?;
    let mut rows: Vec<Row> = Vec::new();
    // The peers first: their process must find the GPU's memory free.
    if b.peers {
        rows.extend(peer_attention_rows(b)?);
    }
    for &len in &b.lengths {
        for &d in &b.head_dims {
            rows.extend(our_attention_rows(b, kern, len, d));
        }
    }
    let csv_path = b.out.join("attention_bench.csv");
    write_attention_csv(b, &rows, &csv_path)?;
    write_scaling(
        &scaling(&rows, b.heads),
        &b.out.join("attention_scaling.csv"),
    )?;
    write_speedup_figure(&b.out, &rows)?;
    Ok(csv_path)
}

/// The peers' rows (SDPA's backends, FlexAttention), timed by `kernels/bench_peers.py` in a
/// process of their own.
fn peer_attention_rows(b: &AttentionBench) -> Result<Vec<Row>> {
    let flags = [
        ("--lengths", joined(&b.lengths)),
        ("--head-dims", joined(&b.head_dims)),
        ("--windows", joined(&b.windows)),
        ("--sparsities", joined(&b.sparsities)),
        ("--routed-usages", joined(&b.routed_usages)),
        ("--ppa-powers", joined(&b.ppa_powers)),
        ("--ppa-window", b.ppa_window.to_string()),
        ("--heads", b.heads.to_string()),
        ("--reps", b.reps.to_string()),
    ];
    let printed = run_peer(
        &b.out,
        &b.python,
        "bench_peers.py",
        include_str!("../../kernels/bench_peers.py"),
        &flags,
    )?;
    peer_rows(&printed)
}

/// Our kernels on every case at one length and head dim: windows, sparse queries, routed
/// queries and PPA, on one set of random q, k, v.
fn our_attention_rows(b: &AttentionBench, kern: &Kernels, len: i64, d: i64) -> Vec<Row> {
    let dev = Device::Cuda(0);
    let mut rows = Vec::new();
    tch::manual_seed(0);
    let mk = || Tensor::randn([1, b.heads, len, d], (Kind::BFloat16, dev));
    let (q, k, v) = (mk(), mk(), mk());
    for &w in &b.windows {
        let t = time_op(kern, b.reps, &q, &k, &v, |q, k, v| {
            kern.list_attention(q, k, v, None, w).expect("kernel")
        });
        rows.push(Row::ours("swa".into(), len, d, w, 0.0, t));
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
        let t = time_op(kern, b.reps, &qc, &k, &v, |q, k, v| {
            kern.list_attention(q, k, v, Some((&qpos, &nq)), len)
                .expect("kernel")
        });
        rows.push(Row::ours("sparse".into(), len, d, len, s, t));
    }
    for &w in &b.windows {
        for &u in &b.routed_usages {
            // The gate pattern is an input, built outside the timed call as the
            // other cases' query lists are.
            let on = Tensor::rand([1, b.heads, len], (Kind::Float, dev)).lt(u);
            let paths = routed_paths(&on);
            let t = time_op(kern, b.reps, &q, &k, &v, |q, k, v| {
                kern.routed_attention(q, k, v, &paths, w)
                    .expect("routed attention on the bench's inputs")
            });
            rows.push(Row::ours("routed".into(), len, d, w, 1.0 - u, t));
        }
    }
    for &p in &b.ppa_powers {
        let pattern = KeyPattern::Ppa {
            power: p,
            window: b.ppa_window as usize,
        };
        let offsets = pattern.offsets_beyond_window(len as usize);
        let offsets = PpaOffsets::new(&offsets, b.ppa_window as usize, dev);
        let t = time_op(kern, b.reps, &q, &k, &v, |q, k, v| {
            match offsets.tensor.numel() {
                0 => kern.list_attention(q, k, v, None, b.ppa_window),
                _ => kern.ppa_attention(q, k, v, b.ppa_window, &offsets),
            }
            .expect("kernel")
        });
        // Named as the peer script names it (Python's float repr: 0.0, 0.25).
        rows.push(Row::ours(
            format!("ppa_p{p:?}"),
            len,
            d,
            b.ppa_window,
            0.0,
            t,
        ));
    }
    rows
}

/// `attention_bench.csv`: every row with its TFLOP/s and its speed-ups over the dense peers'
/// forward and backward.
fn write_attention_csv(b: &AttentionBench, rows: &[Row], csv_path: &Path) -> Result<()> {
    // Speed-ups over a dense peer's forward and backward (empty without that peer in the run):
    // cuDNN, the fastest, and FlashAttention-2 (SDPA's flash backend), the paper's reference.
    let over = |name: &str, r: &Row| {
        dense_peer(rows, name, r).map_or([String::new(), String::new()], |c| {
            [
                format!("{:.3}", c.fwd_ms / r.fwd_ms),
                format!("{:.3}", c.bwd_ms() / r.bwd_ms()),
            ]
        })
    };
    let records: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let tflops = 4.0 * pairs(r, b.heads) * r.dim as f64 / (r.fwd_ms * 1e-3) / 1e12;
            let mut rec = vec![
                r.imp.clone(),
                r.case.clone(),
                r.len.to_string(),
                r.dim.to_string(),
                r.window.to_string(),
                r.sparsity.to_string(),
                format!("{:.4}", r.fwd_ms),
                format!("{:.4}", r.bwd_ms()),
                format!("{:.4}", r.fwdbwd_ms),
                format!("{:.4}", r.fwd_host_ms),
                format!("{:.4}", r.fwdbwd_host_ms),
                format!("{:.1}", tflops),
            ];
            rec.extend(over("sdpa_cudnn", r));
            rec.extend(over("sdpa_flash", r));
            rec
        })
        .collect();
    atomic::write_csv(
        csv_path,
        &[
            "impl",
            "case",
            "L",
            "D",
            "window",
            "sparsity",
            "fwd_ms",
            "bwd_ms",
            "fwdbwd_ms",
            "fwd_host_ms",
            "fwdbwd_host_ms",
            "fwd_tflops",
            "fwd_vs_cudnn_causal",
            "bwd_vs_cudnn_causal",
            "fwd_vs_flash_causal",
            "bwd_vs_flash_causal",
        ],
        &records,
    )
}

/// `attention_speedup.png/svg`, or none (and an earlier run's removed) without a sparse case
/// beside FlashAttention-2.
fn write_speedup_figure(out: &Path, rows: &[Row]) -> Result<()> {
    let figure = out.join("attention_speedup");
    match speedup_figure(rows) {
        Some(f) => {
            f.save(&figure)?;
        }
        None => {
            // No sparse case beside FlashAttention-2 in this run: an earlier run's figure
            // must not stay.
            for ext in ["png", "svg"] {
                let _ = std::fs::remove_file(figure.with_extension(ext));
            }
        }
    }
    Ok(())
}

/// Runs nothing: draws `out`'s figure from the rows of its attention_bench.csv (read as the
/// peers' rows are, non-finite times refused); returns the figure's stem.
pub(crate) fn redraw(out: &Path) -> Result<PathBuf> {
    let csv_path = out.join("attention_bench.csv");
    ensure!(
        csv_path.exists(),
        "{} does not exist: --redraw draws the figure from the CSV a bench wrote there",
        csv_path.display()
    );
    let mut reader = csv::Reader::from_path(&csv_path)
        .with_context(|| format!("cannot read {}", csv_path.display()))?;
    let header = reader.headers()?.clone();
    // The columns of a peer's printed row, in its order.
    let columns = [
        "impl",
        "case",
        "L",
        "D",
        "window",
        "sparsity",
        "fwd_ms",
        "fwdbwd_ms",
        "fwd_host_ms",
        "fwdbwd_host_ms",
    ]
    .map(|c| {
        header
            .iter()
            .position(|h| h == c)
            .with_context(|| format!("{} has no {c} column", csv_path.display()))
    });
    let columns: Vec<usize> = columns.into_iter().collect::<Result<_>>()?;
    let mut lines = String::new();
    for record in reader.records() {
        let record = record.with_context(|| format!("in {}", csv_path.display()))?;
        let fields: Vec<&str> = columns
            .iter()
            .map(|&i| record.get(i).unwrap_or(""))
            .collect();
        lines.push_str(&fields.join(","));
        lines.push('\n');
    }
    let rows = peer_rows(&lines).with_context(|| format!("in {}", csv_path.display()))?;
    write_speedup_figure(out, &rows)?;
    Ok(out.join("attention_speedup"))
}

/// The row of dense causal peer `name` (`sdpa_cudnn`, `sdpa_flash`) at `r`'s length and
/// head dim.
fn dense_peer<'a>(rows: &'a [Row], name: &str, r: &Row) -> Option<&'a Row> {
    rows.iter()
        .find(|c| c.imp == name && c.len == r.len && c.dim == r.dim)
}

/// L2A Fig. 8: speed-up of sparse-query attention (ours and FlexAttention over compacted
/// queries) over dense causal FlashAttention-2, against the fraction of queries skipped, the
/// forward and the backward in two panels; cuDNN's dense causal kernel is drawn beside as a
/// flat line at its own speed-up. None without FlashAttention-2 or a sparse case in the run.
fn speedup_figure(rows: &[Row]) -> Option<Figure> {
    let flash = |r: &Row| dense_peer(rows, "sdpa_flash", r);
    let sparsities: Vec<f64> = {
        let mut v: Vec<f64> = rows
            .iter()
            .filter(|r| r.case == "sparse")
            .map(|r| r.sparsity)
            .collect();
        v.sort_by(f64::total_cmp);
        v.dedup();
        v
    };
    let mut keys: Vec<(i64, i64)> = rows.iter().map(|r| (r.len, r.dim)).collect();
    keys.sort();
    keys.dedup();
    let panel = |title: &str, ms: fn(&Row) -> f64| {
        let mut series = Vec::new();
        // FlexAttention in each form the peers ran (compiled as default, autotuned, FLASH).
        for imp in ["ours", "flex", "flex_tuned", "flex_flash", "sdpa_cudnn"] {
            for &(len, d) in &keys {
                let pts: Vec<(f64, f64)> = rows
                    .iter()
                    .filter(|r| r.imp == imp && r.len == len && r.dim == d)
                    .filter(|r| r.case == "sparse" || imp == "sdpa_cudnn")
                    .filter_map(|r| flash(r).map(|f| (r, ms(f) / ms(r))))
                    .flat_map(|(r, x)| {
                        // The dense peer has no sparsity: a flat line across the swept ones.
                        let at = if imp == "sdpa_cudnn" {
                            sparsities.clone()
                        } else {
                            vec![r.sparsity]
                        };
                        at.into_iter().map(move |s| (s, x))
                    })
                    .collect();
                if !pts.is_empty() {
                    series.push(Series {
                        name: format!("{imp} L={len} D={d}"),
                        points: pts,
                        line: true,
                        labels: vec![],
                        errors: vec![],
                        look: Look::ByPlace,
                    });
                }
            }
        }
        Panel {
            title: title.into(),
            x: "fraction of queries skipped".into(),
            y: "speed-up over FlashAttention-2 causal (x)".into(),
            series,
            x_axis: XAxis::LinearSwept,
        }
    };
    let panels = vec![
        panel("forward", |r| r.fwd_ms),
        panel("backward", Row::bwd_ms),
    ];
    let sparse = |p: &Panel| p.series.iter().any(|s| !s.name.starts_with("sdpa"));
    panels.iter().all(sparse).then(|| Figure::Panels {
        title: "Sparse-query attention against dense causal attention".into(),
        panels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util;

    /// A peer that fails keeps the rows it printed, one that cannot start gives none, and
    /// neither stops the bench.
    #[test]
    fn failing_peers_leave_their_rows_out_without_stopping_the_bench() {
        let out = util::scratch_dir("peer");
        let script = "import sys\nprint('flex,swa,4096,64,256,0,0.1,0.2')\nsys.exit(3)\n";
        let printed = run_peer(&out, "python3", "peer.py", script, &[]).unwrap();
        assert_eq!(printed.trim(), "flex,swa,4096,64,256,0,0.1,0.2");
        let none = run_peer(&out, "no-such-python-here", "peer.py", script, &[]).unwrap();
        assert!(none.is_empty());
        // The folder records which script ran, its hash as sha256sum writes it, not a copy.
        assert!(!out.join("peer.py").exists());
        let record = std::fs::read_to_string(out.join("peer.py.sha256")).unwrap();
        assert!(
            record.starts_with("addb91c3a80d05b9f24ec085056513ab670258c1ebb7788304344bb8a9dfc1b0  kernels/peer.py\n"),
            "{record}"
        );
        std::fs::remove_dir_all(&out).unwrap();
    }

    /// Peer rows carry both protocols' times; other lines are skipped, a non-finite time
    /// refused.
    #[test]
    fn peer_rows_read_both_protocols() {
        let rows = peer_rows(
            "# a comment\nflex,swa,16384,128,256,0,0.219,1.2,0.334,1.5\nflex,swa,16384,128,256,0,0.2,1.2\n",
        )
        .unwrap();
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert_eq!(
            (r.fwd_ms, r.fwdbwd_ms, r.fwd_host_ms, r.fwdbwd_host_ms),
            (0.219, 1.2, 0.334, 1.5)
        );
        assert!(peer_rows("flex,swa,1,1,1,0,nan,1,1,1\n").is_err());
    }

    fn row(imp: &str, case: &str, len: i64, window: i64, fwd_ms: f64) -> Row {
        Row {
            imp: imp.into(),
            case: case.into(),
            len,
            dim: 128,
            window,
            sparsity: 0.0,
            fwd_ms,
            fwdbwd_ms: 3.0 * fwd_ms,
            fwd_host_ms: fwd_ms,
            fwdbwd_host_ms: 3.0 * fwd_ms,
        }
    }

    /// Fig. 8's panels: speed-ups over FlashAttention-2's forward and backward (the pair's
    /// time less the forward), cuDNN flat across the swept sparsities; none without FA2.
    #[test]
    fn speedup_figure_divides_forward_and_backward_by_flash_attention() {
        let sparse = |imp: &str, s: f64, fwd: f64, fwdbwd: f64| Row {
            sparsity: s,
            fwdbwd_ms: fwdbwd,
            ..row(imp, "sparse", 4096, 4096, fwd)
        };
        let mut rows = vec![
            Row {
                fwdbwd_ms: 10.0,
                ..row("sdpa_flash", "causal", 4096, 4096, 2.0)
            },
            Row {
                fwdbwd_ms: 5.0,
                ..row("sdpa_cudnn", "causal", 4096, 4096, 1.0)
            },
            sparse("ours", 0.5, 1.0, 3.0),
            sparse("ours", 0.9, 0.25, 1.25),
            sparse("flex", 0.9, 0.5, 4.5),
        ];
        let Some(Figure::Panels { panels, .. }) = speedup_figure(&rows) else {
            panic!("two panels expected");
        };
        let points = |p: usize, name: &str| {
            let s = panels[p].series.iter().find(|s| s.name == name).unwrap();
            s.points.clone()
        };
        assert_eq!(points(0, "ours L=4096 D=128"), [(0.5, 2.0), (0.9, 8.0)]);
        assert_eq!(points(1, "ours L=4096 D=128"), [(0.5, 4.0), (0.9, 8.0)]);
        assert_eq!(points(1, "flex L=4096 D=128"), [(0.9, 2.0)]);
        assert_eq!(
            points(0, "sdpa_cudnn L=4096 D=128"),
            [(0.5, 2.0), (0.9, 2.0)]
        );
        assert_eq!(
            points(1, "sdpa_cudnn L=4096 D=128"),
            [(0.5, 2.0), (0.9, 2.0)]
        );
        rows.remove(0);
        assert!(speedup_figure(&rows).is_none());
    }

    /// The figure drawn again from the CSV a run wrote: its rows read back whole, a figure
    /// where the run would draw one; a CSV without a column, or with a time that is not a
    /// finite number, is refused by name.
    #[test]
    fn the_figure_is_redrawn_from_the_csv() {
        let out = util::scratch_dir("attention-redraw");
        let b = AttentionBench {
            lengths: vec![4096],
            head_dims: vec![128],
            windows: vec![],
            sparsities: vec![0.9],
            routed_usages: vec![],
            ppa_powers: vec![],
            ppa_window: 64,
            heads: 16,
            reps: 1,
            out: out.clone(),
            python: "python3".into(),
            peers: true,
        };
        let sparse = Row {
            sparsity: 0.9,
            ..row("ours", "sparse", 4096, 4096, 0.25)
        };
        let rows = vec![row("sdpa_flash", "causal", 4096, 4096, 2.0), sparse];
        let csv_path = out.join("attention_bench.csv");
        write_attention_csv(&b, &rows, &csv_path).unwrap();
        redraw(&out).unwrap();
        assert!(out.join("attention_speedup.png").exists());
        let text = std::fs::read_to_string(&csv_path).unwrap();
        std::fs::write(&csv_path, text.replacen(",0.2500,", ",NaN,", 1)).unwrap();
        assert!(format!("{:#}", redraw(&out).unwrap_err()).contains("non-finite"));
        std::fs::write(&csv_path, text.replacen("fwd_host_ms", "host", 1)).unwrap();
        assert!(format!("{:#}", redraw(&out).unwrap_err()).contains("no fwd_host_ms column"));
        assert!(format!("{:#}", redraw(&out.join("none")).unwrap_err()).contains("does not exist"));
        std::fs::remove_dir_all(&out).unwrap();
    }

    #[test]
    fn scaling_fits_each_cases_exponents() {
        let lengths = [4096i64, 8192, 16384, 32768];
        let mut rows = Vec::new();
        for &l in &lengths {
            let x = l as f64;
            rows.push(row("ours", "ppa_p0.5", l, 64, 1e-6 * x.powf(1.5)));
            rows.push(row("sdpa_cudnn", "causal", l, l, 2e-8 * x * x));
            rows.push(row("ours", "swa", l, 256, 1e-5 * x));
        }
        // A failed peer measurement and a case timed at one length only.
        rows.push(row("flex", "ppa_p0.5", 4096, 64, 1.0));
        rows.push(row("flex", "ppa_p0.5", 8192, 64, f64::NAN));
        let fits = scaling(&rows, 16);
        assert_eq!(fits.len(), 3, "{fits:?}");
        let get = |imp: &str, case: &str| {
            fits.iter()
                .find(|s| s.imp == imp && s.case == case)
                .unwrap()
        };
        let ppa = get("ours", "ppa_p0.5");
        assert_eq!(ppa.lengths, lengths);
        assert!((ppa.fwd - 1.5).abs() < 1e-9 && (ppa.fwdbwd - 1.5).abs() < 1e-9);
        // PPA p = 0.5's attended pairs: the window's, plus L - s per square s >= 64 below L.
        let pattern_pairs = |l: f64| {
            let w = 64.0;
            let squares: f64 = (8..)
                .map(|j: i64| (j * j) as f64)
                .take_while(|&s| s < l)
                .map(|s| l - s)
                .sum();
            w * l - w * (w - 1.0) / 2.0 + squares
        };
        let want = log_slope(&lengths.map(|l| (l as f64, pattern_pairs(l as f64))));
        assert!((ppa.pairs - want).abs() < 1e-9, "{} vs {want}", ppa.pairs);
        assert!((ppa.pairs - 1.28).abs() < 0.02, "{}", ppa.pairs);
        // Causal pairs grow like L^2 (slightly less: L (L + 1) / 2); a fixed window like L.
        let causal = get("sdpa_cudnn", "causal");
        assert!((causal.fwd - 2.0).abs() < 1e-9 && (causal.pairs - 2.0).abs() < 1e-3);
        let swa = get("ours", "swa");
        assert!((swa.fwd - 1.0).abs() < 1e-9 && (swa.pairs - 1.0).abs() < 0.02);
    }
}
