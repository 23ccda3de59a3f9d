"""Peers of attnsweep's attention kernels, timed on the same shapes in the same run:
scaled_dot_product_attention with the cuDNN and flash backends (full causal) and
FlexAttention (sliding window; full causal over a compacted list of active queries;
per-(token, head) routing between the full prefix and the window, the gates read by the
mask function; PPA, the window plus the power offsets as a BlockMask). FlexAttention runs at
its best in three forms, a row each: `flex` as compiled by default, `flex_tuned` compiled with
`max-autotune-no-cudagraphs` (inductor times its kernels' tile configurations and keeps the
fastest), and `flex_flash` with the FLASH backend (FlashAttention-4's CuTe kernels) where this
torch has it.

Driven by `attnsweep bench attention`; prints CSV rows
impl,case,L,D,window,sparsity,fwd_ms,fwdbwd_ms,fwd_host_ms,fwdbwd_host_ms on stdout (one per
measurement; see times_ms for the two protocols).
Inputs: bf16, batch 1, standard normal with a fixed seed.
"""

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def ints(s):
    return [int(x) for x in s.split(",") if x]


def floats(s):
    return [float(x) for x in s.split(",") if x]


def times_ms(fn, reps):
    """(device, host) milliseconds of one call of fn, by the protocol attnsweep times its own
    kernels with (`src/cli/bench.rs`, `times`), after three calls to warm up. Device: reps calls
    back to back between one pair of CUDA events, divided by reps, the median of three such
    batches: the host queues the next call while the GPU runs the last, so launch overhead
    (large for a compiled call from Python) is hidden for every implementation alike. Host: each
    call alone between synchronisations on the host's clock, the median over reps."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    device = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        device.append(start.elapsed_time(end) / reps)
    host = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        host.append((time.perf_counter() - t0) * 1e3)
    device.sort()
    host.sort()
    return device[1], host[len(host) // 2]


def fwd_and_fwdbwd(attn, q, k, v, reps):
    """(fwd, fwd+bwd) under the device protocol, then both under the host protocol. The
    backward, as attnsweep's (`src/cli/bench.rs`, `time_op`): dO = 1 filled inside the call, the
    gradients returned, not accumulated into .grad."""
    fwd = times_ms(lambda: attn(q, k, v), reps)
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))

    def both():
        out = attn(qg, kg, vg)
        torch.autograd.grad(out, (qg, kg, vg), torch.ones_like(out), allow_unused=True)

    fwdbwd = times_ms(both, reps)
    return fwd[0], fwdbwd[0], fwd[1], fwdbwd[1]


def power_offset(j, p):
    """PPA's offset set S_p: floor(j^p) - floor((j-1)^p) = 1 (0^p = 0), as attnsweep defines it."""
    if j == 0:
        return False
    fl = lambda x: math.floor(x**p + 1e-9 * max(x**p, 1.0)) if x > 0 else (1 if p == 0 else 0)
    return fl(j) - fl(j - 1) == 1


def row(*fields):
    print(",".join(str(f) for f in fields), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=ints, required=True)
    ap.add_argument("--head-dims", type=ints, required=True)
    ap.add_argument("--windows", type=ints, default=[])
    ap.add_argument("--sparsities", type=floats, default=[])
    ap.add_argument("--routed-usages", type=floats, default=[])
    ap.add_argument("--ppa-powers", type=floats, default=[])
    ap.add_argument("--ppa-window", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-flex", action="store_true")
    a = ap.parse_args()
    dev = "cuda"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # Every shape and mask compiles anew; past the default recompile limit torch falls
        # back to an eager dense implementation that is neither fast nor small.
        torch._dynamo.config.cache_size_limit = 256
        torch._dynamo.config.accumulated_cache_size_limit = 4096
        compiled = torch.compile(flex_attention, dynamic=False)
        tuned = torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs")
        flexes = [
            ("flex", lambda q, k, v, bm: compiled(q, k, v, block_mask=bm)),
            ("flex_tuned", lambda q, k, v, bm: tuned(q, k, v, block_mask=bm)),
            ("flex_flash", lambda q, k, v, bm: compiled(q, k, v, block_mask=bm, kernel_options={"BACKEND": "FLASH"})),
        ]
    except Exception as e:  # an older torch without FlexAttention
        print(f"# FlexAttention unavailable: {e}", file=sys.stderr)
        flexes = []
    if a.no_flex:
        flexes = []
    # A form whose backend this torch lacks is not tried again.
    failed = set()

    def each_flex(label, q, k, v, make_mask, *fields):
        try:
            bm = make_mask()
        except Exception as e:
            print(f"# flex {label}: its block mask: {type(e).__name__}", file=sys.stderr)
            torch.cuda.empty_cache()
            return
        for name, fn in flexes:
            if name in failed:
                continue
            try:
                t = fwd_and_fwdbwd(lambda q, k, v: fn(q, k, v, bm), q, k, v, a.reps)
                row(name, *fields, *t)
            except Exception as e:
                print(f"# {name} {label}: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
                torch.cuda.empty_cache()
                # A backend this torch lacks fails every case alike; any other failure (a
                # head dim it rejects, memory) is this case's alone.
                if name == "flex_flash" and "not available" in str(e):
                    failed.add(name)
    for L in a.lengths:
        for D in a.head_dims:
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, a.heads, L, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
            for name, backend in [("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)]:
                def causal(q, k, v, backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                try:
                    t = fwd_and_fwdbwd(causal, q, k, v, a.reps)
                    row(name, "causal", L, D, L, 0, *t)
                except Exception as e:
                    print(f"# {name} L={L} D={D}: {type(e).__name__}", file=sys.stderr)
                    torch.cuda.empty_cache()
            if not flexes:
                continue
            torch.cuda.empty_cache()
            for w in a.windows:
                def swa(b, h, qi, ki, w=w):
                    return (qi >= ki) & (qi - ki < w)
                each_flex(f"swa L={L} D={D} w={w}", q, k, v, lambda: create_block_mask(swa, 1, 1, L, L, device=dev), "swa", L, D, w, 0)
            for s in a.sparsities:
                n = max(1, int(round(L * (1 - s))))
                pos = torch.sort(torch.randperm(L, device=dev)[:n]).values
                qc = q[:, :, pos].contiguous()

                def sparse(b, h, qi, ki, pos=pos):
                    return ki <= pos[qi]
                each_flex(f"sparse L={L} D={D} s={s}", qc, k, v, lambda: create_block_mask(sparse, 1, 1, n, L, device=dev), "sparse", L, D, L, s)
            for w in a.windows:
                for u in a.routed_usages:
                    gate = torch.rand(a.heads, L, device=dev) < u

                    def routed(b, h, qi, ki, w=w, gate=gate):
                        return (qi >= ki) & ((qi - ki < w) | gate[h, qi])
                    each_flex(f"routed L={L} D={D} w={w} u={u}", q, k, v, lambda: create_block_mask(routed, 1, a.heads, L, L, device=dev), "routed", L, D, w, 1 - u)
            for p in a.ppa_powers:
                seen = torch.tensor([d < a.ppa_window or power_offset(d, p) for d in range(L)], device=dev)

                def ppa(b, h, qi, ki, seen=seen):
                    return (qi >= ki) & seen[(qi - ki).clamp(min=0)]
                each_flex(f"ppa L={L} D={D} p={p}", q, k, v, lambda: create_block_mask(ppa, 1, 1, L, L, device=dev), f"ppa_p{p}", L, D, a.ppa_window, 0)

if __name__ == "__main__":
    main()
