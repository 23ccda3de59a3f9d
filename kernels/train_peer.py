"""The PyTorch a user would write: the model attnsweep trains, in plain eager PyTorch, timed
per training step beside attnsweep in `attnsweep bench train`.

Llama-style decoder (RMSNorm, rotary embedding, SwiGLU MLP, tied embeddings), fp32
parameters under bf16 autocast, AdamW (PyTorch's default multi-tensor form), gradient
clipping, and the loss read back every step as a training loop logs it. Attention:
  full           scaled_dot_product_attention, causal (cuDNN on an H100)
  swa            the same with a boolean sliding-window mask
  ppa            the same with the power mask (window or an offset in S_p)
  static_hybrid  every `hybrid_every`-th layer full, the others the window mask
  aha            per (token, head) router, both paths computed densely and mixed by the
                 straight-through gate, L1 penalty on the scores (the AHA paper's formulation)
  l2a            window attention s, then a second attention module (own projections) over s
                 for every query, added where the token's gate is open: o = s + d a; gates
                 drawn Bernoulli(full_usage) per token (what costs is how many are open)
  swiattn        per-token router on the normed input, both branches computed densely (own
                 output projection each) and mixed by the straight-through gate, with the
                 adaptive regulariser gamma_base / (eps + NLL_t + alpha D_t) * softplus(r_t)

`--impls eager,compile`: each model as written (`torch_eager`) and under `torch.compile`
(`torch_compile`, the strongest plain-PyTorch peer, as nanoGPT trains); warm-up steps
include compilation.

Prints CSV rows impl,method,L,batch,step_ms,tokens_per_s,full_usage on stdout.
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def rms_norm(x, weight, eps):
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def power_offsets(length, p):
    """Offsets j >= 1 where floor(j^p) steps by one (PPA's S_p; 0^p = 0)."""
    j = torch.arange(1, length, dtype=torch.float64)
    return j[(torch.floor(j**p) - torch.floor((j - 1) ** p)) == 1].long()


class Projections(nn.Module):
    """q, k, v and o of one attention module."""

    def __init__(self, d):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))


class Block(nn.Module):
    def __init__(self, a, index):
        super().__init__()
        d, self.heads = a.hidden, a.heads
        self.head_dim = d // a.heads
        self.method, self.window, self.eps = a.method, a.window, 1e-5
        if a.method == "static_hybrid":
            self.method = "full" if (index + 1) % a.hybrid_every == 0 else "swa"
        self.full_usage = a.full_usage
        self.input_layernorm = nn.Parameter(torch.ones(d))
        self.post_attention_layernorm = nn.Parameter(torch.ones(d))
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate_proj = nn.Linear(d, a.intermediate, bias=False)
        self.up_proj = nn.Linear(d, a.intermediate, bias=False)
        self.down_proj = nn.Linear(a.intermediate, d, bias=False)
        # About `full_usage` of the gates open at the start (unit-variance logits).
        open_bias = math.sqrt(2) * torch.erfinv(torch.tensor(2 * a.full_usage - 1)).item()
        if a.method in ("aha", "swiattn"):
            self.router = nn.Linear(d, a.heads if a.method == "aha" else 1)
            nn.init.normal_(self.router.weight, std=d**-0.5)
            nn.init.constant_(self.router.bias, open_bias)
        if a.method == "swiattn":
            self.swa_o_proj = nn.Linear(d, d, bias=False)
        if a.method == "l2a":
            self.global_attn = Projections(d)

    def heads_of(self, t):
        b, l, _ = t.shape
        return t.view(b, l, self.heads, self.head_dim).transpose(1, 2)

    def merge(self, y):
        b, _, l, _ = y.shape
        return y.transpose(1, 2).reshape(b, l, -1)

    def attention(self, x, rot, masks):
        q, k, v = self.heads_of(self.q_proj(x)), self.heads_of(self.k_proj(x)), self.heads_of(self.v_proj(x))
        q, k = rot(q), rot(k)
        full = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        window = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=masks["window"])
        out = {}
        if self.method == "full":
            return self.o_proj(self.merge(full())), out
        if self.method == "swa":
            return self.o_proj(self.merge(window())), out
        if self.method == "ppa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=masks["ppa"])
            return self.o_proj(self.merge(y)), out
        if self.method == "aha":
            s = torch.sigmoid(self.router(x).float())  # [B, L, H]
            hard = (s > 0.5).float()
            g = (hard + s - s.detach()).transpose(1, 2).unsqueeze(-1).to(q.dtype)
            y = g * full() + (1 - g) * window()
            out["reg"], out["usage"] = s.mean(), hard.mean()
            return self.o_proj(self.merge(y)), out
        if self.method == "swiattn":
            r = self.router(x).float()  # [B, L, 1]
            s = torch.sigmoid(r)
            hard = (s > 0.5).float()
            o = (hard + s - s.detach()).to(q.dtype)
            y_full, y_swa = self.o_proj(self.merge(full())), self.swa_o_proj(self.merge(window()))
            with torch.no_grad():
                out["disagreement"] = (y_full - y_swa).float().pow(2).mean(-1)  # [B, L]
            out["logit"], out["usage"] = r.squeeze(-1), hard.mean()
            return o * y_full + (1 - o) * y_swa, out
        # l2a: window attention, then the global module over its outputs for every query.
        s_loc = self.o_proj(self.merge(window()))
        ga = self.global_attn
        gq, gk, gv = self.heads_of(ga.q_proj(s_loc)), self.heads_of(ga.k_proj(s_loc)), self.heads_of(ga.v_proj(s_loc))
        a = ga.o_proj(self.merge(F.scaled_dot_product_attention(rot(gq), rot(gk), gv, is_causal=True)))
        d = (torch.rand(s_loc.shape[:2], device=x.device) < self.full_usage).to(a.dtype).unsqueeze(-1)
        out["usage"] = d.float().mean()
        return s_loc + d * a, out

    def forward(self, x, rot, masks):
        a, out = self.attention(rms_norm(x, self.input_layernorm, self.eps), rot, masks)
        x = x + a
        h = rms_norm(x, self.post_attention_layernorm, self.eps)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)), out


class Model(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab, a.hidden)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        self.layers = nn.ModuleList(Block(a, i) for i in range(a.layers))
        self.norm = nn.Parameter(torch.ones(a.hidden))
        self.method, self.window, self.power = a.method, a.window, a.ppa_power
        self.lam = 3e-4
        # SwiAttn's regulariser (the paper's defaults).
        self.gamma_base, self.swi_eps, self.alpha = 1e-3, 0.1, 100.0
        hd = a.hidden // a.heads
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))

    def forward(self, ids, targets):
        l = ids.shape[1]
        t = torch.arange(l, device=ids.device).float()
        freqs = torch.outer(t, self.inv_freq.to(ids.device))
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
        rot = lambda x: x * cos + torch.cat([-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]], -1) * sin
        pos = torch.arange(l, device=ids.device)
        dist = pos[:, None] - pos[None, :]
        masks = {"window": (dist >= 0) & (dist < self.window)}
        if self.method == "ppa":
            seen = torch.zeros(l, dtype=torch.bool, device=ids.device)
            seen[power_offsets(l, self.power).to(ids.device)] = True
            masks["ppa"] = masks["window"] | ((dist > 0) & seen[dist.clamp(min=0)])
        x = self.embed_tokens(ids)
        outs = []
        for layer in self.layers:
            x, out = layer(x, rot, masks)
            outs.append(out)
        x = rms_norm(x, self.norm, 1e-5)
        logits = F.linear(x, self.embed_tokens.weight)
        nll = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
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
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--full-usage", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ppa-power", type=float, default=0.5)
    ap.add_argument("--hybrid-every", type=int, default=4)
    ap.add_argument("--impls", default="eager", help="eager, compile or both")
    ap.add_argument("--lr", type=float, default=3e-4, help="0 keeps the gate pattern fixed while timing")
    a = ap.parse_args()
    for impl in a.impls.split(","):
        for l in (int(x) for x in a.lengths.split(",")):
            for method in a.methods.split(","):
                a.method = method
                time_case(a, impl, l)
                torch.cuda.empty_cache()


def time_case(a, impl, l):
    """Median step time of one (impl, method, length), printed as a CSV row (or a # note)."""
    dev = torch.device("cuda")
    batch = max(1, a.tokens // l)
    name = "torch_" + impl
    torch.manual_seed(0)
    try:
        model = Model(a).to(dev)
        if impl == "compile":
            # Each case compiles afresh: one process compiling many (method, length) cases
            # otherwise reaches dynamo's recompile limit and silently runs the rest eagerly.
            torch._dynamo.reset()
        step_model = torch.compile(model) if impl == "compile" else model
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
        ids = torch.randint(0, a.vocab, (batch, l + 1), device=dev)
        x, y = ids[:, :-1], ids[:, 1:]
        times, usage = [], None
        for step in range(a.warmup + a.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, usage = step_model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
            torch.cuda.synchronize()
            if step >= a.warmup:
                times.append(time.perf_counter() - start)
        times.sort()
        ms = times[len(times) // 2] * 1e3
        mu = "" if usage is None else f"{usage.item():.4f}"
        print(f"{name},{a.method},{l},{batch},{ms:.3f},{batch * l / ms * 1e3:.0f},{mu}", flush=True)
    except torch.cuda.OutOfMemoryError:
        print(f"# {name} {a.method} L={l}: out of memory", flush=True)
    except Exception as e:  # a compile failure leaves this case out, not the run
        print(f"# {name} {a.method} L={l}: failed ({type(e).__name__}: {str(e)[:200]})", flush=True)

if __name__ == "__main__":
    main()
