"""An attnsweep model in transformers: a Llama-style decoder whose attention is one of the
attnsweep methods, computed with plain PyTorch operations (dense masks, no fused kernels), so
the model loads with `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` and
runs in transformers, lm-evaluation-harness and the tools built on them.

Written by `attnsweep export` from the shared part below and the exported method's own part,
which lives beside that method's Rust code (`src/model/attention/methods/<method>.py`).
`config.attnsweep` holds the method's settings as attnsweep ran it. Gates are thresholded as
attnsweep thresholds them (AHA and SwiAttn `s > tau`, L2A `s >= tau`), so the logits are
attnsweep's reference path's. Generation recomputes the whole sequence at every step (no
key-value cache): correct for every method, slow for long generations.
"""

import math

import torch
from torch import nn
from transformers import GenerationMixin, LlamaConfig, LlamaPreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)


class AttnsweepConfig(LlamaConfig):
    model_type = "attnsweep"

    def __init__(self, attnsweep=None, **kwargs):
        # The method and its settings: method, window, tau, ppa_power, hybrid_every,
        # sink_tokens, pruned_layers, full_heads, shared_o_proj.
        self.attnsweep = dict(attnsweep or {})
        kwargs.setdefault("use_cache", False)
        super().__init__(**kwargs)


# The methods' layers by name, each registered by its own part below.
METHODS = {}


def power_offsets(length, p):
    """[length] bool: distance d is a PPA power offset, floor(d^p) > floor((d-1)^p), with
    attnsweep's nudge for powers that land a hair below an integer."""

    def floor_pow(x):
        v = float(x) ** p
        return math.floor(v + 1e-9 * max(v, 1.0))

    return torch.tensor([d > 0 and floor_pow(d) - floor_pow(d - 1) == 1 for d in range(length)])


def seen(pattern, pos):
    """[B, L, L] bool: the query at position pos[b, i] sees the key at pos[b, j] under
    `pattern`: ("full",), ("window", w), ("ppa", w, p) or ("sinks", w, sinks)."""
    d = pos[:, :, None] - pos[:, None, :]
    causal = d >= 0
    kind = pattern[0]
    if kind == "full":
        return causal
    near = d < pattern[1]
    if kind == "ppa":
        length = int(pos.max().item()) + 1
        table = power_offsets(length, pattern[2]).to(pos.device)
        near = near | table[d.clamp(0, length - 1)]
    if kind == "sinks":
        near = near | (pos[:, None, :] < pattern[2])
    return near & causal


class Context:
    """What every layer of one forward shares: positions, rotary tables, the keys that are
    not padding, and the masks of the patterns asked for (built once)."""

    def __init__(self, pos, cos, sin, keep):
        self.pos, self.cos, self.sin, self.keep = pos, cos, sin, keep
        self.masks = {}

    def mask(self, pattern):
        if pattern not in self.masks:
            self.masks[pattern] = (seen(pattern, self.pos) & self.keep[:, None, :])[:, None]
        return self.masks[pattern]


def attend(q, k, v, mask):
    """Softmax attention `[B, H, L, D]` of q over the keys `mask` (`[B, 1, L, L]` or
    `[B, H, L, L]`) allows, in fp32."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, v.float()).to(q.dtype)


class Projections(nn.Module):
    """q, k, v and o of one attention module (the layer's own, or L2A's global one)."""

    def __init__(self, config):
        super().__init__()
        d, h, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or d // h
        self.heads, self.kv_heads = h, kv
        bias = config.attention_bias
        self.q_proj = nn.Linear(d, h * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(h * self.head_dim, d, bias=False)

    def qkv(self, x, ctx):
        """Queries `[B, H, L, D]` and keys and values repeated to the query heads, rotated."""
        b, l, _ = x.shape
        q = self.q_proj(x).view(b, l, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, l, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, l, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, ctx.cos, ctx.sin)
        r = self.heads // self.kv_heads
        return q, k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)

    def merge(self, y):
        """`[B, H, L, D]` to `[B, L, H * D]`."""
        b, h, l, d = y.shape
        return y.transpose(1, 2).reshape(b, l, h * d)

    def out(self, y):
        return self.o_proj(self.merge(y))


class AttnsweepAttention(Projections):
    """The layer's attention: its projections and its method's part (`METHODS`)."""

    def __init__(self, config, layer_idx):
        super().__init__(config)
        self.a = config.attnsweep
        self.layer_idx = layer_idx
        self.method = METHODS[self.a["method"]]
        self.method.init(self, config, layer_idx)

    def forward(self, x, residual, ctx):
        return self.method.forward(self, x, residual, ctx)


class AttnsweepDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = AttnsweepAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h, ctx):
        # L2A's global module reads the stream after the window: the attention gets it too.
        h = h + self.self_attn(self.input_layernorm(h), h, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class AttnsweepPreTrainedModel(LlamaPreTrainedModel):
    config_class = AttnsweepConfig
    _no_split_modules = ["AttnsweepDecoderLayer"]
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_record_outputs = {}


class AttnsweepModel(AttnsweepPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            AttnsweepDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, l = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(b, l, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            # Left padding shifts a row's positions; padding keys are never attended.
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(h, position_ids)
        ctx = Context(position_ids, cos, sin, attention_mask.bool())
        for layer in self.layers:
            h = layer(h, ctx)
        return self.norm(h)


class AttnsweepForCausalLM(AttnsweepPreTrainedModel, GenerationMixin):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.model = AttnsweepModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        # No cache: every step reads the whole sequence.
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
        h = self.model(input_ids, attention_mask, position_ids)
        logits = self.lm_head(h).float()
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)
