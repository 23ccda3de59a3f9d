//! The C interface of the kernel library (`kernels/ops.cpp`): every entry point's signature,
//! declared once in the table below, which also resolves them all when the library loads,
//! and the helpers that turn the library's error buffers into errors.
//!
//! Every entry point takes tensors as `at::Tensor*` (what `tch::Tensor::as_ptr` gives) and an
//! error buffer; it returns a new object (null on failure) or a status (0, else 1), with the
//! message in the buffer. Adding one means a line in the table, a method on `Kernels` and its
//! C++ definition.

use anyhow::{ensure, Context, Result};
use libloading::Library;
use std::ffi::{c_char, c_void, CStr};
use tch::Tensor;

/// Two tensors in, one new tensor out (the cross-entropy, SwiGLU).
pub(super) type Tensor2Fn =
    unsafe extern "C" fn(*const c_void, *const c_void, *mut c_char, usize) -> *mut c_void;
/// Three tensors in, one new tensor out (the straight-through mix, the router).
pub(super) type Tensor3Fn = unsafe extern "C" fn(
    *const c_void,
    *const c_void,
    *const c_void,
    *mut c_char,
    usize,
) -> *mut c_void;

/// `entry_points! { name: signature; ... }` declares `EntryPoints`, one field per entry point
/// of the library, exported as `attnsweep_<name>`, and `EntryPoints::resolve`, which looks
/// every one of them up.
macro_rules! entry_points {
    ($($(#[doc = $doc:literal])* $name:ident: $ty:ty;)*) => {
        /// The library's entry points, resolved once when it loads.
        pub(super) struct EntryPoints {
            $($(#[doc = $doc])* pub $name: $ty,)*
        }

        impl EntryPoints {
            /// Safety: the library must export each entry point with the signature declared.
            pub(super) unsafe fn resolve(lib: &Library) -> Result<EntryPoints> {
                Ok(EntryPoints {
                    $($name: *lib
                        .get::<$ty>(concat!("attnsweep_", stringify!($name), "\0").as_bytes())
                        .context(concat!("the kernel library lacks attnsweep_", stringify!($name)))?,)*
                })
            }
        }
    };
}

entry_points! {
    /// Whether the library was built with the CUDA kernels (1) or is the CPU build (0).
    kernels_cuda: unsafe extern "C" fn() -> i32;
    /// q, k, v, qpos, nq, window, offsets, pairs_from, sinks: window, sparse-query, PPA and
    /// attention-sink attention.
    list_attention: unsafe extern "C" fn(
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        i64,
        *const c_void,
        i64,
        i64,
        *mut c_char,
        usize,
    ) -> *mut c_void;
    /// q, k, v, path, window: each query's whole prefix, window or nothing.
    routed_attention: unsafe extern "C" fn(
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        i64,
        *mut c_char,
        usize,
    ) -> *mut c_void;
    /// q, k, v, kpos, qpos, window, sinks, near (null: none): one query over a decoding cache.
    decode_attention: unsafe extern "C" fn(
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        i64,
        i64,
        *const c_void,
        *mut c_char,
        usize,
    ) -> *mut c_void;
    /// qkv, cos, sin, entry, pos, heads, k, v, kpos: one decoding step's q rotated, its key
    /// and value written into the cache.
    decode_step: unsafe extern "C" fn(
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        i64,
        *const c_void,
        *const c_void,
        *const c_void,
        *mut c_char,
        usize,
    ) -> *mut c_void;
    /// x, r, weight, eps, out[2]: inference's residual add and the RMSNorm after it.
    add_rms_norm: unsafe extern "C" fn(
        *const c_void,
        *const c_void,
        *const c_void,
        f64,
        *mut *mut c_void,
        *mut c_char,
        usize,
    ) -> i32;
    /// A CUDA graph of the work queued between begin and end on this thread; replayed, freed.
    graph_begin: unsafe extern "C" fn(*mut c_char, usize) -> *mut c_void;
    graph_end: unsafe extern "C" fn(*mut c_void, *mut c_char, usize) -> i32;
    graph_replay: unsafe extern "C" fn(*mut c_void, *mut c_char, usize) -> i32;
    graph_free: unsafe extern "C" fn(*mut c_void);
    /// logits, targets: the per-token cross-entropy.
    token_nll: Tensor2Fn;
    /// gate, up: the MLP's SwiGLU.
    swiglu: Tensor2Fn;
    /// gate and up joined: inference's SwiGLU.
    swiglu_joined: unsafe extern "C" fn(*const c_void, *mut c_char, usize) -> *mut c_void;
    /// x, weight, eps: RMSNorm.
    rms_norm: unsafe extern "C" fn(*const c_void, *const c_void, f64, *mut c_char, usize) -> *mut c_void;
    /// x, cos, sin (null: no rotation), to_heads: the head moves, with rope on the way in.
    heads: unsafe extern "C" fn(
        *const c_void,
        *const c_void,
        *const c_void,
        i32,
        *mut c_char,
        usize,
    ) -> *mut c_void;
    /// c, o, w: AHA's straight-through mix.
    st_mix: Tensor3Fn;
    /// s, tau, sample, seed, layer, start, window, out[5]: AHA's gates of a layer.
    aha_gates: unsafe extern "C" fn(
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
    /// x, w, b: a router's scores.
    router: Tensor3Fn;
    /// grads, n, norm: the global gradient norm.
    grad_norm: unsafe extern "C" fn(*const *const c_void, usize, *mut f64, *mut c_char, usize) -> i32;
    /// params, grads, exp_avg, exp_avg_sq, n, scalars: clipping and AdamW.
    adamw: unsafe extern "C" fn(
        *const *const c_void,
        *const *const c_void,
        *const *const c_void,
        *const *const c_void,
        usize,
        *const f64,
        *mut c_char,
        usize,
    ) -> i32;
    /// A CUDA timing event: new, record, elapsed milliseconds, free.
    event_new: unsafe extern "C" fn(*mut c_char, usize) -> *mut c_void;
    event_record: unsafe extern "C" fn(*mut c_void, *mut c_char, usize) -> i32;
    event_elapsed: unsafe extern "C" fn(*mut c_void, *mut c_void, *mut f64, *mut c_char, usize) -> i32;
    event_free: unsafe extern "C" fn(*mut c_void);
    /// device, reset, out[5]: the allocator's current, peak and reserved bytes, the device's
    /// free and total memory.
    cuda_memory: unsafe extern "C" fn(i64, i32, *mut f64, *mut c_char, usize) -> i32;
    /// start, trace path: PyTorch's profiler over the GPU's work, its Chrome trace written at
    /// the stop.
    profile: unsafe extern "C" fn(i32, *const c_char, *mut c_char, usize) -> i32;
    /// host, port, rank, world, device (-1: the CPU), timeout in seconds: this rank's
    /// membership of a data-parallel job (`kernels/dist.cpp`).
    dist_new: unsafe extern "C" fn(
        *const c_char,
        i64,
        i64,
        i64,
        i64,
        f64,
        *mut c_char,
        usize,
    ) -> *mut c_void;
    dist_free: unsafe extern "C" fn(*mut c_void);
    /// Shuts the membership's backends down as at a normal exit (before `dist_free`).
    dist_close: unsafe extern "C" fn(*mut c_void, *mut c_char, usize) -> i32;
    /// tensors, n: each summed over the ranks, in place.
    dist_sum: unsafe extern "C" fn(*mut c_void, *const *const c_void, usize, *mut c_char, usize) -> i32;
    /// tensors, n: rank 0's values given to every rank, in place.
    dist_broadcast:
        unsafe extern "C" fn(*mut c_void, *const *const c_void, usize, *mut c_char, usize) -> i32;
    /// params, n, first bucket bytes, bucket bytes: DDP's reducer over the parameters.
    dist_reducer: unsafe extern "C" fn(
        *mut c_void,
        *const *const c_void,
        usize,
        i64,
        i64,
        *mut c_char,
        usize,
    ) -> i32;
    /// Arms the reducer for the next backward.
    dist_arm: unsafe extern "C" fn(*mut c_void, *mut c_char, usize) -> i32;
    /// After the armed backward: zeros through the parameters it did not reach (their count
    /// out), and the check that every bucket was reduced.
    dist_finish: unsafe extern "C" fn(*mut c_void, *mut i64, *mut c_char, usize) -> i32;
}

/// A tensor's handle as the library's entry points take it.
pub(super) fn ptr(t: &Tensor) -> *const c_void {
    t.as_ptr() as *const c_void
}

/// Runs an entry point that returns a new object (null with a message in its error buffer,
/// which `f` receives): the object, or the message as an error.
pub(super) fn new_object(
    what: &str,
    f: impl FnOnce(*mut c_char, usize) -> *mut c_void,
) -> Result<*mut c_void> {
    let mut err = vec![0 as c_char; 1024];
    let out = f(err.as_mut_ptr(), err.len());
    ensure!(!out.is_null(), "{what}: {}", library_error(&err));
    Ok(out)
}

/// `new_object` for an entry point that returns a new at::Tensor*.
pub(super) fn new_tensor(
    what: &str,
    f: impl FnOnce(*mut c_char, usize) -> *mut c_void,
) -> Result<Tensor> {
    let out = new_object(what, f)?;
    // Safety: a heap at::Tensor* whose ownership passes to us.
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

/// Runs an entry point that returns 0, or 1 with a message in its error buffer (which `f`
/// receives): the message as an error.
pub(super) fn status(what: &str, f: impl FnOnce(*mut c_char, usize) -> i32) -> Result<()> {
    let mut err = vec![0 as c_char; 1024];
    let rc = f(err.as_mut_ptr(), err.len());
    ensure!(rc == 0, "{what}: {}", library_error(&err));
    Ok(())
}

/// One two-tensor entry point of the library.
pub(super) fn call2(f: Tensor2Fn, what: &str, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    new_tensor(what, |e, n| unsafe { f(ptr(a), ptr(b), e, n) })
}

/// One three-tensor entry point of the library.
pub(super) fn call3(
    f: Tensor3Fn,
    what: &str,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
) -> Result<Tensor> {
    new_tensor(what, |e, n| unsafe { f(ptr(a), ptr(b), ptr(c), e, n) })
}

fn library_error(err: &[c_char]) -> String {
    unsafe { CStr::from_ptr(err.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

pub(super) fn pointers(ts: &[Tensor]) -> Vec<*const c_void> {
    ts.iter().map(ptr).collect()
}
