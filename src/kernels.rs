//! The kernel path: the C++/CUDA library in `kernels/` (sources compiled into this binary),
//! built on demand by `attnsweep kernels build` and loaded at run time.
//!
//! Builds are cached under `<cache>/<variant>-<source hash>-<torch hash>/`, where the variant
//! is `cuda-smXY` (nvcc, for the GPU found) or `cpu` (g++: the same autograd layer with an
//! ATen reference in place of the kernels, which is what CI tests). The cache is
//! `$ATTNSWEEP_KERNELS_DIR`, else `kernels-cache/` beside the binary.

use crate::config::AttnImpl;
use anyhow::{ensure, Context, Result};
use libloading::{Library, Symbol};
use std::ffi::{c_char, c_void, CStr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use tch::{Device, Kind, Tensor};

const SOURCES: [(&str, &str); 18] = [
    ("attention.cu", include_str!("../kernels/attention.cu")),
    (
        "attention_sm90.cu",
        include_str!("../kernels/attention_sm90.cu"),
    ),
    ("attention.cuh", include_str!("../kernels/attention.cuh")),
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("loss.cu", include_str!("../kernels/loss.cu")),
    ("loss.cuh", include_str!("../kernels/loss.cuh")),
    ("norm.cu", include_str!("../kernels/norm.cu")),
    ("norm.cuh", include_str!("../kernels/norm.cuh")),
    ("optim.cu", include_str!("../kernels/optim.cu")),
    ("optim.cuh", include_str!("../kernels/optim.cuh")),
    ("rope.cu", include_str!("../kernels/rope.cu")),
    ("rope.cuh", include_str!("../kernels/rope.cuh")),
    ("swiglu.cu", include_str!("../kernels/swiglu.cu")),
    ("swiglu.cuh", include_str!("../kernels/swiglu.cuh")),
    ("router.cu", include_str!("../kernels/router.cu")),
    ("router.cuh", include_str!("../kernels/router.cuh")),
    ("walk.cuh", include_str!("../kernels/walk.cuh")),
    ("ops.cpp", include_str!("../kernels/ops.cpp")),
];
const ABI: i64 = 11;
const LIB: &str = "libattnsweep_kernels.so";

fn fnv1a(bytes: &[u8], seed: u64) -> u64 {
    bytes
        .iter()
        .fold(seed, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

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

fn source_hash() -> String {
    let h = sources()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, (n, s)| {
            fnv1a(s.as_bytes(), fnv1a(n.as_bytes(), h))
        });
    format!("{:08x}", h >> 32)
}

pub fn cache_dir() -> PathBuf {
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
pub enum Variant {
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
fn gpu_capability() -> Result<u32> {
    let out =
        run(Command::new("nvidia-smi").args(["--query-gpu=compute_cap", "--format=csv,noheader"]))
            .context("no GPU found (nvidia-smi failed); build the CPU variant with --cpu")?;
    let first = out.lines().next().unwrap_or("").trim().replace('.', "");
    first
        .parse()
        .with_context(|| format!("cannot read a compute capability from nvidia-smi: {out:?}"))
}

fn build_dir(variant: Variant, torch: &Torch) -> PathBuf {
    let t = fnv1a(
        torch.version.as_bytes(),
        fnv1a(
            torch.root.to_string_lossy().as_bytes(),
            0xcbf2_9ce4_8422_2325,
        ),
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
pub fn build(variant: Option<Variant>, quiet: bool) -> Result<PathBuf> {
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
    for (name, text) in sources() {
        std::fs::write(tmp.join(name), text)?;
    }
    let inc = torch.root.join("include");
    let api = inc.join("torch/csrc/api/include");
    let tlib = torch.root.join("lib");
    let common: Vec<String> = vec![
        format!("-I{}", inc.display()),
        format!("-I{}", api.display()),
        "-D_GLIBCXX_USE_CXX11_ABI=1".into(),
        "-std=c++17".into(),
        "-O3".into(),
    ];
    let links: Vec<String> = vec![
        format!("-L{}", tlib.display()),
        "-ltorch".into(),
        "-ltorch_cpu".into(),
        "-lc10".into(),
    ];
    let out = tmp.join(LIB);
    let mut cmd = match variant {
        Variant::Cpu => {
            let mut c = Command::new(std::env::var("CXX").unwrap_or_else(|_| "g++".into()));
            c.args(&common)
                .args(["-fPIC", "-shared"])
                .arg(tmp.join("ops.cpp"))
                .args(&links);
            c.arg(format!("-Wl,-rpath,{}", tlib.display()))
                .arg("-o")
                .arg(&out);
            c
        }
        Variant::Cuda(cc) => {
            let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
            which(&nvcc).with_context(|| format!("{nvcc} (the CUDA compiler) is not on PATH; install the CUDA toolkit or set NVCC"))?;
            // Hopper's wgmma exists only in the architecture-specific target sm_90a.
            let arch = if cc == 90 {
                "90a".into()
            } else {
                cc.to_string()
            };
            let mut c = Command::new(&nvcc);
            c.args(&common)
                .arg(format!("-gencode=arch=compute_{arch},code=sm_{arch}"))
                .args((cc == 90).then_some("-DATTNSWEEP_SM90A"))
                .args([
                    "-DATTNSWEEP_CUDA",
                    "-Xcompiler",
                    "-fPIC",
                    "-shared",
                    "--expt-relaxed-constexpr",
                ])
                .arg(tmp.join("attention.cu"))
                .arg(tmp.join("attention_sm90.cu"))
                .arg(tmp.join("loss.cu"))
                .arg(tmp.join("norm.cu"))
                .arg(tmp.join("optim.cu"))
                .arg(tmp.join("rope.cu"))
                .arg(tmp.join("swiglu.cu"))
                .arg(tmp.join("router.cu"))
                .arg(tmp.join("ops.cpp"))
                .args(&links)
                .args(["-ltorch_cuda", "-lc10_cuda"])
                .arg(format!("-Xlinker=-rpath,{}", tlib.display()))
                .arg("-o")
                .arg(&out);
            c
        }
    };
    if !quiet {
        eprintln!("building {} kernels in {}", variant.name(), dir.display());
    }
    run(&mut cmd)?;
    std::fs::rename(&tmp, &dir)
        .or_else(|e| if lib.is_file() { Ok(()) } else { Err(e) })
        .with_context(|| format!("cannot move the build to {}", dir.display()))?;
    Ok(lib)
}

fn which(prog: &str) -> Result<()> {
    run(Command::new("sh").args(["-c", &format!("command -v {prog}")])).map(|_| ())
}

/// The built library for `variant` matching this binary's sources, if any.
pub fn find(variant: Variant) -> Option<PathBuf> {
    newest_build(
        &cache_dir(),
        &format!("{}-{}-", variant.name(), source_hash()),
    )
}

/// The newest library in `cache` among the finished builds named `prefix` + a torch hash
/// (built against any torch: a prebuilt library travels to machines whose torch lies
/// elsewhere). A build in progress writes into `<name>.tmp-<pid>-<n>` and renames it when
/// done, so its half-written library is never picked.
fn newest_build(cache: &Path, prefix: &str) -> Option<PathBuf> {
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

type ListAttentionFn = unsafe extern "C" fn(
    *const c_void,
    *const c_void,
    *const c_void,
    *const c_void,
    *const c_void,
    i64,
    *const c_void,
    i64,
    *mut c_char,
    usize,
) -> *mut c_void;

type RoutedAttentionFn = unsafe extern "C" fn(
    *const c_void,
    *const c_void,
    *const c_void,
    *const c_void,
    i64,
    *mut c_char,
    usize,
) -> *mut c_void;

/// Two tensors in, one new tensor out (the cross-entropy, SwiGLU).
type Tensor2Fn =
    unsafe extern "C" fn(*const c_void, *const c_void, *mut c_char, usize) -> *mut c_void;
type RmsNormFn =
    unsafe extern "C" fn(*const c_void, *const c_void, f64, *mut c_char, usize) -> *mut c_void;
/// Three tensors in, one new tensor out (the straight-through mix, the router).
type Tensor3Fn = unsafe extern "C" fn(
    *const c_void,
    *const c_void,
    *const c_void,
    *mut c_char,
    usize,
) -> *mut c_void;
type HeadsFn = unsafe extern "C" fn(
    *const c_void,
    *const c_void,
    *const c_void,
    i32,
    *mut c_char,
    usize,
) -> *mut c_void;
type EventNewFn = unsafe extern "C" fn(*mut c_char, usize) -> *mut c_void;
type EventRecordFn = unsafe extern "C" fn(*mut c_void, *mut c_char, usize) -> i32;
type EventElapsedFn =
    unsafe extern "C" fn(*mut c_void, *mut c_void, *mut f64, *mut c_char, usize) -> i32;
type AhaGatesFn = unsafe extern "C" fn(
    *const c_void,
    f64,
    f64,
    u64,
    i64,
    i64,
    i64,
    *mut *mut c_void,
    *mut c_char,
    usize,
) -> i32;
type GradNormFn =
    unsafe extern "C" fn(*const *const c_void, usize, *mut f64, *mut c_char, usize) -> i32;
type AdamWFn = unsafe extern "C" fn(
    *const *const c_void,
    *const *const c_void,
    *const *const c_void,
    *const *const c_void,
    usize,
    *const f64,
    *mut c_char,
    usize,
) -> i32;

/// One AdamW step's scalars for [`Kernels::adamw`].
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Bias corrections `1 - beta^t`.
    pub bc1: f64,
    pub bc2: f64,
    /// Factor the gradients are scaled by first (1: no clipping).
    pub clip: f64,
}

/// AHA's gates of one layer ([`Kernels::aha_gates`]).
#[derive(Debug)]
pub struct AhaGates {
    /// `[B, H, L]` zeros whose gradient reaches the router scores: the straight-through mix's
    /// weight (`Kernels::st_mix`).
    pub weight: Tensor,
    /// `[B, L, H]` fp32, 1 where the gate is open (the whole prefix).
    pub hard: Tensor,
    /// `[B, H, L]` `QueryPath`s each query runs with gradient: the one its gate picked.
    pub chosen: Tensor,
    /// `[B, H, L]` `QueryPath`s the straight-through gradient also reads: the window of open
    /// gates, the whole prefix of probed window gates, nothing elsewhere.
    pub other: Tensor,
    /// Key-query pairs the chosen paths attend (fp64 scalar).
    pub pairs: Tensor,
}

/// What a query of routed attention sees: `Kernels::routed_attention`'s `path` values (uint8),
/// in increasing order of reach.
#[derive(Clone, Copy)]
#[repr(u8)]
pub enum QueryPath {
    Nothing = 0,
    Window = 1,
    Full = 2,
}

/// A CUDA timing event of a library built with CUDA ([`Kernels::event`]).
pub struct Event<'a> {
    kern: &'a Kernels,
    raw: *mut c_void,
}

impl Event<'_> {
    /// Records the event on the current stream.
    pub fn record(&self) -> Result<()> {
        status("CUDA event", |e, n| unsafe {
            (self.kern.event_record)(self.raw, e, n)
        })
    }

    /// Milliseconds on the device's clock from `start` to this event, once this one is reached.
    pub fn ms_since(&self, start: &Event) -> Result<f64> {
        let mut ms = 0f64;
        status("CUDA event", |e, n| unsafe {
            (self.kern.event_elapsed)(start.raw, self.raw, &mut ms, e, n)
        })?;
        Ok(ms)
    }
}

impl Drop for Event<'_> {
    fn drop(&mut self) {
        unsafe { (self.kern.event_free)(self.raw) }
    }
}

/// The library where it takes `x`'s dtype: the fused element-wise kernels take fp32 and bf16.
pub fn kernel_for<'a>(kernels: Option<&'a Kernels>, x: &Tensor) -> Option<&'a Kernels> {
    kernels.filter(|_| matches!(x.kind(), Kind::Float | Kind::BFloat16))
}

/// A tensor's handle as the library's entry points take it.
fn ptr(t: &Tensor) -> *const c_void {
    t.as_ptr() as *const c_void
}

/// Runs an entry point that returns a new object (null with a message in its error buffer,
/// which `f` receives): the object, or the message as an error.
fn new_object(
    what: &str,
    f: impl FnOnce(*mut c_char, usize) -> *mut c_void,
) -> Result<*mut c_void> {
    let mut err = vec![0 as c_char; 1024];
    let out = f(err.as_mut_ptr(), err.len());
    ensure!(!out.is_null(), "{what}: {}", library_error(&err));
    Ok(out)
}

/// `new_object` for an entry point that returns a new at::Tensor*.
fn new_tensor(what: &str, f: impl FnOnce(*mut c_char, usize) -> *mut c_void) -> Result<Tensor> {
    let out = new_object(what, f)?;
    // Safety: a heap at::Tensor* whose ownership passes to us.
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

/// Runs an entry point that returns 0, or 1 with a message in its error buffer (which `f`
/// receives): the message as an error.
fn status(what: &str, f: impl FnOnce(*mut c_char, usize) -> i32) -> Result<()> {
    let mut err = vec![0 as c_char; 1024];
    let rc = f(err.as_mut_ptr(), err.len());
    ensure!(rc == 0, "{what}: {}", library_error(&err));
    Ok(())
}

/// One two-tensor entry point of the library.
fn call2(f: Tensor2Fn, what: &str, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    new_tensor(what, |e, n| unsafe { f(ptr(a), ptr(b), e, n) })
}

/// One three-tensor entry point of the library.
fn call3(f: Tensor3Fn, what: &str, a: &Tensor, b: &Tensor, c: &Tensor) -> Result<Tensor> {
    new_tensor(what, |e, n| unsafe { f(ptr(a), ptr(b), ptr(c), e, n) })
}

/// A loaded kernel library.
pub struct Kernels {
    _lib: Library,
    list_attention: ListAttentionFn,
    routed_attention: RoutedAttentionFn,
    token_nll: Tensor2Fn,
    swiglu: Tensor2Fn,
    rms_norm: RmsNormFn,
    heads: HeadsFn,
    st_mix: Tensor3Fn,
    aha_gates: AhaGatesFn,
    router: Tensor3Fn,
    grad_norm: GradNormFn,
    adamw: AdamWFn,
    event_new: EventNewFn,
    event_record: EventRecordFn,
    event_elapsed: EventElapsedFn,
    event_free: unsafe extern "C" fn(*mut c_void),
    pub cuda: bool,
    pub path: PathBuf,
}

impl Kernels {
    pub fn load(path: &Path) -> Result<Kernels> {
        // Safety: the library is ours, built from this binary's sources against the libtorch
        // this process already links; its initialisers only register nothing global.
        let lib = unsafe { Library::new(path) }
            .with_context(|| format!("cannot load {}", path.display()))?;
        unsafe {
            let abi: Symbol<unsafe extern "C" fn() -> i64> = lib.get(b"attnsweep_kernels_abi")?;
            ensure!(
                abi() == ABI,
                "{} has interface version {}, this binary needs {ABI}; rebuild it",
                path.display(),
                abi()
            );
            let cuda: Symbol<unsafe extern "C" fn() -> i32> = lib.get(b"attnsweep_kernels_cuda")?;
            let cuda = cuda() != 0;
            let f: Symbol<ListAttentionFn> = lib.get(b"attnsweep_list_attention")?;
            let list_attention = *f;
            let routed_attention = *lib.get::<RoutedAttentionFn>(b"attnsweep_routed_attention")?;
            let token_nll = *lib.get::<Tensor2Fn>(b"attnsweep_token_nll")?;
            let swiglu = *lib.get::<Tensor2Fn>(b"attnsweep_swiglu")?;
            let rms_norm = *lib.get::<RmsNormFn>(b"attnsweep_rms_norm")?;
            let heads = *lib.get::<HeadsFn>(b"attnsweep_heads")?;
            let st_mix = *lib.get::<Tensor3Fn>(b"attnsweep_st_mix")?;
            let aha_gates = *lib.get::<AhaGatesFn>(b"attnsweep_aha_gates")?;
            let router = *lib.get::<Tensor3Fn>(b"attnsweep_router")?;
            let grad_norm = *lib.get::<GradNormFn>(b"attnsweep_grad_norm")?;
            let adamw = *lib.get::<AdamWFn>(b"attnsweep_adamw")?;
            let event_new = *lib.get::<EventNewFn>(b"attnsweep_event_new")?;
            let event_record = *lib.get::<EventRecordFn>(b"attnsweep_event_record")?;
            let event_elapsed = *lib.get::<EventElapsedFn>(b"attnsweep_event_elapsed")?;
            let event_free =
                *lib.get::<unsafe extern "C" fn(*mut c_void)>(b"attnsweep_event_free")?;
            Ok(Kernels {
                _lib: lib,
                list_attention,
                routed_attention,
                token_nll,
                swiglu,
                rms_norm,
                heads,
                st_mix,
                aha_gates,
                router,
                grad_norm,
                adamw,
                event_new,
                event_record,
                event_elapsed,
                event_free,
                cuda,
                path: path.to_path_buf(),
            })
        }
    }

    /// Attention of queries `q: [B, H, Lq, D]` over `k, v: [B, Hkv, L, D]`: query r at position
    /// `qpos[b, h, r]` (int32, ascending; all positions when None) sees keys at most `window - 1`
    /// before it; rows `r >= nq[b, h]` are inactive and return zeros. Differentiable in q, k, v.
    pub fn list_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        list: Option<(&Tensor, &Tensor)>,
        window: i64,
    ) -> Result<Tensor> {
        self.call_attention(q, k, v, list, window, None)
    }

    /// Routed attention of `q: [B, H, L, D]` over `k, v: [B, Hkv, L, D]`: per query, `path:
    /// [B, H, L]` (uint8, `QueryPath` values) says whether it sees its whole prefix, its `window`,
    /// or nothing (zeros). The paths' queries form one list per (b, h), compacted on the
    /// device, so each query runs only its own path, in one launch. Differentiable in q, k, v.
    pub fn routed_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        path: &Tensor,
        window: i64,
    ) -> Result<Tensor> {
        new_tensor("routed attention kernel", |e, n| unsafe {
            (self.routed_attention)(ptr(q), ptr(k), ptr(v), ptr(path), window, e, n)
        })
    }

    /// PPA attention of `q: [B, H, L, D]` over `k, v: [B, Hkv, L, D]`: each query sees its
    /// window and the keys at the distances in `offsets` (the power offsets beyond the window).
    /// Differentiable in q, k, v.
    pub fn ppa_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        window: i64,
        offsets: &PpaOffsets,
    ) -> Result<Tensor> {
        self.call_attention(q, k, v, None, window, Some(offsets))
    }

    fn call_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        list: Option<(&Tensor, &Tensor)>,
        window: i64,
        offsets: Option<&PpaOffsets>,
    ) -> Result<Tensor> {
        let (qpos, nq) = match list {
            Some((p, n)) => (ptr(p), ptr(n)),
            None => (std::ptr::null(), std::ptr::null()),
        };
        let (offsets, pairs_from) = offsets.map_or((std::ptr::null(), 0), |o| {
            (ptr(&o.tensor), o.pairs_from as i64)
        });
        new_tensor("attention kernel", |e, n| unsafe {
            (self.list_attention)(
                ptr(q),
                ptr(k),
                ptr(v),
                qpos,
                nq,
                window,
                offsets,
                pairs_from,
                e,
                n,
            )
        })
    }
}

/// PPA's offsets beyond the window (int32, strictly ascending, each in `[window, L)`) on a
/// device, and where the GPU kernels split them: the nearer ones run in the tile kernels, those
/// from index `pairs_from` on pair by pair (kernels/attention.cu, far pairs). The CPU reference
/// takes them all at once, whatever the split.
pub struct PpaOffsets {
    pub tensor: Tensor,
    pub pairs_from: usize,
}

/// The gap between consecutive far distances from which the pair kernels take them over. Past
/// it a tile holds about one seen pair a row per PPA_PAIR_GAP keys; measured on the attention
/// bench from 16 to 96 and tiles only (PERFORMANCE.md, "PPA's sparse far distances pair by
/// pair"): 24 to 48 within a few percent of each other, 96 up to 40% slower for p = 0.5, 16
/// 13% slower for p = 0.75 at L 32768.
pub const PPA_PAIR_GAP: i64 = 32;

impl PpaOffsets {
    /// Split where the GPU kernels run fastest: pairs from the first offset after which every
    /// one lies at least PPA_PAIR_GAP from a neighbour (the previous offset, or the window's
    /// last distance for the first; or the next). A lone offset near the window (p = 0.25's 81
    /// at w = 64) goes to the pairs too: kept, it alone held the tile kernels on their PPA
    /// instantiation, whose forward took as long at w = 64 as the window kernel at w = 256
    /// (PERFORMANCE.md, "PPA's sparse far distances pair by pair").
    pub fn new(offsets: &[i32], window: usize, device: Device) -> Self {
        let gap_before = |j: usize| {
            offsets[j] as i64
                - if j == 0 {
                    window as i64 - 1
                } else {
                    offsets[j - 1] as i64
                }
        };
        let crowded = |j: usize| {
            gap_before(j) < PPA_PAIR_GAP
                && (j + 1 == offsets.len() || gap_before(j + 1) < PPA_PAIR_GAP)
        };
        let pairs_from = (0..offsets.len())
            .rev()
            .find(|&j| crowded(j))
            .map_or(0, |j| j + 1);
        Self::split_at(offsets, pairs_from, device)
    }

    pub fn split_at(offsets: &[i32], pairs_from: usize, device: Device) -> Self {
        PpaOffsets {
            tensor: Tensor::from_slice(offsets).to_device(device),
            pairs_from,
        }
    }

    pub fn shallow_clone(&self) -> Self {
        PpaOffsets {
            tensor: self.tensor.shallow_clone(),
            pairs_from: self.pairs_from,
        }
    }
}

fn library_error(err: &[c_char]) -> String {
    unsafe { CStr::from_ptr(err.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

fn pointers(ts: &[Tensor]) -> Vec<*const c_void> {
    ts.iter().map(ptr).collect()
}

impl Kernels {
    /// Per-token next-token NLL (fp32, shaped like `targets`) of `logits: [..., V]` (fp32 or
    /// bf16, read in their dtype; the gradient comes back in it), differentiable in logits.
    pub fn token_nll(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        call2(self.token_nll, "cross-entropy kernel", logits, targets)
    }

    /// The MLP's gate `silu(gate) * up` (both fp32 or both bf16, one shape) in one kernel,
    /// computed in fp32; differentiable in both.
    pub fn swiglu(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        call2(self.swiglu, "SwiGLU kernel", gate, up)
    }

    /// RMSNorm of `x: [..., d]` (fp32 or bf16) with `weight: [d]` (fp32), computed in fp32,
    /// returned in x's dtype; differentiable in both.
    pub fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
        new_tensor("RMSNorm kernel", |e, n| unsafe {
            (self.rms_norm)(ptr(x), ptr(weight), eps, e, n)
        })
    }

    /// Rotary embedding of `x: [B, L, H, D]` (fp32 or bf16) at angles with `cos, sin: [L, D]`
    /// (read in x's dtype where they have it, else in fp32), returned transposed to
    /// `[B, H, L, D]` (as attention reads it); differentiable in x.
    pub fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        self.move_heads("rope kernel", x, Some((cos, sin)), true)
    }

    /// A timing event on the GPU's clock (what `torch.cuda.Event` measures); an error where
    /// the library was built without CUDA.
    pub fn event(&self) -> Result<Event<'_>> {
        let raw = new_object("CUDA event", |e, n| unsafe { (self.event_new)(e, n) })?;
        Ok(Event { kern: self, raw })
    }

    /// `x: [B, L, H, D]` (fp32 or bf16) as a contiguous `[B, H, L, D]`; differentiable.
    pub fn to_heads(&self, x: &Tensor) -> Result<Tensor> {
        self.move_heads("head transpose kernel", x, None, true)
    }

    /// `y: [B, H, L, D]` (fp32 or bf16) as a contiguous `[B, L, H, D]`; differentiable.
    pub fn from_heads(&self, y: &Tensor) -> Result<Tensor> {
        self.move_heads("head transpose kernel", y, None, false)
    }

    fn move_heads(
        &self,
        what: &str,
        x: &Tensor,
        rotation: Option<(&Tensor, &Tensor)>,
        to_heads: bool,
    ) -> Result<Tensor> {
        let (cos, sin) = rotation.map_or((std::ptr::null(), std::ptr::null()), |(c, s)| {
            (ptr(c), ptr(s))
        });
        new_tensor(what, |e, n| unsafe {
            (self.heads)(ptr(x), cos, sin, i32::from(to_heads), e, n)
        })
    }

    /// AHA's straight-through mix `c + w * (sg(c) - o)` of `c, o: [B, H, L, D]` (bf16 on the
    /// GPU) with one weight a row, `w: [B, H, L]`: equal to `c` where `w` is 0, with gradient
    /// `dy` for `c` and `rowsum(dy * (c - o))` for `w` (none for `o`). One kernel each way.
    pub fn st_mix(&self, c: &Tensor, o: &Tensor, w: &Tensor) -> Result<Tensor> {
        call3(self.st_mix, "straight-through mix kernel", c, o, w)
    }

    /// A router's scores `sigmoid(x w^T + b)` (fp32, `[..., heads]`) of `x: [..., d]` (bf16 or
    /// fp32) with `w: [heads, d]` and `b: [heads]` (fp32), as `Linear::forward` on the fp32 `x`
    /// followed by a sigmoid computes them, reading `x` once in its own dtype each way;
    /// differentiable in x, w and b.
    pub fn router(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        let none = Tensor::zeros([0], (Kind::Float, x.device()));
        call3(self.router, "router kernel", x, w, b.unwrap_or(&none))
    }

    /// AHA's gates of one layer from router scores `s: [B, L, H]` (fp32) in one pass: open
    /// where `s > tau`; with `sample < 1` a window gate is probed where the hash draw of
    /// `(seed, layer, b, start + l, h)` is below `sample` (`attention.rs`, `hash_uniform`), and
    /// `sample = 1` probes every one (the exact straight-through gradient). The weight's
    /// gradient reaches `s` as the straight-through gradient, scaled by `1 / sample` at probes.
    #[allow(clippy::too_many_arguments)]
    pub fn aha_gates(
        &self,
        s: &Tensor,
        tau: f64,
        sample: f64,
        seed: u64,
        layer: usize,
        start: i64,
        window: i64,
    ) -> Result<AhaGates> {
        let mut out = [std::ptr::null_mut::<c_void>(); 5];
        status("AHA gate kernel", |e, n| unsafe {
            (self.aha_gates)(
                ptr(s),
                tau,
                sample,
                seed,
                layer as i64,
                start,
                window,
                out.as_mut_ptr(),
                e,
                n,
            )
        })?;
        // Safety: five heap at::Tensor* whose ownership passes to us.
        let [weight, hard, chosen, other, pairs] =
            out.map(|p| unsafe { Tensor::from_ptr(p as *mut torch_sys::C_tensor) });
        Ok(AhaGates {
            weight,
            hard,
            chosen,
            other,
            pairs,
        })
    }

    /// Global L2 norm of `grads` (fp32, contiguous, one device), in one launch.
    pub fn grad_norm(&self, grads: &[Tensor]) -> Result<f64> {
        let mut norm = 0f64;
        let p = pointers(grads);
        status("gradient norm kernel", |e, n| unsafe {
            (self.grad_norm)(p.as_ptr(), p.len(), &mut norm, e, n)
        })?;
        Ok(norm)
    }

    /// Clipping and AdamW over all parameters in one launch, in place; the four slices are
    /// parallel (parameter, gradient, first and second moment), all fp32 and contiguous.
    pub fn adamw(
        &self,
        p: &[Tensor],
        g: &[Tensor],
        m: &[Tensor],
        v: &[Tensor],
        h: &AdamWStep,
    ) -> Result<()> {
        ensure!(
            g.len() == p.len() && m.len() == p.len() && v.len() == p.len(),
            "adamw: parameter, gradient and moment lists differ in length"
        );
        let scalars = [
            h.lr,
            h.beta1,
            h.beta2,
            h.eps,
            h.weight_decay,
            h.bc1,
            h.bc2,
            h.clip,
        ];
        let (pp, gp, mp, vp) = (pointers(p), pointers(g), pointers(m), pointers(v));
        status("adamw kernel", |e, n| unsafe {
            (self.adamw)(
                pp.as_ptr(),
                gp.as_ptr(),
                mp.as_ptr(),
                vp.as_ptr(),
                pp.len(),
                scalars.as_ptr(),
                e,
                n,
            )
        })
    }
}

static CUDA_KERNELS: OnceLock<Option<Kernels>> = OnceLock::new();

/// The CUDA kernel library, if one is built for this binary's sources (loaded once).
pub fn cuda() -> Option<&'static Kernels> {
    CUDA_KERNELS
        .get_or_init(|| {
            let cc = gpu_capability().ok()?;
            let path = find(Variant::Cuda(cc))?;
            match Kernels::load(&path) {
                Ok(k) if k.cuda => Some(k),
                Ok(_) => None,
                Err(e) => {
                    eprintln!("warning: {e:#}");
                    None
                }
            }
        })
        .as_ref()
}

static CPU_KERNELS: OnceLock<Kernels> = OnceLock::new();

/// The CPU build of the library (the autograd layer over its ATen reference), built if needed.
pub fn cpu() -> Result<&'static Kernels> {
    // One build at a time in this process (tests ask from several threads).
    static BUILDING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = BUILDING.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(k) = CPU_KERNELS.get() {
        return Ok(k);
    }
    let k = match find(Variant::Cpu).map(|p| Kernels::load(&p)) {
        Some(Ok(k)) => k,
        // None built, or one built against a torch that no longer loads: build for this one.
        _ => Kernels::load(&build(Some(Variant::Cpu), true)?)?,
    };
    Ok(CPU_KERNELS.get_or_init(|| k))
}

/// The library a model's attention uses under `attn_impl`, or None for the reference path.
pub fn for_model(
    imp: AttnImpl,
    device: Device,
    compute: Kind,
    head_dim: usize,
) -> Result<Option<&'static Kernels>> {
    let fits = compute == Kind::BFloat16 && (head_dim == 64 || head_dim == 128);
    match imp {
        AttnImpl::Reference => Ok(None),
        AttnImpl::Auto => Ok(if device.is_cuda() && fits {
            cuda()
        } else {
            None
        }),
        AttnImpl::Cuda if device.is_cuda() => {
            ensure!(fits, "attention.attn_impl = \"cuda\" needs train.dtype = \"bf16\" and head_dim 64 or 128 (got {compute:?}, {head_dim})");
            cuda().map(Some).context("attention.attn_impl = \"cuda\" but no CUDA kernel library is built for this binary (or the one found failed to load: see the warning above); run `attnsweep kernels build`")
        }
        AttnImpl::Cuda => cpu().map(Some),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::attention::{attend, KeyPattern};

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
                let dense_q = Tensor::zeros([b, h, len, d], (Kind::Float, q.device())).scatter(
                    2,
                    &idx,
                    &f(q),
                );
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
        let mut rng = crate::rng::Rng::new(len as u64 * 31 + counts.len() as u64);
        for bh in 0..(b * h) as usize {
            let n = counts[bh % counts.len()];
            let mut chosen: Vec<i64> = (0..len).collect();
            for i in 0..len as usize {
                let j = i + rng.below((len as usize - i) as u64) as usize;
                chosen.swap(i, j);
            }
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
    fn compare_with_reference(
        kern: &Kernels,
        device: Device,
        kind: Kind,
        head_dims: &[i64],
        tol: f64,
    ) {
        let (b, h, hkv) = (2i64, 4i64, 2i64);
        for &d in head_dims {
            for &(len, window, sparse) in &[
                (37i64, 1i64, false),
                (130, 7, false),
                (200, 64, false),
                (333, 333, false),
                (70, 500, false),
                (600, 700, false),
                (2048, 128, false),
                (2048, 1 << 20, true),
                (333, 1000, true),
                (200, 17, true),
            ] {
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
                    &format!("D={d} L={len} w={window} sparse={sparse}"),
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
                    let mut rng = crate::rng::Rng::new((len * 131 + window) as u64);
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
            let want = crate::nn::token_nll(&xr, &y);
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
    /// is not.
    fn rms_norm_matches_reference(kern: &Kernels, device: Device, kind: Kind, tol: f64) {
        for d in [512i64, 100] {
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
            let rope = crate::nn::Rope::new(300, &inv, angles, device).slice(37, 203);
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
            let want =
                &cr + wr.transpose(1, 2).unsqueeze(-1) * (cr.detach() - o.to_kind(Kind::Float));
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

    /// AHA's gates against the layer's ATen reference (`attention.rs`: `threshold`,
    /// `hash_uniform`'s probes, `routed_pairs`) and the straight-through weight's gradient,
    /// for gates open at random, all open and all closed, at two chunk starts.
    fn aha_gates_match_reference(kern: &Kernels, device: Device) {
        use crate::attention::{hash_uniform, routed_pairs, threshold};
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
            let probe = hash_uniform(seed, layer, [b, l, h], start, device)
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
            let pairs = routed_pairs(&on, window as usize, start).double_value(&[]);
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
    /// 16-byte chunks of a few lanes, and one (17 heads) they leave to ATen.
    fn router_matches_reference(kern: &Kernels, device: Device, kind: Kind) {
        use crate::nn::Linear;
        // 20001 tokens a row: on a GPU of up to ~150 SMs, blocks of the weight's gradient take
        // more than one chunk of tokens, and the last one a part of one.
        for (heads, d, bias, len) in [
            (8i64, 512i64, true, 33i64),
            (1, 72, false, 33),
            (3, 40, true, 33),
            (17, 64, true, 33),
            (4, 64, true, 20001),
        ] {
            tch::manual_seed(heads * 1000 + d);
            let x = (Tensor::randn([2, len, d], (Kind::Float, device)))
                .to_kind(kind)
                .set_requires_grad(true);
            let w =
                (Tensor::randn([heads, d], (Kind::Float, device)) * 0.1).set_requires_grad(true);
            let b =
                bias.then(|| Tensor::randn([heads], (Kind::Float, device)).set_requires_grad(true));
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
        let cache = crate::scratch_dir("find");
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
}
