class Switch:
    """SwiAttn (`swiattn.rs`): per token, the full branch or the window branch over one set of
    queries, keys and values, each with its own output projection unless they share it. The
    router reads the normalised hidden state, `s = sigmoid(x W + b)` in fp32; `s > tau` picks
    the full branch."""

    @staticmethod
    def init(attn, config, idx):
        attn.router = nn.Linear(config.hidden_size, 1, bias=True)
        if not attn.a.get("shared_o_proj", False):
            attn.swa_o_proj = nn.Linear(attn.heads * attn.head_dim, config.hidden_size, bias=False)

    @staticmethod
    def forward(attn, x, residual, ctx):
        q, k, v = attn.qkv(x, ctx)
        full = attn.out(attend(q, k, v, ctx.mask(("full",))))
        local = attn.merge(attend(q, k, v, ctx.mask(("window", attn.a["window"]))))
        local = (attn.swa_o_proj if hasattr(attn, "swa_o_proj") else attn.o_proj)(local)
        r = attn.router
        s = torch.sigmoid(nn.functional.linear(x.float(), r.weight.float(), r.bias.float()))
        return torch.where(s > attn.a["tau"], full, local)


METHODS["swiattn"] = Switch
