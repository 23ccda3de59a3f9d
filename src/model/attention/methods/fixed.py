class FixedPattern:
    """Full attention, SWA, PPA and StaticHybrid (`fixed.rs`): one fixed pattern a layer.
    StaticHybrid's full layers are the last of every `hybrid_every`."""

    @staticmethod
    def init(attn, config, idx):
        a, w = attn.a, attn.a["window"]
        attn.pattern = {
            "full": ("full",),
            "swa": ("window", w),
            "ppa": ("ppa", w, a.get("ppa_power", 0.5)),
            "static_hybrid": ("full",)
            if (idx + 1) % a.get("hybrid_every", 4) == 0
            else ("window", w),
        }[a["method"]]

    @staticmethod
    def forward(attn, x, residual, ctx):
        q, k, v = attn.qkv(x, ctx)
        return attn.out(attend(q, k, v, ctx.mask(attn.pattern)))


for _name in ("full", "swa", "ppa", "static_hybrid"):
    METHODS[_name] = FixedPattern
