class GlobalModule(Projections):
    """L2A's global attention: its own q, k, v and o, and the norm of what it reads."""

    def __init__(self, config):
        super().__init__(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Global:
    """L2A (`l2a.rs`): every layer attends its window, `s`, added to the stream `h`; on
    `u = RMSNorm_g(h + s)` a router `d = sigmoid(W u)` (fp32, no bias) sends the tokens where
    `d >= tau` to the global module, which attends the `u` of every earlier token: the layer
    adds `s + d * a`. Pruned layers keep only the window."""

    @staticmethod
    def init(attn, config, idx):
        attn.pruned = idx in attn.a.get("pruned_layers", [])
        if not attn.pruned:
            attn.router = nn.Linear(config.hidden_size, 1, bias=False)
            attn.global_attn = GlobalModule(config)

    @staticmethod
    def forward(attn, x, residual, ctx):
        q, k, v = attn.qkv(x, ctx)
        s = attn.out(attend(q, k, v, ctx.mask(("window", attn.a["window"]))))
        if attn.pruned:
            return s
        g = attn.global_attn
        u = g.norm(residual + s)
        d = torch.sigmoid(nn.functional.linear(u.float(), attn.router.weight.float()))
        qg, kg, vg = g.qkv(u, ctx)
        a = g.out(attend(qg, kg, vg, ctx.mask(("full",))))
        return s + (d >= attn.a["tau"]).to(s.dtype) * a


METHODS["l2a"] = Global
