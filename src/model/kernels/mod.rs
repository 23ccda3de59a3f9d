//! The kernel path: the C++/CUDA library in `kernels/` (sources compiled into this binary),
//! built on demand by `attnsweep kernels build` (`build.rs`) and loaded at run time; its C
//! interface is declared once in `ffi.rs`, and this file wraps each entry point in a typed,
//! documented method.
//!
//! Builds are cached under `<cache>/<variant>-<source hash>-<torch hash>/`, where the variant
//! is `cuda-smXY` (nvcc, for the GPU found) or `cpu` (g++: the same autograd layer with an
//! ATen reference in place of the kernels, which is what CI tests). The cache is
//! `$ATTNSWEEP_KERNELS_DIR`, else `kernels-cache/` beside the binary.

mod build;
pub(crate) mod dist;
mod ffi;
#[cfg(test)]
pub(crate) mod tests;

pub(crate) use build::{build, find, Variant};

use crate::config::AttnImpl;
use anyhow::{ensure, Context, Result};
use build::ABI;
use ffi::{call2, call3, new_object, new_tensor, pointers, ptr, status, EntryPoints};
use libloading::{Library, Symbol};
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use tch::{Device, Kind, Tensor};

/// One AdamW step's scalars for [`Kernels::adamw`].
pub(crate) struct AdamWStep {
    pub(crate) lr: f64,
    pub(crate) beta1: f64,
    pub(crate) beta2: f64,
    pub(crate) eps: f64,
    pub(crate) weight_decay: f64,
    /// Bias corrections `1 - beta^t`.
    pub(crate) bc1: f64,
    pub(crate) bc2: f64,
    /// Factor the gradients are scaled by first (1: no clipping).
    pub(crate) clip: f64,
}

/// AHA's gates of one layer ([`Kernels::aha_gates`]).
#[derive(Debug)]
pub(crate) struct AhaGates {
    /// `[B, H, L]` zeros whose gradient reaches the router scores: the straight-through mix's
    /// weight (`Kernels::st_mix`).
    pub(crate) weight: Tensor,
    /// `[B, L, H]` fp32, 1 where the gate is open (the whole prefix).
    pub(crate) hard: Tensor,
    /// `[B, H, L]` `QueryPath`s each query runs with gradient: the one its gate picked.
    pub(crate) chosen: Tensor,
    /// `[B, H, L]` `QueryPath`s the straight-through gradient also reads: the window of open
    /// gates, the whole prefix of probed window gates, nothing elsewhere.
    pub(crate) other: Tensor,
    /// Key-query pairs the chosen paths attend (fp64 scalar).
    pub(crate) pairs: Tensor,
}

/// What a query of routed attention sees: `Kernels::routed_attention`'s `path` values (uint8),
/// in increasing order of reach.
#[derive(Clone, Copy)]
#[repr(u8)]
pub(crate) enum QueryPath {
    /// No key: what the zeros of a paths tensor mean (`query_paths` leaves them where a query
    /// takes neither path); only the kernels' tests write it by name.
    #[cfg(test)]
    Nothing = 0,
    Window = 1,
    Full = 2,
}

/// Memory of a CUDA device, in bytes ([`Kernels::cuda_memory`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CudaMemory {
    /// Held in tensors by the caching allocator now.
    pub(crate) allocated: f64,
    /// The most held in tensors since the last reset.
    pub(crate) peak: f64,
    /// Taken from the driver by the allocator: its tensors and its cache.
    pub(crate) reserved: f64,
    /// Free on the device (the driver's count: the allocator's cache is not free).
    pub(crate) free: f64,
    pub(crate) total: f64,
}

/// A CUDA timing event of a library built with CUDA ([`Kernels::event`]).
pub(crate) struct Event<'a> {
    kern: &'a Kernels,
    raw: *mut c_void,
}

impl Event<'_> {
    /// Records the event on the current stream.
    pub(crate) fn record(&self) -> Result<()> {
        status("CUDA event", |e, n| unsafe {
            (self.kern.f.event_record)(self.raw, e, n)
        })
    }

    /// Milliseconds on the device's clock from `start` to this event, once this one is reached.
    pub(crate) fn ms_since(&self, start: &Event) -> Result<f64> {
        let mut ms = 0f64;
        status("CUDA event", |e, n| unsafe {
            (self.kern.f.event_elapsed)(start.raw, self.raw, &mut ms, e, n)
        })?;
        Ok(ms)
    }
}

impl Drop for Event<'_> {
    fn drop(&mut self) {
        unsafe { (self.kern.f.event_free)(self.raw) }
    }
}

/// A CUDA graph captured by [`Kernels::capture`]: the work of one call, replayed as it was
/// recorded (the same kernels on the same memory).
pub(crate) struct CudaGraph {
    kern: &'static Kernels,
    raw: *mut c_void,
}

impl CudaGraph {
    /// Runs the recorded work again, on the current stream.
    pub(crate) fn replay(&self) -> Result<()> {
        status("CUDA graph replay", |e, n| unsafe {
            (self.kern.f.graph_replay)(self.raw, e, n)
        })
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        unsafe { (self.kern.f.graph_free)(self.raw) }
    }
}

/// Ends a capture however the captured closure ends (a panic inside it included), so the
/// thread's stream is never left capturing.
struct Capturing(Option<CudaGraph>);

impl Capturing {
    fn end(&mut self) -> Result<CudaGraph> {
        let g = self.0.take().expect("a capture ends once");
        status("CUDA graph capture", |e, n| unsafe {
            (g.kern.f.graph_end)(g.raw, e, n)
        })?;
        Ok(g)
    }
}

impl Drop for Capturing {
    fn drop(&mut self) {
        if self.0.is_some() {
            let _ = self.end();
        }
    }
}

/// The library where it takes `x`'s dtype: the fused element-wise kernels take fp32 and bf16.
pub(crate) fn kernel_for<'a>(kernels: Option<&'a Kernels>, x: &Tensor) -> Option<&'a Kernels> {
    kernels.filter(|_| matches!(x.kind(), Kind::Float | Kind::BFloat16))
}

/// A loaded kernel library.
pub(crate) struct Kernels {
    _lib: Library,
    f: EntryPoints,
    pub(crate) cuda: bool,
    pub(crate) path: PathBuf,
}

impl Kernels {
    pub(crate) fn load(path: &Path) -> Result<Kernels> {
        // Safety: the library is ours, built from this binary's sources against the libtorch
        // this process already links; its initialisers only register nothing global. Its
        // interface version is checked before any other entry point is looked up.
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
            let f = EntryPoints::resolve(&lib)?;
            Ok(Kernels {
                cuda: (f.kernels_cuda)() != 0,
                f,
                _lib: lib,
                path: path.to_path_buf(),
            })
        }
    }

    /// Attention of queries `q: [B, H, Lq, D]` over `k, v: [B, Hkv, L, D]`: query r at position
    /// `qpos[b, h, r]` (int32, ascending; all positions when None) sees keys at most `window - 1`
    /// before it; rows `r >= nq[b, h]` are inactive and return zeros. Differentiable in q, k, v.
    pub(crate) fn list_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        list: Option<(&Tensor, &Tensor)>,
        window: i64,
    ) -> Result<Tensor> {
        self.call_attention(q, k, v, list, window, None, 0)
    }

    /// Routed attention of `q: [B, H, L, D]` over `k, v: [B, Hkv, L, D]`: per query, `path:
    /// [B, H, L]` (uint8, `QueryPath` values) says whether it sees its whole prefix, its `window`,
    /// or nothing (zeros). The paths' queries form one list per (b, h), compacted on the
    /// device, so each query runs only its own path, in one launch. Differentiable in q, k, v.
    pub(crate) fn routed_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        path: &Tensor,
        window: i64,
    ) -> Result<Tensor> {
        new_tensor("routed attention kernel", |e, n| unsafe {
            (self.f.routed_attention)(ptr(q), ptr(k), ptr(v), ptr(path), window, e, n)
        })
    }

    /// PPA attention of `q: [B, H, L, D]` over `k, v: [B, Hkv, L, D]`: each query sees its
    /// window and the keys at the distances in `offsets` (the power offsets beyond the window).
    /// Differentiable in q, k, v.
    pub(crate) fn ppa_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        window: i64,
        offsets: &PpaOffsets,
    ) -> Result<Tensor> {
        self.call_attention(q, k, v, None, window, Some(offsets), 0)
    }

    /// Attention with sinks of `q: [B, H, L, D]` over `k, v: [B, Hkv, L, D]`: each query sees
    /// its window and the sequence's first `sinks` keys (on the GPU the window's tiles, then the
    /// sinks beyond it pair by pair). Differentiable in q, k, v.
    pub(crate) fn sink_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        window: i64,
        sinks: i64,
    ) -> Result<Tensor> {
        self.call_attention(q, k, v, None, window, None, sinks)
    }

    #[allow(clippy::too_many_arguments)]
    fn call_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        list: Option<(&Tensor, &Tensor)>,
        window: i64,
        offsets: Option<&PpaOffsets>,
        sinks: i64,
    ) -> Result<Tensor> {
        let (qpos, nq) = match list {
            Some((p, n)) => (ptr(p), ptr(n)),
            None => (std::ptr::null(), std::ptr::null()),
        };
        let (offsets, pairs_from) = offsets.map_or((std::ptr::null(), 0), |o| {
            (ptr(&o.tensor), o.pairs_from as i64)
        });
        new_tensor("attention kernel", |e, n| unsafe {
            (self.f.list_attention)(
                ptr(q),
                ptr(k),
                ptr(v),
                qpos,
                nq,
                window,
                offsets,
                pairs_from,
                sinks,
                e,
                n,
            )
        })
    }

    /// Per-token next-token NLL (fp32, shaped like `targets`) of `logits: [..., V]` (fp32 or
    /// bf16, read in their dtype; the gradient comes back in it), differentiable in logits.
    pub(crate) fn token_nll(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        call2(self.f.token_nll, "cross-entropy kernel", logits, targets)
    }

    /// The MLP's gate `silu(gate) * up` (both fp32 or both bf16, one shape) in one kernel,
    /// computed in fp32; differentiable in both.
    pub(crate) fn swiglu(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        call2(self.f.swiglu, "SwiGLU kernel", gate, up)
    }

    /// Inference's gate `silu(gate) * up` from one joined projection `gu: [..., 2F]` (each
    /// row the gate's F values, then the up projection's) to `[..., F]`: one product for both
    /// maps, their halves read in place. No autograd: decoding's.
    pub(crate) fn swiglu_joined(&self, gu: &Tensor) -> Result<Tensor> {
        new_tensor("SwiGLU kernel", |e, n| unsafe {
            (self.f.swiglu_joined)(ptr(gu), e, n)
        })
    }

    /// RMSNorm of `x: [..., d]` (fp32 or bf16) with `weight: [d]` (fp32), computed in fp32,
    /// returned in x's dtype; differentiable in both.
    pub(crate) fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
        new_tensor("RMSNorm kernel", |e, n| unsafe {
            (self.f.rms_norm)(ptr(x), ptr(weight), eps, e, n)
        })
    }

    /// Rotary embedding of `x: [B, L, H, D]` (fp32 or bf16) at angles with `cos, sin: [L, D]`
    /// (read in x's dtype where they have it, else in fp32), returned transposed to
    /// `[B, H, L, D]` (as attention reads it); differentiable in x.
    pub(crate) fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        self.move_heads("rope kernel", x, Some((cos, sin)), true)
    }

    /// The work `f` queues on this thread's current stream, captured as a CUDA graph instead
    /// of run: `f` must queue only device work whose shapes and addresses hold at every
    /// replay, reading nothing back to the host. An error where the library was built
    /// without CUDA, or the work cannot be captured.
    pub(crate) fn capture(&'static self, f: impl FnOnce()) -> Result<CudaGraph> {
        let raw = new_object("CUDA graph capture", |e, n| unsafe {
            (self.f.graph_begin)(e, n)
        })?;
        let mut capturing = Capturing(Some(CudaGraph { kern: self, raw }));
        f();
        capturing.end()
    }

    /// Attention of one query a row (`q: [B, H, 1, D]`) over a decoding cache's slot (`k, v:
    /// [B, Hkv, S, D]`, `kpos: [S]` int64, -1 where empty) from the query's position `qpos`
    /// (int64 `[1]`, on the device): the entries at distances `d = qpos - kpos >= 0` inside
    /// `window` (< 0: every one), the first `sinks` positions, and PPA's distances where
    /// `near[d]` (bool `[T]`, the last entry standing for every farther one). bf16 on the GPU,
    /// the ATen reference on the CPU.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn decode_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        kpos: &Tensor,
        qpos: &Tensor,
        window: i64,
        sinks: i64,
        near: Option<&Tensor>,
    ) -> Result<Tensor> {
        let near = near.map_or(std::ptr::null(), ptr);
        new_tensor("decode attention kernel", |e, n| unsafe {
            (self.f.decode_attention)(
                ptr(q),
                ptr(k),
                ptr(v),
                ptr(kpos),
                ptr(qpos),
                window,
                sinks,
                near,
                e,
                n,
            )
        })
    }

    /// One decoding step's projections `qkv: [B, 1, (H + 2 Hkv) D]` (q, k, v of every head side
    /// by side) into `q: [B, H, 1, D]` rotated by `cos, sin: [1, D]`, with the rotated key and
    /// the value written into entry `entry` (int64 `[1]`, on the device) of a cache slot `k, v:
    /// [B, Hkv, S, D]` and the position `pos` (int64 `[1]`) into `kpos[entry]`: the rotations,
    /// head moves and cache writes of a step in one launch. bf16 on the GPU, the ATen
    /// reference otherwise.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn decode_step(
        &self,
        qkv: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        entry: &Tensor,
        pos: &Tensor,
        heads: i64,
        k: &Tensor,
        v: &Tensor,
        kpos: &Tensor,
    ) -> Result<Tensor> {
        new_tensor("decode step kernel", |e, n| unsafe {
            (self.f.decode_step)(
                ptr(qkv),
                ptr(cos),
                ptr(sin),
                ptr(entry),
                ptr(pos),
                heads,
                ptr(k),
                ptr(v),
                ptr(kpos),
                e,
                n,
            )
        })
    }

    /// The residual add and the RMSNorm after it, in one launch each way: `(h, norm(h))` with
    /// `h = x + r` (fp32 or bf16 alike, `[..., d]`) in x's dtype, the norm's weight `[d]` fp32;
    /// both outputs differentiable.
    pub(crate) fn add_rms_norm(
        &self,
        x: &Tensor,
        r: &Tensor,
        weight: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Tensor)> {
        let mut out = [std::ptr::null_mut::<c_void>(); 2];
        status("residual add and RMSNorm kernel", |e, n| unsafe {
            (self.f.add_rms_norm)(ptr(x), ptr(r), ptr(weight), eps, out.as_mut_ptr(), e, n)
        })?;
        // Safety: two heap at::Tensor* whose ownership passes to us.
        let [h, y] = out.map(|p| unsafe { Tensor::from_ptr(p as *mut torch_sys::C_tensor) });
        Ok((h, y))
    }

    /// A timing event on the GPU's clock (what `torch.cuda.Event` measures); an error where
    /// the library was built without CUDA.
    pub(crate) fn event(&self) -> Result<Event<'_>> {
        let raw = new_object("CUDA event", |e, n| unsafe { (self.f.event_new)(e, n) })?;
        Ok(Event { kern: self, raw })
    }

    /// Memory of CUDA device `device` now (`CudaMemory`); with `reset`, the peak starts again
    /// from now. An error where the library was built without CUDA.
    pub(crate) fn cuda_memory(&self, device: usize, reset: bool) -> Result<CudaMemory> {
        self.memory_call(device, i32::from(reset))
    }

    /// Gives the caching allocator's unused blocks on `device` back to the driver
    /// (`torch.cuda.empty_cache`), then its memory as [`Kernels::cuda_memory`] reads it.
    pub(crate) fn release_cache(&self, device: usize) -> Result<CudaMemory> {
        self.memory_call(device, 2)
    }

    fn memory_call(&self, device: usize, flags: i32) -> Result<CudaMemory> {
        let mut out = [0f64; 5];
        status("CUDA memory", |e, n| unsafe {
            (self.f.cuda_memory)(device as i64, flags, out.as_mut_ptr(), e, n)
        })?;
        let [allocated, peak, reserved, free, total] = out;
        Ok(CudaMemory {
            allocated,
            peak,
            reserved,
            free,
            total,
        })
    }

    /// Starts recording the GPU's work with PyTorch's profiler (`profile_stop` ends it); an
    /// error where the library was built without CUDA.
    pub(crate) fn profile_start(&self) -> Result<()> {
        status("profiler", |e, n| unsafe {
            (self.f.profile)(1, std::ptr::null(), e, n)
        })
    }

    /// Stops the recording `profile_start` began and writes its Chrome trace to `trace`.
    pub(crate) fn profile_stop(&self, trace: &Path) -> Result<()> {
        let path = std::ffi::CString::new(trace.to_string_lossy().as_bytes())
            .with_context(|| format!("{} holds a NUL byte", trace.display()))?;
        status("profiler", |e, n| unsafe {
            (self.f.profile)(0, path.as_ptr(), e, n)
        })
    }

    /// `x: [B, L, H, D]` (fp32 or bf16) as a contiguous `[B, H, L, D]`; differentiable.
    pub(crate) fn to_heads(&self, x: &Tensor) -> Result<Tensor> {
        self.move_heads("head transpose kernel", x, None, true)
    }

    /// `y: [B, H, L, D]` (fp32 or bf16) as a contiguous `[B, L, H, D]`; differentiable.
    pub(crate) fn from_heads(&self, y: &Tensor) -> Result<Tensor> {
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
            (self.f.heads)(ptr(x), cos, sin, i32::from(to_heads), e, n)
        })
    }

    /// AHA's straight-through mix `c + w * (sg(c) - o)` of `c, o: [B, H, L, D]` (bf16 on the
    /// GPU) with one weight a row, `w: [B, H, L]`: equal to `c` where `w` is 0, with gradient
    /// `dy` for `c` and `rowsum(dy * (c - o))` for `w` (none for `o`). One kernel each way.
    pub(crate) fn st_mix(&self, c: &Tensor, o: &Tensor, w: &Tensor) -> Result<Tensor> {
        call3(self.f.st_mix, "straight-through mix kernel", c, o, w)
    }

    /// A router's scores `sigmoid(x w^T + b)` (fp32, `[..., heads]`) of `x: [..., d]` (bf16 or
    /// fp32) with `w: [heads, d]` and `b: [heads]` (fp32), as `Linear::forward` on the fp32 `x`
    /// followed by a sigmoid computes them, reading `x` once in its own dtype each way;
    /// differentiable in x, w and b.
    pub(crate) fn router(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        let none = Tensor::zeros([0], (Kind::Float, x.device()));
        call3(self.f.router, "router kernel", x, w, b.unwrap_or(&none))
    }

    /// AHA's gates of one layer from router scores `s: [B, L, H]` (fp32) in one pass: open
    /// where `s > tau`; with `sample < 1` a window gate is probed where the hash draw of
    /// `(seed, layer, b, start + l, h)` is below `sample` (`attention/gates.rs`, `hash_uniform`), and
    /// `sample = 1` probes every one (the exact straight-through gradient). The weight's
    /// gradient reaches `s` as the straight-through gradient, scaled by `1 / sample` at probes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn aha_gates(
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
            (self.f.aha_gates)(
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
    pub(crate) fn grad_norm(&self, grads: &[Tensor]) -> Result<f64> {
        let mut norm = 0f64;
        let p = pointers(grads);
        status("gradient norm kernel", |e, n| unsafe {
            (self.f.grad_norm)(p.as_ptr(), p.len(), &mut norm, e, n)
        })?;
        Ok(norm)
    }

    /// Clipping and AdamW over all parameters in one launch, in place; the four slices are
    /// parallel (parameter, gradient, first and second moment), all fp32 and contiguous.
    pub(crate) fn adamw(
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
            (self.f.adamw)(
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

/// PPA's offsets beyond the window (int32, strictly ascending, each in `[window, L)`) on a
/// device, and where the GPU kernels split them: the nearer ones run in the tile kernels, those
/// from index `pairs_from` on pair by pair (kernels/attention.cu, far pairs). The CPU reference
/// takes them all at once, whatever the split.
pub(crate) struct PpaOffsets {
    pub(crate) tensor: Tensor,
    pub(crate) pairs_from: usize,
}

/// The gap between consecutive far distances from which the pair kernels take them over. Past
/// it a tile holds about one seen pair a row per PPA_PAIR_GAP keys; measured on the attention
/// bench from 16 to 96 and tiles only (PERFORMANCE.md, "PPA's sparse far distances pair by
/// pair"): 24 to 48 within a few percent of each other, 96 up to 40% slower for p = 0.5, 16
/// 13% slower for p = 0.75 at L 32768.
pub(crate) const PPA_PAIR_GAP: i64 = 32;

impl PpaOffsets {
    /// Split where the GPU kernels run fastest: pairs from the first offset after which every
    /// one lies at least PPA_PAIR_GAP from a neighbour (the previous offset, or the window's
    /// last distance for the first; or the next). A lone offset near the window (p = 0.25's 81
    /// at w = 64) goes to the pairs too: kept, it alone held the tile kernels on their PPA
    /// instantiation, whose forward took as long at w = 64 as the window kernel at w = 256
    /// (PERFORMANCE.md, "PPA's sparse far distances pair by pair").
    pub(crate) fn new(offsets: &[i32], window: usize, device: Device) -> Self {
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

    pub(crate) fn split_at(offsets: &[i32], pairs_from: usize, device: Device) -> Self {
        PpaOffsets {
            tensor: Tensor::from_slice(offsets).to_device(device),
            pairs_from,
        }
    }

    pub(crate) fn shallow_clone(&self) -> Self {
        PpaOffsets {
            tensor: self.tensor.shallow_clone(),
            pairs_from: self.pairs_from,
        }
    }
}

static CUDA_KERNELS: OnceLock<Option<Kernels>> = OnceLock::new();

/// The CUDA kernel library, if one is built for this binary's sources (loaded once).
pub(crate) fn cuda() -> Option<&'static Kernels> {
    CUDA_KERNELS
        .get_or_init(|| {
            let cc = build::gpu_capability().ok()?;
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
pub(crate) fn cpu() -> Result<&'static Kernels> {
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
pub(crate) fn for_model(
    imp: AttnImpl,
    device: Device,
    compute: Kind,
    head_dim: usize,
) -> Result<Option<&'static Kernels>> {
    let fits = compute == Kind::BFloat16 && (head_dim == 64 || head_dim == 128);
    match imp {
        AttnImpl::Reference => Ok(None),
        AttnImpl::Auto if !device.is_cuda() => Ok(None),
        AttnImpl::Auto => {
            let kernels = cuda();
            if kernels.is_some() && !fits {
                // Said once a model: the whole model then runs the reference path.
                eprintln!(
                    "warning: the attention kernels take bf16 and head_dim 64 or 128, not \
                     {compute:?} and {head_dim}: this model runs the reference path (ATen, slower)"
                );
            }
            Ok(kernels.filter(|_| fits))
        }
        AttnImpl::Cuda if device.is_cuda() => {
            ensure!(fits, "attention.attn_impl = \"cuda\" needs train.dtype = \"bf16\" and head_dim 64 or 128 (got {compute:?}, {head_dim})");
            cuda().map(Some).context("attention.attn_impl = \"cuda\" but no CUDA kernel library is built for this binary (or the one found failed to load: see the warning above); run `attnsweep kernels build`")
        }
        AttnImpl::Cuda => cpu().map(Some),
    }
}
