class Sinks:
    """Attention sinks (`sinks.rs`): the sequence's first `sink_tokens` keys and the window."""

    @staticmethod
    def init(attn, config, idx):
        attn.pattern = ("sinks", attn.a["window"], attn.a["sink_tokens"])

    @staticmethod
    def forward(attn, x, residual, ctx):
        q, k, v = attn.qkv(x, ctx)
        return attn.out(attend(q, k, v, ctx.mask(attn.pattern)))


METHODS["sinks"] = Sinks
