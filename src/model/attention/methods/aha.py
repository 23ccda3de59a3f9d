class PerHead:
    """AHA and static top-k heads (`aha.rs`): per token and head, the whole prefix or the
    window. AHA's router scores each head, `s = sigmoid(x W + b)` in fp32, and a head attends
    the whole prefix where `s > tau`; static heads take the layer's fixed assignment."""

    @staticmethod
    def init(attn, config, idx):
        if attn.a["method"] == "aha":
            attn.router = nn.Linear(config.hidden_size, config.num_attention_heads, bias=True)
        else:
            # A list, not a buffer: nothing of it is in the weights.
            attn.full_heads = list(attn.a["full_heads"][idx])

    @staticmethod
    def forward(attn, x, residual, ctx):
        q, k, v = attn.qkv(x, ctx)
        full = attend(q, k, v, ctx.mask(("full",)))
        local = attend(q, k, v, ctx.mask(("window", attn.a["window"])))
        if attn.a["method"] == "aha":
            r = attn.router
            s = torch.sigmoid(nn.functional.linear(x.float(), r.weight.float(), r.bias.float()))
            on = (s > attn.a["tau"]).transpose(1, 2)[..., None]
        else:
            on = torch.tensor(attn.full_heads, device=x.device)[None, :, None, None]
        return attn.out(torch.where(on, full, local))


METHODS["aha"] = PerHead
METHODS["static_heads"] = PerHead
