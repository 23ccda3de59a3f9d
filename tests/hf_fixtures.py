"""Tiny random Hugging Face models of each family attnsweep converts, built offline with
`transformers` (no download), saved, and their next-token logits on fixed token ids.

Usage: python tests/hf_fixtures.py OUT_DIR
Writes OUT_DIR/<family>/ (config.json, model.safetensors or shards) and
OUT_DIR/<family>/expected.safetensors with `ids` (int64 [2, 12]) and `logits` (fp32).
"""

import argparse
import os
import sys

import torch
from safetensors.torch import save_file
import transformers as tf

COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=1000.0,
)

FAMILIES = {
    # Llama with llama3 rope scaling and an untied head, saved in two shards.
    "llama": (tf.LlamaConfig, dict(tie_word_embeddings=False, rope_scaling=dict(
        rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    # Qwen2: biases on q, k, v; tied embeddings.
    "qwen2": (tf.Qwen2Config, dict(tie_word_embeddings=True)),
    # Qwen3: per-head q/k norm and a head_dim that is not hidden / heads.
    "qwen3": (tf.Qwen3Config, dict(tie_word_embeddings=True, head_dim=16)),
    # OLMo-2: norms after attention and MLP, q/k norm over the whole projection.
    "olmo2": (tf.Olmo2Config, dict(tie_word_embeddings=False)),
}


class Holder(torch.nn.Module):
    """A module that only holds parameters, so TorchScript can save a state dict's tree."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def save_pytorch_formats(model, out):
    """The same weights as PyTorch and transformers save them without safetensors."""
    sd = model.state_dict()
    # torch.save of a state dict (an OrderedDict), plain and wrapped as training scripts do.
    torch.save(sd, os.path.join(out, "llama_state_dict.pt"))
    torch.save({"model": sd, "step": 3, "optimizer": {"lr": 0.1, "betas": (0.9, 0.95)}},
               os.path.join(out, "llama_wrapped.pt"))
    # An object only Python can rebuild.
    torch.save({"model": sd, "args": argparse.Namespace(lr=0.1)},
               os.path.join(out, "llama_namespace.pt"))
    # transformers' own pickle: pytorch_model.bin beside config.json.
    model.save_pretrained(os.path.join(out, "llama_bin"), safe_serialization=False)
    # A TorchScript archive whose parameters carry the state dict's names.
    root = Holder()
    for name, p in sd.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, Holder())
            mod = mod._modules[part]
        mod.register_parameter(leaf, torch.nn.Parameter(p.clone()))
    torch.jit.save(torch.jit.script(root), os.path.join(out, "llama_script.pt"))


def main(out):
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26],
                        [2, 71, 82, 81, 82, 84, 59, 4, 52, 35, 36, 0]], dtype=torch.int64)
    for name, (cls, extra) in FAMILIES.items():
        torch.manual_seed(0)
        cfg = cls(**COMMON, **extra)
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            # Weights far from the defaults, so every norm and bias matters in the check.
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.copy_(1.0 + 0.3 * torch.randn_like(p))
                else:
                    p.copy_(0.3 * torch.randn_like(p))
            logits = model(ids).logits.float()
        d = os.path.join(out, name)
        shard = "20KB" if name == "llama" else "100MB"
        model.save_pretrained(d, safe_serialization=True, max_shard_size=shard)
        save_file({"ids": ids, "logits": logits.contiguous()}, os.path.join(d, "expected.safetensors"))
        if name == "llama":
            save_pytorch_formats(model, out)
    print("transformers", tf.__version__)


if __name__ == "__main__":
    main(sys.argv[1])
