"""The PyTorch a user would write: the model attnsweep trains, in plain PyTorch, timed per
training step beside attnsweep in `attnsweep bench train`.

The model is the one attnsweep builds from the same `[model]` (read from --model, a JSON of
it): a Llama-style decoder with grouped-query attention, q/k/v biases where the model has them
(Qwen2), RMSNorm of queries and keys per head (Qwen3) or over the projection (OLMo-2), the norms
before (Llama) or after (OLMo-2) attention and MLP, rotary embedding, SwiGLU MLP, and a tied or
separate head. fp32 parameters under bf16 autocast, AdamW (fused), gradient clipping, and the
loss read back every step as a training loop logs it. Attention, with FlexAttention block
masks wherever a mask is not plain causal:
  full           scaled_dot_product_attention, causal (cuDNN on an H100)
  swa            FlexAttention, sliding-window block mask
  ppa            FlexAttention, the window or a distance in PPA's S_p
  sinks          FlexAttention, the window or one of the sequence's first --sink-tokens keys
  static_hybrid  every `hybrid_every`-th layer full, the others the window
  aha            per (token, head) router: both paths (full causal and the window) computed
                 and mixed by the straight-through gate, L1 penalty on the scores (the AHA
                 paper's formulation)
  l2a            window attention s, then a second attention module (own projections) over s
                 for the queries whose gate is open only, compacted (FlexAttention over the
                 open queries' positions): o = s + d a; round(full_usage L) queries open,
                 drawn at random at each call
  swiattn        per-token router on the normed input, both branches computed (own output
                 projection each) and mixed by the straight-through gate, with the adaptive
                 regulariser gamma_base / (eps + NLL_t + alpha D_t) * softplus(r_t)

`--impls eager,compile`: each model as written (`torch_eager`) and with each block and the loss
under `torch.compile` (`torch_compile`, as torchtitan compiles per block); warm-up steps include
compilation. Each case is the peer at its best for the step's tokens: micro-batches of the
step's sequences, then of halves of them (`--micro-batches` at most), the gradients accumulated
over them; a micro-batch that runs out of memory runs again with what a PyTorch user adds:
every block under `torch.utils.checkpoint`, and the output projection and cross-entropy in
chunks of tokens, each chunk checkpointed. The compiled peer also tries each of
`--compile-modes` (torch.compile's modes: `default`, `max-autotune-no-cudagraphs`, which times
inductor's kernel configurations, and `reduce-overhead`, which replays CUDA graphs) at every
micro-batch. The fastest is the row; its setup column names the choice and every try.

Prints CSV rows impl,method,L,batch,step_ms,tokens_per_s,full_usage,peak_gib,setup,note on
stdout (a case that could not run: no time, the reason in note).

Started by torchrun (WORLD_SIZE > 1), each rank trains --tokens a step on its own GPU under
DistributedDataParallel (NCCL, torch's default buckets), the compiled blocks inside it, as
torchtitan and the PyTorch tutorials set it up; rank 0 prints the rows, tokens_per_s counting
every rank's tokens.
"""

import argparse
import contextlib
import json
import math
import time
import warnings

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # an older torch: the sparse methods cannot run
    create_block_mask = flex_attention = None

GIB = float(1 << 30)
# create_block_mask(..., _compile=True) builds the block masks of long sequences without their
# [L, L] dense form; torch 2.11 says the flag will go.
warnings.filterwarnings("ignore", message="_compile flag on create_block_mask")
LOSS_CHUNK = 8192  # tokens a chunk of the loss, where the loss runs in chunks


def rms_norm(x, weight, eps):
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rotate(x, cos, sin):
    """Rotary embedding, Hugging Face's "rotate half" layout."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def power_offsets(length, p):
    """Offsets j >= 1 where floor(j^p) steps by one (PPA's S_p; 0^p = 0)."""
    j = torch.arange(1, length, dtype=torch.float64)
    return j[(torch.floor(j**p) - torch.floor((j - 1) ** p)) == 1].long()


class Projections(nn.Module):
    """q, k, v and o of one attention module, with the model's biases and q/k norms."""

    def __init__(self, m):
        super().__init__()
        d, hd = m["hidden_size"], m["head_dim"]
        h, kv = m["num_attention_heads"], m["num_key_value_heads"]
        bias = m["attention_bias"]
        self.q_proj = nn.Linear(d, h * hd, bias=bias)
        self.k_proj = nn.Linear(d, kv * hd, bias=bias)
        self.v_proj = nn.Linear(d, kv * hd, bias=bias)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.qk_norm, self.eps = m["qk_norm"], m["rms_norm_eps"]
        if self.qk_norm == "per_head":
            self.q_norm, self.k_norm = nn.Parameter(torch.ones(hd)), nn.Parameter(torch.ones(hd))
        elif self.qk_norm == "full":
            self.q_norm, self.k_norm = nn.Parameter(torch.ones(h * hd)), nn.Parameter(torch.ones(kv * hd))
        self.h, self.kv, self.hd = h, kv, hd

    def qkv(self, x, cos, sin):
        b, l, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q = q.view(b, l, self.h, self.hd).transpose(1, 2)
        k = k.view(b, l, self.kv, self.hd).transpose(1, 2)
        v = v.view(b, l, self.kv, self.hd).transpose(1, 2)
        if self.qk_norm == "per_head":
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def out(self, y):
        b, _, l, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(b, l, -1))


def causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class Block(nn.Module):
    def __init__(self, m, a, index):
        super().__init__()
        d = m["hidden_size"]
        self.method, self.eps = a.method, m["rms_norm_eps"]
        if a.method == "static_hybrid":
            self.method = "full" if (index + 1) % a.hybrid_every == 0 else "swa"
        self.post = m["norm_placement"] == "post"
        self.full_usage = a.full_usage
        self.norm1 = nn.Parameter(torch.ones(d))
        self.norm2 = nn.Parameter(torch.ones(d))
        self.attn = Projections(m)
        self.gate_proj = nn.Linear(d, m["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(d, m["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(m["intermediate_size"], d, bias=False)
        # About `full_usage` of the gates open at the start (unit-variance logits).
        open_bias = math.sqrt(2) * torch.erfinv(torch.tensor(2 * a.full_usage - 1)).item()
        if a.method in ("aha", "swiattn"):
            self.router = nn.Linear(d, m["num_attention_heads"] if a.method == "aha" else 1)
            nn.init.normal_(self.router.weight, std=d**-0.5)
            nn.init.constant_(self.router.bias, open_bias)
        if a.method == "swiattn":
            self.swa_o_proj = nn.Linear(m["num_attention_heads"] * m["head_dim"], d, bias=False)
        if a.method == "l2a":
            self.global_attn = Projections(m)

    def attention(self, x, cos, sin, masks):
        p = self.attn
        q, k, v = p.qkv(x, cos, sin)
        window = lambda: masks["flex"](q, k, v, block_mask=masks["window"], enable_gqa=p.h != p.kv)
        out = {}
        if self.method == "full":
            return p.out(causal(q, k, v)), out
        if self.method == "swa":
            return p.out(window()), out
        if self.method in ("ppa", "sinks"):
            mask = masks[self.method]
            return p.out(masks["flex"](q, k, v, block_mask=mask, enable_gqa=p.h != p.kv)), out
        if self.method == "aha":
            s = torch.sigmoid(self.router(x).float())  # [B, L, H]
            hard = (s > 0.5).float()
            g = (hard + s - s.detach()).transpose(1, 2).unsqueeze(-1).to(q.dtype)
            y = g * causal(q, k, v) + (1 - g) * window()
            out["reg"], out["usage"] = s.mean(), hard.mean()
            return p.out(y), out
        if self.method == "swiattn":
            r = self.router(x).float()  # [B, L, 1]
            s = torch.sigmoid(r)
            hard = (s > 0.5).float()
            o = (hard + s - s.detach()).to(q.dtype)
            y_full, y_swa = p.out(causal(q, k, v)), self.swa_o_proj(window().transpose(1, 2).flatten(2))
            with torch.no_grad():
                out["disagreement"] = (y_full - y_swa).float().pow(2).mean(-1)  # [B, L]
            out["logit"], out["usage"] = r.squeeze(-1), hard.mean()
            return o * y_full + (1 - o) * y_swa, out
        # l2a: window attention, then the global module over its outputs for the open queries.
        s_loc = p.out(window())
        ga = self.global_attn
        b, l, _ = s_loc.shape
        gq, gk, gv = ga.qkv(s_loc, cos, sin)
        # A fixed count of open queries, drawn afresh each call: the shapes stay static, so the
        # compiled peer neither breaks its graph on a data-dependent count nor recompiles for
        # each count it meets (a careful user's padding of the routed tokens to one size).
        n = max(1, round(self.full_usage * l))
        pos = torch.randperm(l, device=x.device)[:n].sort().values
        mask = create_block_mask(lambda b_, h_, qi, ki: ki <= pos[qi], None, None, n, l, device=x.device, _compile=True)
        a = masks["flex"](gq[:, :, pos].contiguous(), gk, gv, block_mask=mask, enable_gqa=ga.h != ga.kv)
        rows = torch.zeros(b, l, s_loc.shape[-1], device=x.device, dtype=s_loc.dtype)
        rows = rows.index_copy(1, pos, ga.out(a).to(s_loc.dtype))
        out["usage"] = torch.full((), n / l, device=x.device)
        return s_loc + rows, out

    def forward(self, x, cos, sin, masks):
        if self.post:  # OLMo-2: the norms on the outputs, before the residual add
            a, out = self.attention(x, cos, sin, masks)
            x = x + rms_norm(a, self.norm1, self.eps)
            mlp = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
            return x + rms_norm(mlp, self.norm2, self.eps), out
        a, out = self.attention(rms_norm(x, self.norm1, self.eps), cos, sin, masks)
        x = x + a
        h = rms_norm(x, self.norm2, self.eps)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)), out


def chunk_nll(h, weight, targets):
    return F.cross_entropy(F.linear(h, weight).float(), targets, reduction="none")


class Model(nn.Module):
    def __init__(self, m, a):
        super().__init__()
        d = m["hidden_size"]
        self.embed_tokens = nn.Embedding(m["vocab_size"], d)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        self.layers = nn.ModuleList(Block(m, a, i) for i in range(m["num_hidden_layers"]))
        self.norm = nn.Parameter(torch.ones(d))
        self.lm_head = None if m["tie_word_embeddings"] else nn.Linear(d, m["vocab_size"], bias=False)
        self.method, self.window, self.power, self.eps = a.method, a.window, a.ppa_power, m["rms_norm_eps"]
        self.sinks = a.sink_tokens
        self.lam = 3e-4
        # SwiAttn's regulariser (the paper's defaults).
        self.gamma_base, self.swi_eps, self.alpha = 1e-3, 0.1, 100.0
        hd = m["head_dim"]
        self.inv_freq = 1.0 / (m["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        self.checkpointed, self.loss_chunk = False, None
        # FlexAttention runs fused only compiled: on its own for the eager model, inside each
        # compiled block for the compiled one (`run_case`).
        self.flex = torch.compile(flex_attention, dynamic=False) if flex_attention else None

    def masks(self, l, dev):
        if create_block_mask is None:
            return {"flex": None}
        w = self.window
        masks = {"flex": self.flex}
        masks["window"] = create_block_mask(
            lambda b, h, qi, ki: (qi >= ki) & (qi - ki < w), None, None, l, l, device=dev, _compile=True
        )
        if self.method == "ppa":
            seen = torch.zeros(l, dtype=torch.bool, device=dev)
            seen[power_offsets(l, self.power).to(dev)] = True
            masks["ppa"] = create_block_mask(
                lambda b, h, qi, ki: (qi >= ki) & ((qi - ki < w) | seen[(qi - ki).clamp(min=0)]),
                None, None, l, l, device=dev, _compile=True,
            )
        if self.method == "sinks":
            s = self.sinks
            masks["sinks"] = create_block_mask(
                lambda b, h, qi, ki: (qi >= ki) & ((qi - ki < w) | (ki < s)), None, None, l, l, device=dev, _compile=True
            )
        return masks

    def forward(self, ids, targets, masks):
        l = ids.shape[1]
        t = torch.arange(l, device=ids.device).float()
        freqs = torch.outer(t, self.inv_freq.to(ids.device))
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
        x = self.embed_tokens(ids)
        outs = []
        for layer in self.layers:
            if self.checkpointed:
                x, out = checkpoint(layer, x, cos, sin, masks, use_reentrant=False)
            else:
                x, out = layer(x, cos, sin, masks)
            outs.append(out)
        x = rms_norm(x, self.norm, self.eps)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        h, y = x.flatten(0, 1), targets.reshape(-1)
        if self.loss_chunk is None:
            nll = chunk_nll(h, weight, y)
        else:
            nll = torch.cat([
                checkpoint(chunk_nll, h[i : i + self.loss_chunk], weight, y[i : i + self.loss_chunk], use_reentrant=False)
                for i in range(0, h.shape[0], self.loss_chunk)
            ])
        loss = nll.mean()
        usages = [o["usage"] for o in outs if "usage" in o]
        if self.method == "aha":
            loss = loss + self.lam * torch.stack([o["reg"] for o in outs]).mean()
        if self.method == "swiattn":
            nll_t = nll.detach().view(targets.shape)
            reg = [
                self.gamma_base / (self.swi_eps + nll_t + self.alpha * o["disagreement"]) * F.softplus(o["logit"])
                for o in outs
            ]
            loss = loss + torch.stack(reg).mean()
        return loss, (torch.stack(usages).mean() if usages else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--tokens", type=int, required=True, help="tokens per step; batch = tokens / L")
    ap.add_argument("--methods", default="full")
    ap.add_argument("--model", required=True, help="JSON of attnsweep's [model]")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--full-usage", type=float, default=0.1)
    ap.add_argument("--micro-batches", type=int, default=3,
                    help="micro-batches tried for a step's tokens: the step's sequences, then halves of them, this many at most")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ppa-power", type=float, default=0.5)
    # attention.sink_tokens' default, which `bench train` times.
    ap.add_argument("--sink-tokens", type=int, default=4)
    ap.add_argument("--hybrid-every", type=int, default=4)
    ap.add_argument("--impls", default="eager", help="eager, compile or both")
    ap.add_argument("--compile-modes", default="default",
                    help="torch.compile modes the compiled peer tries: default, max-autotune-no-cudagraphs, reduce-overhead")
    ap.add_argument("--lr", type=float, default=3e-4, help="0 keeps the gate pattern fixed while timing")
    ap.add_argument("--profile", default="", help="one more step under torch.profiler: its Chrome trace at PREFIX_<impl>_<method>_L<L>.json")
    a = ap.parse_args()
    with open(a.model) as f:
        m = json.load(f)
    if not m.get("head_dim"):
        m["head_dim"] = m["hidden_size"] // m["num_attention_heads"]
    if WORLD > 1:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    # Every (method, length) compiles anew.
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    for impl in a.impls.split(","):
        for l in (int(x) for x in a.lengths.split(",")):
            for method in a.methods.split(","):
                a.method = method
                time_case(a, m, impl, l)


WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def say(row):
    """A row on stdout, from rank 0 only."""
    if WORLD == 1 or dist.get_rank() == 0:
        print(row, flush=True)


def micro_batch_sizes(batch, most):
    """The step's sequences, then halves of them while they divide it, `most` at most."""
    sizes = [batch]
    while len(sizes) < most and sizes[-1] % 2 == 0:
        sizes.append(sizes[-1] // 2)
    return sizes


def time_case(a, m, impl, l):
    """One (impl, method, length) at its best, printed as a CSV row: each micro-batch the search
    tries (the step's tokens accumulated over them) as written or, where that runs out of memory,
    with every block checkpointed and the loss in chunks; the fastest is the row, its setup naming
    the choice and every try."""
    name = "torch_" + impl
    batch = max(1, a.tokens // l)
    needs_flex = a.method != "full"
    if needs_flex and flex_attention is None:
        say(f"{name},{a.method},{l},{batch},,,,,,FlexAttention unavailable")
        return
    modes = a.compile_modes.split(",") if impl == "compile" else ["default"]
    best, tried, failures = None, [], []
    for mode in modes:
        # The mode's name on each try, where the search holds more than one.
        named = (lambda t: f"{mode} {t}") if len(modes) > 1 else (lambda t: t)
        for micro in micro_batch_sizes(batch, a.micro_batches):
            for checkpointed in (False, True):
                torch.cuda.empty_cache()
                try:
                    ms, mu, peak = run_case(a, m, impl, l, batch, micro, checkpointed, mode)
                except Exception as e:  # out of memory: the checkpointed form next; else this try fails
                    # Out of memory, also as the compiler wraps it (autotuning runs kernels).
                    if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower():
                        if checkpointed:
                            tried.append(named(f"{micro}: out of memory"))
                        continue
                    # A compile failure leaves this try out, not the case.
                    msg = f"{type(e).__name__}: {str(e)[:160]}".replace("\n", " ").replace(",", ";")
                    failures.append(named(f"{micro} failed ({msg})"))
                    break
                setup = f"per-block checkpointing; loss in chunks of {LOSS_CHUNK}" if checkpointed else "as written"
                if len(modes) > 1:
                    setup = f"{setup}; compile mode {mode}"
                tried.append(named(f"{micro}{' checkpointed' if checkpointed else ''}: {ms:.1f} ms"))
                if best is None or ms < best[0]:
                    best = (ms, mu, peak, f"{setup}; micro-batch {micro} x {batch // micro}", (micro, mode))
                break
    if best is None and failures:
        say(f"{name},{a.method},{l},{batch},,,,,,failed ({' / '.join(tried + failures)})")
        return
    if best is None:
        say(f"{name},{a.method},{l},{batch},,,,,,out of memory even with checkpointing and the loss in chunks")
        return
    ms, mu, peak, setup, chosen = best
    if a.profile:
        # The chosen try's trace under the case's name; the others' go.
        stem = f"{a.profile}_torch_{impl}_{a.method}_L{l}"
        for mode in modes:
            for micro in micro_batch_sizes(batch, a.micro_batches):
                trace = f"{stem}_mb{micro}_{mode}.json"
                if os.path.exists(trace):
                    if (micro, mode) == chosen:
                        os.replace(trace, f"{stem}.json")
                    else:
                        os.remove(trace)
    mu = "" if mu is None else f"{mu:.4f}"
    say(f"{name},{a.method},{l},{batch},{ms:.3f},{WORLD * batch * l / ms * 1e3:.0f},{mu},{peak:.2f},"
        f"{setup}; tried {' / '.join(tried + failures)},")


def run_case(a, m, impl, l, batch, micro, checkpointed, mode="default"):
    """Median step time (ms) of `batch` sequences a step in micro-batches of `micro`, the gates'
    usage and the peak memory (GiB); `mode` is torch.compile's for the compiled peer."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Model(m, a).to(dev)
    if checkpointed:
        model.checkpointed, model.loss_chunk = True, LOSS_CHUNK
    if impl == "compile":
        # Per block, as torchtitan compiles: one compiled graph serves every layer.
        kwargs = {} if mode == "default" else {"mode": mode}
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, **kwargs)
        model.flex = flex_attention
    if WORLD > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1, fused=True)
    ids = torch.randint(0, m["vocab_size"], (batch, l + 1), device=dev)
    inner = model.module if WORLD > 1 else model
    masks = inner.masks(l, dev) if a.method != "full" else {}
    times, usage = [], None
    accum = batch // micro
    # Under reduce-overhead the first micro-batch's backward would install its graph's output
    # buffers as the .grad tensors, and the next micro-batch's replay overwrites them (PyTorch
    # issue 169545); gradients that exist before the first backward are added into instead.
    keep_grads = mode == "reduce-overhead" and accum > 1
    if keep_grads:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)

    def step():
        for i in range(accum):
            rows = ids[i * micro : (i + 1) * micro]
            # Data-parallel ranks reduce the gradients once, after the last micro-batch.
            if mode == "reduce-overhead":
                # Each micro-batch a new run of the graphs: the last one's outputs are done with.
                torch.compiler.cudagraph_mark_step_begin()
            with contextlib.nullcontext() if WORLD == 1 or i == accum - 1 else model.no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss, usage = model(rows[:, :-1], rows[:, 1:], masks)
                (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=not keep_grads)
        loss.item()
        return usage

    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        usage = step()
        torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - start)
    if a.profile:
        # After the timed steps, so the profiler's cost is in none of them.
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        prof.export_chrome_trace(f"{a.profile}_torch_{impl}_{a.method}_L{l}_mb{micro}_{mode}.json")
    times.sort()
    mu = None if usage is None else usage.item()
    return times[len(times) // 2] * 1e3, mu, torch.cuda.max_memory_allocated() / GIB


if __name__ == "__main__":
    main()
