//! Where a profiled training step's GPU time goes: the kernels of a Chrome trace (ours from
//! `Kernels::profile_stop`, the peer's from `torch.profiler`) summed by name and by kind, so
//! both implementations are read by the same rule.

use crate::util::atomic;
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What a kernel does, from its name: the first kind one of whose patterns the lower-case name
/// contains. Our kernels' names (`kernels/*.cu`), cuBLAS', cuDNN's and FlashAttention's,
/// ATen's, and Inductor's (`triton_*`, a norm fused with its neighbours named by its `rsqrt`).
const KINDS: [(&str, &[&str]); 7] = [
    (
        "attention",
        &[
            "list_kernel",
            "decode_split",
            "decode_combine",
            "kv_kernel",
            "dq_kernel",
            "dkdv_kernel",
            "far_",
            "row_dot",
            "route_kernel",
            "list_rows",
            "flash",
            "fmha",
            "sdpa",
            "attention",
            "triton_tem",
        ],
    ),
    (
        "matmul",
        &["gemm", "nvjet", "cutlass", "xmma", "cublas", "gemv"],
    ),
    // Before the norms: the gradient clipping's norm kernels (ATen's `lpnorm`) are the
    // optimizer's, as our `sumsq_kernel` is.
    (
        "optimizer",
        &["adam", "multi_tensor", "foreach", "sumsq", "lpnorm"],
    ),
    ("norm", &["norm", "rsqrt"]),
    (
        "loss",
        &[
            "ce_forward",
            "ce_backward",
            "cross_entropy",
            "log_softmax",
            "nll_loss",
        ],
    ),
    ("router", &["router", "aha_gates", "st_mix"]),
    (
        "elementwise",
        &[
            "swiglu",
            "silu",
            "heads_kernel",
            "rope",
            "elementwise",
            "triton",
            "copy",
            "fill",
        ],
    ),
];

/// The kind of the kernel named `name` (`other` where no pattern matches).
pub(super) fn kind(name: &str) -> &'static str {
    let name = name.to_lowercase();
    KINDS
        .iter()
        .find(|(_, pats)| pats.iter().any(|p| name.contains(p)))
        .map_or("other", |(k, _)| k)
}

/// One kernel name's calls and total time (ms) in a trace.
#[derive(Debug, PartialEq)]
pub(super) struct KernelTime {
    pub(super) name: String,
    pub(super) calls: usize,
    pub(super) ms: f64,
}

/// The kernels of the Chrome trace at `path` (events of category `kernel`), by name, most time
/// first.
pub(super) fn kernel_times(path: &Path) -> Result<Vec<KernelTime>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the trace {}", path.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a Chrome trace (JSON)", path.display()))?;
    let Some(events) = json.get("traceEvents").and_then(|e| e.as_array()) else {
        bail!("{} has no traceEvents: not a Chrome trace", path.display());
    };
    let mut by_name: BTreeMap<String, (usize, f64)> = BTreeMap::new();
    for e in events {
        if e.get("cat").and_then(|c| c.as_str()) != Some("kernel") {
            continue;
        }
        let name = e.get("name").and_then(|n| n.as_str()).unwrap_or("");
        let Some(us) = e
            .get("dur")
            .and_then(|d| d.as_f64())
            .filter(|d| d.is_finite())
        else {
            bail!("{}: kernel {name:?} has no finite duration", path.display());
        };
        let t = by_name.entry(name.to_string()).or_default();
        t.0 += 1;
        t.1 += us / 1e3;
    }
    let mut out: Vec<KernelTime> = by_name
        .into_iter()
        .map(|(name, (calls, ms))| KernelTime { name, calls, ms })
        .collect();
    out.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    Ok(out)
}

/// Every trace (`*.json`) in `dir` summarised: `kernel_time.csv` (a row per trace and kernel
/// name, with its kind) and `kernel_kinds.csv` (a row per trace and kind, with its share of
/// the trace's kernel time). Without traces (they are large, and not always kept) an existing
/// `kernel_time.csv` is read back instead and its kinds drawn again by today's rule. Returns
/// the paths written (none where there is neither).
pub(super) fn summarise(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut traces: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    traces.sort();
    let by_name = dir.join("kernel_time.csv");
    let per_trace: Vec<(String, Vec<KernelTime>)> = match (traces.is_empty(), by_name.exists()) {
        (false, _) => traces
            .iter()
            .map(|t| {
                let stem = t
                    .file_stem()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .to_string();
                kernel_times(t).map(|k| (stem, k))
            })
            .collect::<Result<_>>()?,
        (true, true) => read_kernel_times(&by_name)?,
        (true, false) => return Ok(Vec::new()),
    };
    let (mut names, mut kinds) = (Vec::new(), Vec::new());
    for (stem, times) in &per_trace {
        let total: f64 = times.iter().map(|k| k.ms).sum();
        let mut by_kind: BTreeMap<&str, (usize, f64)> = BTreeMap::new();
        for k in times {
            let e = by_kind.entry(kind(&k.name)).or_default();
            e.0 += k.calls;
            e.1 += k.ms;
            names.push(vec![
                stem.clone(),
                kind(&k.name).to_string(),
                k.name.clone(),
                k.calls.to_string(),
                format!("{:.4}", k.ms),
            ]);
        }
        for (k, (calls, ms)) in by_kind {
            kinds.push(vec![
                stem.clone(),
                k.to_string(),
                calls.to_string(),
                format!("{ms:.3}"),
                format!("{:.3}", ms / total.max(f64::MIN_POSITIVE)),
            ]);
        }
    }
    atomic::write_csv(
        &by_name,
        &["trace", "kind", "kernel", "calls", "ms"],
        &names,
    )?;
    let by_kind = dir.join("kernel_kinds.csv");
    atomic::write_csv(&by_kind, &["trace", "kind", "calls", "ms", "share"], &kinds)?;
    Ok(vec![by_name, by_kind])
}

/// The kernels of each trace as an earlier `summarise` wrote them, in its order.
fn read_kernel_times(path: &Path) -> Result<Vec<(String, Vec<KernelTime>)>> {
    let mut r =
        csv::Reader::from_path(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut out: Vec<(String, Vec<KernelTime>)> = Vec::new();
    for (i, rec) in r.records().enumerate() {
        let rec = rec.with_context(|| format!("{} row {}", path.display(), i + 2))?;
        let field = |j: usize| rec.get(j).unwrap_or_default();
        let bad = || {
            format!(
                "{} row {}: not a kernel_time.csv row",
                path.display(),
                i + 2
            )
        };
        let calls: usize = field(3).parse().with_context(bad)?;
        let ms: f64 = field(4).parse().with_context(bad)?;
        anyhow::ensure!(ms.is_finite(), "{}: time {ms} is not finite", bad());
        let k = KernelTime {
            name: field(2).to_string(),
            calls,
            ms,
        };
        match out.last_mut() {
            Some((t, ks)) if t == field(0) => ks.push(k),
            _ => out.push((field(0).to_string(), vec![k])),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names of ours, cuBLAS', cuDNN's, ATen's and Inductor's kernels fall in their kinds.
    #[test]
    fn kernels_are_sorted_into_kinds_by_name() {
        for (name, want) in [
            (
                "void attnsweep::list_kernel<128, 128, false, false>(...)",
                "attention",
            ),
            (
                "cudnn_generated_fort_native_sdpa_sm90_flash_fprop",
                "attention",
            ),
            ("triton_tem_fused_flex_attention_0", "attention"),
            ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "matmul"),
            ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmul"),
            ("void attnsweep::norm_backward_wide<bf16, true, 8>", "norm"),
            ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
            ("void attnsweep::ce_forward<bf16>", "loss"),
            ("void attnsweep::adamw_kernel(...)", "optimizer"),
            (
                "void at::native::lpnorm_cleanup<float, (at::native::NormType)1>",
                "optimizer",
            ),
            ("triton_poi_fused__unsafe_view_mul_silu_7", "elementwise"),
            (
                "void at::vectorized_elementwise_kernel<4, FillFunctor>",
                "elementwise",
            ),
            ("something_else", "other"),
        ] {
            assert_eq!(kind(name), want, "{name}");
        }
    }

    /// Kernel events summed by name (other categories ignored), and summarised by kind with
    /// their shares; a trace without durations is refused by name.
    #[test]
    fn traces_sum_by_name_and_kind() {
        let dir = crate::util::scratch_dir("kernel-times");
        let trace = |events: &str| format!("{{\"traceEvents\": [{events}]}}");
        std::fs::write(
            dir.join("m_attnsweep_full_L8.json"),
            trace(
                r#"{"cat": "kernel", "name": "nvjet_a", "dur": 3000.0},
                   {"cat": "kernel", "name": "nvjet_a", "dur": 1000.0},
                   {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 99.0},
                   {"cat": "kernel", "name": "norm_forward", "dur": 1000.0}"#,
            ),
        )
        .unwrap();
        let t = kernel_times(&dir.join("m_attnsweep_full_L8.json")).unwrap();
        assert_eq!(
            t,
            [
                KernelTime {
                    name: "nvjet_a".into(),
                    calls: 2,
                    ms: 4.0
                },
                KernelTime {
                    name: "norm_forward".into(),
                    calls: 1,
                    ms: 1.0
                },
            ]
        );
        summarise(&dir).unwrap();
        let kinds = std::fs::read_to_string(dir.join("kernel_kinds.csv")).unwrap();
        assert!(
            kinds.contains("m_attnsweep_full_L8,matmul,2,4.000,0.800"),
            "{kinds}"
        );
        assert!(
            kinds.contains("m_attnsweep_full_L8,norm,1,1.000,0.200"),
            "{kinds}"
        );
        std::fs::write(
            dir.join("bad.json"),
            trace(r#"{"cat": "kernel", "name": "k"}"#),
        )
        .unwrap();
        let e = format!("{:#}", summarise(&dir).unwrap_err());
        assert!(
            e.contains("bad.json") && e.contains("no finite duration"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
