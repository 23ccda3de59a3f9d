"""Tiny random GGUF models of each tensor type, written with llama.cpp's `gguf` package (no
download), and what transformers' own GGUF loader makes of them: next-token logits in fp32
and the token ids of a sample text.

Usage: python tests/gguf_fixtures.py OUT_DIR
Writes OUT_DIR/<name>.gguf and OUT_DIR/<name>.expected.safetensors (`ids` int64 [2, 12],
`logits` fp32), and OUT_DIR/tokens.json: the sample texts and transformers' ids for them.

Every 2-D weight is stored in the file's type (the norms in F32, as llama.cpp stores them).
Types gguf can quantize are quantized from random weights; the K-quants (which gguf cannot
quantize) are random blocks with small scales. Llama's Q and K rows are permuted as
llama.cpp's converter permutes them, so the reader must undo it to match.
"""

import json
import os
import sys

import numpy as np
import torch
import gguf
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file
import transformers as tf

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TRAIN_TEXT = (
    "the cat sat on the mat and the dog sat on the log; then the cat ran to the dog. "
    "in 2024 there were 12 cats and 120 dogs in the town, the end."
)
SAMPLES = [
    "the cat sat on the log, then the dog ran to the mat.",
    "in 2024 the town had 12 cats; the dog said 'hello' <|im_end|> twice.",
]


def bytes_to_unicode():
    """GPT-2's map from bytes to printable characters (every byte-level BPE vocabulary's)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def vocabulary():
    """Special tokens, the 256 bytes, and 40 merges learned greedily from TRAIN_TEXT, with
    "1 2" among them so that digit grouping shows in the ids."""
    b2u = bytes_to_unicode()
    tokens = SPECIAL + [b2u[b] for b in range(256)]
    words = [[b2u[b] for b in (w if i == 0 else " " + w).encode()]
             for i, w in enumerate(TRAIN_TEXT.split(" "))]
    merges = [("1", "2")]
    tokens.append("12")
    words = [merge_word(w, ("1", "2")) for w in words]
    while len(merges) < 40:
        counts = {}
        for w in words:
            for a, b in zip(w, w[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + 1
        pair = max(sorted(counts), key=lambda p: counts[p])
        merges.append(pair)
        tokens.append(pair[0] + pair[1])
        words = [merge_word(w, pair) for w in words]
    types = [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL))
    return tokens, types, [f"{a} {b}" for a, b in merges]


def merge_word(w, pair):
    out, i = [], 0
    while i < len(w):
        if i + 1 < len(w) and (w[i], w[i + 1]) == pair:
            out.append(w[i] + w[i + 1])
            i += 2
        else:
            out.append(w[i])
            i += 1
    return out


def permute(w, heads):
    """llama.cpp's convert_hf_to_gguf.py `permute` of Llama's Q and K rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(qtype, rows, cols, rng):
    """Random blocks of a K-quant with its fp16 scales set small (gguf cannot quantize these)."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)
    if qtype == Q.Q6_K:
        blocks[..., 208:210] = scale
    else:
        blocks[..., 0:2] = scale
        blocks[..., 2:4] = scale
    return blocks.reshape(rows, -1)


def stored(w, qtype, rng):
    """A weight as the file stores it: the array gguf writes and its type."""
    if qtype == Q.F32:
        return w.astype(np.float32), None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return random_k_blocks(qtype, *w.shape, rng), qtype
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def write(path, arch, qtype, tied, pre, seed):
    rng = np.random.default_rng(seed)
    tokens, types, merges = vocabulary()
    vocab = len(tokens)
    hd = HIDDEN // HEADS
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000.0)
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def weight(name, shape, scale=0.3):
        x = (scale * rng.standard_normal(shape)).astype(np.float32)
        if arch == "llama" and name.endswith("attn_q.weight"):
            x = permute(x, HEADS)
        if arch == "llama" and name.endswith("attn_k.weight"):
            x = permute(x, KV_HEADS)
        data, raw = stored(x, qtype, rng)
        w.add_tensor(name, data, raw_dtype=raw)

    def norm(name, n):
        w.add_tensor(name, (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32))

    weight("token_embd.weight", (vocab, HIDDEN))
    norm("output_norm.weight", HIDDEN)
    if not tied:
        weight("output.weight", (vocab, HIDDEN))
    for i in range(LAYERS):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", HIDDEN)
        norm(p + "ffn_norm.weight", HIDDEN)
        weight(p + "attn_q.weight", (HEADS * hd, HIDDEN), 0.1)
        weight(p + "attn_k.weight", (KV_HEADS * hd, HIDDEN), 0.1)
        weight(p + "attn_v.weight", (KV_HEADS * hd, HIDDEN), 0.1)
        weight(p + "attn_output.weight", (HIDDEN, HEADS * hd), 0.1)
        if arch == "qwen2":
            for b, n in (("q", HEADS * hd), ("k", KV_HEADS * hd), ("v", KV_HEADS * hd)):
                w.add_tensor(p + f"attn_{b}.bias", (0.3 * rng.standard_normal(n)).astype(np.float32))
        weight(p + "ffn_gate.weight", (FFN, HIDDEN), 0.1)
        weight(p + "ffn_up.weight", (FFN, HIDDEN), 0.1)
        weight(p + "ffn_down.weight", (HIDDEN, FFN), 0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# name: (architecture, tensor type, tied embeddings, tokenizer.ggml.pre)
MODELS = {
    "f32": ("llama", Q.F32, False, "gpt2"),
    "f16": ("llama", Q.F16, True, "gpt2"),
    "bf16": ("llama", Q.BF16, True, "gpt2"),
    "q8_0": ("llama", Q.Q8_0, True, "smollm"),
    "q4_0": ("llama", Q.Q4_0, True, "gpt2"),
    "q4_1": ("llama", Q.Q4_1, False, "gpt2"),
    "q5_0": ("llama", Q.Q5_0, True, "gpt2"),
    "q5_1": ("llama", Q.Q5_1, True, "gpt2"),
    "q4_k": ("llama", Q.Q4_K, True, "gpt2"),
    "q5_k": ("llama", Q.Q5_K, True, "gpt2"),
    "q6_k": ("llama", Q.Q6_K, False, "gpt2"),
    "qwen2_f16": ("qwen2", Q.F16, True, "qwen2"),
}


def main(out):
    os.makedirs(out, exist_ok=True)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26],
                        [2, 71, 82, 81, 82, 84, 59, 4, 52, 35, 36, 0]], dtype=torch.int64)
    for seed, (name, (arch, qtype, tied, pre)) in enumerate(MODELS.items()):
        path = os.path.join(out, f"{name}.gguf")
        write(path, arch, qtype, tied, pre, seed)
        model = tf.AutoModelForCausalLM.from_pretrained(out, gguf_file=f"{name}.gguf",
                                                        dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(ids).logits.float()
        save_file({"ids": ids, "logits": logits.contiguous()},
                  os.path.join(out, f"{name}.expected.safetensors"))
    tok = tf.AutoTokenizer.from_pretrained(out, gguf_file="f32.gguf")
    expected = {"texts": SAMPLES,
                "ids": [tok(t)["input_ids"] for t in SAMPLES],
                "bos_token_id": tok.bos_token_id}
    with open(os.path.join(out, "tokens.json"), "w") as f:
        json.dump(expected, f)
    print("transformers", tf.__version__, "gguf", gguf.__version__ if hasattr(gguf, "__version__") else "?")


if __name__ == "__main__":
    main(sys.argv[1])
