"""The PyTorch a user would write: the model attnsweep trains, in plain eager PyTorch, timed
per training step beside attnsweep in `attnsweep bench train`.

Llama-style decoder (RMSNorm, rotary embedding, SwiGLU MLP, tied embeddings), fp32
parameters under bf16 autocast, AdamW (PyTorch's default multi-tensor form), gradient
clipping, and the loss read back every step as a training loop logs it. Attention:
  full  scaled_dot_product_attention, causal (cuDNN on an H100)
  swa   the same with a boolean sliding-window mask
  aha   per (token, head) router, both paths computed densely and mixed by the
        straight-through gate, L1 penalty on the scores (the AHA paper's formulation)

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


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        d, self.heads = a.hidden, a.heads
        self.head_dim = d // a.heads
        self.method, self.window, self.eps = a.method, a.window, 1e-5
        self.input_layernorm = nn.Parameter(torch.ones(d))
        self.post_attention_layernorm = nn.Parameter(torch.ones(d))
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate_proj = nn.Linear(d, a.intermediate, bias=False)
        self.up_proj = nn.Linear(d, a.intermediate, bias=False)
        self.down_proj = nn.Linear(a.intermediate, d, bias=False)
        if a.method == "aha":
            self.router = nn.Linear(d, a.heads)
            # About `full_usage` of the gates open at the start (unit-variance logits).
            nn.init.normal_(self.router.weight, std=d**-0.5)
            nn.init.constant_(self.router.bias, math.sqrt(2) * torch.erfinv(torch.tensor(2 * a.full_usage - 1)).item())

    def attention(self, x, cos, sin, window_mask):
        b, l, _ = x.shape
        split = lambda t: t.view(b, l, self.heads, self.head_dim).transpose(1, 2)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        rot = lambda t: t * cos + torch.cat([-t[..., t.shape[-1] // 2 :], t[..., : t.shape[-1] // 2]], -1) * sin
        q, k = rot(q), rot(k)
        reg, usage = None, None
        if self.method == "full":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.method == "swa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask)
        else:
            s = torch.sigmoid(self.router(x).float())  # [B, L, H]
            hard = (s > 0.5).float()
            g = (hard + s - s.detach()).transpose(1, 2).unsqueeze(-1).to(q.dtype)
            full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            local = F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask)
            y = g * full + (1 - g) * local
            reg, usage = s.mean(), hard.mean()
        return self.o_proj(y.transpose(1, 2).reshape(b, l, -1)), reg, usage

    def forward(self, x, cos, sin, window_mask):
        a, reg, usage = self.attention(rms_norm(x, self.input_layernorm, self.eps), cos, sin, window_mask)
        x = x + a
        h = rms_norm(x, self.post_attention_layernorm, self.eps)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)), reg, usage


class Model(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab, a.hidden)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm = nn.Parameter(torch.ones(a.hidden))
        self.lam = 3e-4
        hd = a.hidden // a.heads
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))

    def forward(self, ids, targets):
        l = ids.shape[1]
        t = torch.arange(l, device=ids.device).float()
        freqs = torch.outer(t, self.inv_freq.to(ids.device))
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
        window_mask = None
        if self.layers[0].method != "full":
            pos = torch.arange(l, device=ids.device)
            dist = pos[:, None] - pos[None, :]
            window_mask = (dist >= 0) & (dist < self.layers[0].window)
        x = self.embed_tokens(ids)
        regs, usages = [], []
        for layer in self.layers:
            x, reg, usage = layer(x, cos, sin, window_mask)
            if reg is not None:
                regs.append(reg)
                usages.append(usage)
        x = rms_norm(x, self.norm, 1e-5)
        logits = F.linear(x, self.embed_tokens.weight)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        if regs:
            loss = loss + self.lam * torch.stack(regs).mean()
            return loss, torch.stack(usages).mean()
        return loss, None


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
    ap.add_argument("--lr", type=float, default=3e-4, help="0 keeps the gate pattern fixed while timing")
    a = ap.parse_args()
    dev = torch.device("cuda")
    for l in (int(x) for x in a.lengths.split(",")):
        batch = max(1, a.tokens // l)
        for method in a.methods.split(","):
            a.method = method
            torch.manual_seed(0)
            model = opt = None
            try:
                model = Model(a).to(dev)
                opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
                ids = torch.randint(0, a.vocab, (batch, l + 1), device=dev)
                x, y = ids[:, :-1], ids[:, 1:]
                times, usage = [], None
                for step in range(a.warmup + a.steps):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss, usage = model(x, y)
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
                print(f"torch_eager,{method},{l},{batch},{ms:.3f},{batch * l / ms * 1e3:.0f},{mu}", flush=True)
            except torch.cuda.OutOfMemoryError:
                print(f"# torch_eager {method} L={l}: out of memory", flush=True)
            model = opt = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
