//! Building the kernel library: its sources (compiled into this binary, or read from
//! `$ATTNSWEEP_KERNELS_SRC` for kernel development), the compiler invocation (nvcc for the GPU
//! found, g++ for the CPU variant) against the headers of the active torch, and the cache of
//! finished builds, keyed by a hash of the sources, the interface version, the torch and the
//! GPU architecture.

use crate::util::progress::Progress;
use crate::util::{fnv1a_from, FNV_BASIS};
use anyhow::{ensure, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

const SOURCES: [(&str, &str); 27] = [
    (
        "attention.cu",
        include_str!("../../../kernels/attention.cu"),
    ),
    (
        "attention_sm90.cu",
        include_str!("../../../kernels/attention_sm90.cu"),
    ),
    (
        "attention.cuh",
        include_str!("../../../kernels/attention.cuh"),
    ),
    ("common.cuh", include_str!("../../../kernels/common.cuh")),
    ("decode.cu", include_str!("../../../kernels/decode.cu")),
    ("decode.cuh", include_str!("../../../kernels/decode.cuh")),
    ("loss.cu", include_str!("../../../kernels/loss.cu")),
    ("loss.cuh", include_str!("../../../kernels/loss.cuh")),
    ("norm.cu", include_str!("../../../kernels/norm.cu")),
    ("norm.cuh", include_str!("../../../kernels/norm.cuh")),
    ("optim.cu", include_str!("../../../kernels/optim.cu")),
    ("optim.cuh", include_str!("../../../kernels/optim.cuh")),
    ("rope.cu", include_str!("../../../kernels/rope.cu")),
    ("rope.cuh", include_str!("../../../kernels/rope.cuh")),
    ("swiglu.cu", include_str!("../../../kernels/swiglu.cu")),
    ("swiglu.cuh", include_str!("../../../kernels/swiglu.cuh")),
    ("router.cu", include_str!("../../../kernels/router.cu")),
    ("router.cuh", include_str!("../../../kernels/router.cuh")),
    ("walk.cuh", include_str!("../../../kernels/walk.cuh")),
    ("ops.cpp", include_str!("../../../kernels/ops.cpp")),
    ("guard.h", include_str!("../../../kernels/guard.h")),
    ("dist.cpp", include_str!("../../../kernels/dist.cpp")),
    (
        "gloo/algorithm.h",
        include_str!("../../../kernels/gloo/algorithm.h"),
    ),
    (
        "gloo/common/error.h",
        include_str!("../../../kernels/gloo/common/error.h"),
    ),
    (
        "gloo/context.h",
        include_str!("../../../kernels/gloo/context.h"),
    ),
    (
        "gloo/rendezvous/store.h",
        include_str!("../../../kernels/gloo/rendezvous/store.h"),
    ),
    (
        "gloo/transport/device.h",
        include_str!("../../../kernels/gloo/transport/device.h"),
    ),
];
/// Version of the library's C interface: compiled into it (`ATTNSWEEP_ABI`), and checked
/// when it loads, so a library built from other sources is refused rather than misread.
pub(super) const ABI: i64 = 18;
pub(super) const LIB: &str = "libattnsweep_kernels.so";

/// The kernel sources: those compiled into this binary, or, for kernel development, the files
/// of the directory `$ATTNSWEEP_KERNELS_SRC` (so a kernel edit needs no new binary).
fn sources() -> Vec<(&'static str, String)> {
    match std::env::var_os("ATTNSWEEP_KERNELS_SRC") {
        Some(dir) => SOURCES
            .iter()
            .map(|(n, embedded)| {
                (
                    *n,
                    std::fs::read_to_string(Path::new(&dir).join(n))
                        .unwrap_or_else(|_| embedded.to_string()),
                )
            })
            .collect(),
        None => SOURCES.iter().map(|(n, s)| (*n, s.to_string())).collect(),
    }
}

/// A hash of the sources and the interface version they are compiled with.
fn source_hash() -> String {
    let h = sources()
        .iter()
        .fold(fnv1a_from(FNV_BASIS, &ABI.to_le_bytes()), |h, (n, s)| {
            fnv1a_from(fnv1a_from(h, n.as_bytes()), s.as_bytes())
        });
    format!("{:08x}", h >> 32)
}

pub(crate) fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("ATTNSWEEP_KERNELS_DIR") {
        return PathBuf::from(d);
    }
    std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|p| p.to_path_buf()))
        // Test binaries live one level down (target/release/deps): share the binary's cache.
        .map(|p| {
            if p.ends_with("deps") {
                p.parent().unwrap().to_path_buf()
            } else {
                p
            }
        })
        .unwrap_or_else(|| PathBuf::from("."))
        .join("kernels-cache")
}

/// What a build needs to know about the active libtorch.
struct Torch {
    root: PathBuf,
    version: String,
}

fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The torch whose headers the library compiles against: `$ATTNSWEEP_TORCH_DIR`, else the
/// `torch` package of `python3` on PATH.
fn find_torch() -> Result<Torch> {
    let root = match std::env::var_os("ATTNSWEEP_TORCH_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(
            run(Command::new("python3").args([
                "-c",
                "import torch, os; print(os.path.dirname(torch.__file__))",
            ]))
            .context(
                "cannot find torch: set ATTNSWEEP_TORCH_DIR or put a python3 with torch on PATH",
            )?,
        ),
    };
    ensure!(
        root.join("include").is_dir(),
        "{} holds no torch headers (include/)",
        root.display()
    );
    let version = std::fs::read_to_string(root.join("version.py")).unwrap_or_default();
    Ok(Torch { root, version })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Variant {
    Cpu,
    /// Compute capability, e.g. 90.
    Cuda(u32),
}

impl Variant {
    fn name(self) -> String {
        match self {
            Variant::Cpu => "cpu".into(),
            Variant::Cuda(cc) => format!("cuda-sm{cc}"),
        }
    }
}

/// The compute capability of GPU 0, from nvidia-smi.
pub(super) fn gpu_capability() -> Result<u32> {
    let out =
        run(Command::new("nvidia-smi").args(["--query-gpu=compute_cap", "--format=csv,noheader"]))
            .context("no GPU found (nvidia-smi failed); build the CPU variant with --cpu")?;
    let first = out.lines().next().unwrap_or("").trim().replace('.', "");
    first
        .parse()
        .with_context(|| format!("cannot read a compute capability from nvidia-smi: {out:?}"))
}

fn build_dir(variant: Variant, torch: &Torch) -> PathBuf {
    let t = fnv1a_from(
        fnv1a_from(FNV_BASIS, torch.root.to_string_lossy().as_bytes()),
        torch.version.as_bytes(),
    );
    cache_dir().join(format!(
        "{}-{}-{:08x}",
        variant.name(),
        source_hash(),
        t >> 32
    ))
}

/// Compiles the library for `variant` unless a build of these sources for this torch exists;
/// returns the library's path.
pub(crate) fn build(variant: Option<Variant>, quiet: bool) -> Result<PathBuf> {
    let variant = match variant {
        Some(v) => v,
        None => Variant::Cuda(gpu_capability()?),
    };
    let torch = find_torch()?;
    let dir = build_dir(variant, &torch);
    let lib = dir.join(LIB);
    if lib.is_file() {
        return Ok(lib);
    }
    static BUILDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = BUILDS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let tmp = dir.with_extension(format!("tmp-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    // A failed build leaves nothing in the cache: its sources and objects go with it.
    if let Err(e) = compile_library(&tmp, variant, &torch, &dir, quiet) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let moved = std::fs::rename(&tmp, &dir);
    // Another process's build of the same sources may have landed first: its library serves,
    // and this build's files go.
    if moved.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    moved
        .or_else(|e| if lib.is_file() { Ok(()) } else { Err(e) })
        .with_context(|| format!("cannot move the build to {}", dir.display()))?;
    Ok(lib)
}

/// Writes the sources into `tmp`, compiles each unit and links the library there (`dir` is
/// where it will live, for the messages).
fn compile_library(
    tmp: &Path,
    variant: Variant,
    torch: &Torch,
    dir: &Path,
    quiet: bool,
) -> Result<()> {
    for (name, text) in sources() {
        let path = tmp.join(name);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, text)?;
    }
    let inc = torch.root.join("include");
    let api = inc.join("torch/csrc/api/include");
    let tlib = torch.root.join("lib");
    let common: Vec<String> = vec![
        format!("-I{}", inc.display()),
        format!("-I{}", api.display()),
        // The Gloo declarations beside dist.cpp (`#include <gloo/...>`).
        format!("-I{}", tmp.display()),
        "-D_GLIBCXX_USE_CXX11_ABI=1".into(),
        format!("-DATTNSWEEP_ABI={ABI}"),
        "-std=c++17".into(),
        "-O3".into(),
    ];
    let mut links: Vec<String> = vec![
        format!("-L{}", tlib.display()),
        "-ltorch".into(),
        "-ltorch_cpu".into(),
        "-lc10".into(),
    ];
    // One compiler process per translation unit (every CUDA source and the C++ interface),
    // then one link: each unit parses torch's headers on its own, so they take about as long
    // one by one as at once on enough cores.
    let (compiler, flags, units): (String, Vec<String>, Vec<&str>) = match variant {
        Variant::Cpu => (
            std::env::var("CXX").unwrap_or_else(|_| "g++".into()),
            [common, vec!["-fPIC".into()]].concat(),
            vec!["ops.cpp", "dist.cpp"],
        ),
        Variant::Cuda(cc) => {
            let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
            which(&nvcc).with_context(|| format!("{nvcc} (the CUDA compiler) is not on PATH; install the CUDA toolkit or set NVCC"))?;
            // Hopper's wgmma exists only in the architecture-specific target sm_90a.
            let arch = if cc == 90 {
                "90a".into()
            } else {
                cc.to_string()
            };
            let mut flags = common;
            // NCCL's header, for c10d's NCCL process group (dist.cpp): the nvidia-nccl package
            // the torch wheel depends on, beside torch.
            let nccl = torch.root.with_file_name("nvidia").join("nccl/include");
            ensure!(
                nccl.join("nccl.h").is_file(),
                "{} has no nccl.h (the nvidia-nccl package torch installs): the NCCL process \
                 group cannot be built",
                nccl.display()
            );
            flags.push(format!("-I{}", nccl.display()));
            flags.push(format!("-gencode=arch=compute_{arch},code=sm_{arch}"));
            if cc == 90 {
                flags.push("-DATTNSWEEP_SM90A".into());
            }
            flags.extend(
                [
                    "-DATTNSWEEP_CUDA",
                    "-Xcompiler",
                    "-fPIC",
                    "--expt-relaxed-constexpr",
                ]
                .map(String::from),
            );
            links.extend(["-ltorch_cuda".into(), "-lc10_cuda".into()]);
            let units = SOURCES
                .iter()
                .map(|(n, _)| *n)
                .filter(|n| n.ends_with(".cu") || n.ends_with(".cpp"))
                .collect();
            (nvcc, flags, units)
        }
    };
    let object = |unit: &str| tmp.join(format!("{unit}.o"));
    let compiles: Vec<(&str, Command)> = units
        .iter()
        .map(|&u| {
            let mut c = Command::new(&compiler);
            c.args(&flags)
                .arg("-c")
                .arg(tmp.join(u))
                .arg("-o")
                .arg(object(u));
            (u, c)
        })
        .collect();
    if !quiet {
        eprintln!(
            "building {} kernels in {} ({} units)",
            variant.name(),
            dir.display(),
            compiles.len()
        );
    }
    compile_in_parallel(compiles, quiet)?;
    let rpath = match variant {
        Variant::Cpu => format!("-Wl,-rpath,{}", tlib.display()),
        Variant::Cuda(_) => format!("-Xlinker=-rpath,{}", tlib.display()),
    };
    let out = tmp.join(LIB);
    run(Command::new(&compiler)
        .arg("-shared")
        .args(units.iter().map(|u| object(u)))
        .args(&links)
        .arg(rpath)
        .arg("-o")
        .arg(&out))?;
    Ok(())
}

/// Runs the compiler commands `(unit, command)`, as many at once as there are cores, each
/// unit's time reported as it finishes unless `quiet`; the first failure's output is the
/// error (the others still finish, so no compiler is left running).
fn compile_in_parallel(units: Vec<(&str, Command)>, quiet: bool) -> Result<()> {
    let n = units.len();
    let workers = std::thread::available_parallelism()
        .map_or(1, |c| c.get())
        .min(n);
    // Popped from the end: the sources' first units (attention, the longest) start first.
    let mut units = units;
    units.reverse();
    let queue = std::sync::Mutex::new(units);
    let (done, finished) = std::sync::mpsc::channel();
    let start = std::time::Instant::now();
    let mut progress = Progress::new(n as u64, "units compiled", quiet, std::time::Duration::ZERO);
    let mut first_error = None;
    std::thread::scope(|s| {
        for _ in 0..workers {
            let (queue, done) = (&queue, done.clone());
            s.spawn(move || loop {
                let Some((unit, mut cmd)) = queue.lock().map_or(None, |mut q| q.pop()) else {
                    break;
                };
                let unit_start = std::time::Instant::now();
                let result = run(&mut cmd).map(|_| ());
                let _ = done.send((unit, unit_start.elapsed(), result));
            });
        }
        drop(done);
        for (k, (unit, took, result)) in finished.iter().enumerate() {
            match result {
                Ok(()) => progress.update(
                    k as u64 + 1,
                    &format!("{unit} ({:.0} s)", took.as_secs_f64()),
                ),
                Err(e) => {
                    first_error.get_or_insert(e.context(format!("compiling {unit}")));
                }
            }
        }
    });
    progress.finish();
    if let Some(e) = first_error {
        return Err(e);
    }
    if !quiet {
        eprintln!(
            "compiled {n} units in {:.0} s on {workers} cores",
            start.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

fn which(prog: &str) -> Result<()> {
    run(Command::new("sh").args(["-c", &format!("command -v {prog}")])).map(|_| ())
}

/// The built library for `variant` matching this binary's sources, if any.
pub(crate) fn find(variant: Variant) -> Option<PathBuf> {
    newest_build(
        &cache_dir(),
        &format!("{}-{}-", variant.name(), source_hash()),
    )
}

/// The newest library in `cache` among the finished builds named `prefix` + a torch hash
/// (built against any torch: a prebuilt library travels to machines whose torch lies
/// elsewhere). A build in progress writes into `<name>.tmp-<pid>-<n>` and renames it when
/// done, so its half-written library is never picked.
pub(super) fn newest_build(cache: &Path, prefix: &str) -> Option<PathBuf> {
    let finished = |name: &str| {
        name.strip_prefix(prefix)
            .is_some_and(|t| t.len() == 8 && t.bytes().all(|c| c.is_ascii_hexdigit()))
    };
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(cache)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| finished(&e.file_name().to_string_lossy()))
        .map(|e| e.path().join(LIB))
        .filter(|p| p.is_file())
        .filter_map(|p| Some((p.metadata().ok()?.modified().ok()?, p)))
        .collect();
    found.sort();
    found.pop().map(|(_, p)| p)
}
