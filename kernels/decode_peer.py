"""The peer of `attnsweep bench decode`: greedy generation in transformers on its fastest path,
a static cache (`cache_implementation="static"`, which compiles the decoding step and replays it
as CUDA graphs), the same model shape with random bf16 weights, the same prompts' shape.

Prints CSV rows impl,context,batch,ttft_ms,step_ms,step_ms_spread,peak_gib,runs on stdout, one
per (context, batch), timed as attnsweep times its own generation: the time to the first token
is the prefill alone (generation stopped after one new token); a decoding step is the
difference between a run of `short + new` new tokens and one of `short`, divided by `new`, so
set-up, prefill and the one-off work of the first steps cancel. Every run is one generate call
with the same max_new_tokens, stopped where it should end, so the static cache keeps one shape
(a shape per run length would compile three times). Each run is repeated `reps` times after warm-up
runs (compilation); medians are reported. Lines starting with "# " are notes.
"""

import argparse
import json
import sys
import time

import torch


def ints(s):
    return [int(x) for x in s.split(",") if x]


def hf_config(m, context):
    """transformers' LlamaConfig of attnsweep's [model] (full attention)."""
    from transformers import LlamaConfig

    head_dim = m.get("head_dim") or m["hidden_size"] // m["num_attention_heads"]
    return LlamaConfig(
        vocab_size=m["vocab_size"],
        hidden_size=m["hidden_size"],
        intermediate_size=m["intermediate_size"],
        num_hidden_layers=m["num_hidden_layers"],
        num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=m["num_key_value_heads"],
        head_dim=head_dim,
        rope_theta=m["rope_theta"],
        rms_norm_eps=m["rms_norm_eps"],
        attention_bias=m["attention_bias"],
        tie_word_embeddings=m["tie_word_embeddings"],
        max_position_embeddings=max(context, 2048),
        torch_dtype="bfloat16",
    )


class StopAt:
    """Ends generation once the sequences reach `length` tokens. Every run generates under the
    same max_new_tokens, so the static cache has one shape and is compiled once per (context,
    batch); the runs differ only in where they stop."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        done = input_ids.shape[1] >= self.length
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def generate_s(model, ids, new, most):
    """Seconds of one greedy generation of `new` tokens after ids, under max_new_tokens `most`."""
    from transformers import StoppingCriteriaList

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=most,
        do_sample=False,
        cache_implementation="static",
        stopping_criteria=StoppingCriteriaList([StopAt(ids.shape[1] + new)]),
        pad_token_id=0,
        eos_token_id=None,
    )
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new, (out.shape, ids.shape, new)
    return seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="JSON of attnsweep's [model]")
    ap.add_argument("--contexts", required=True)
    ap.add_argument("--batches", required=True)
    ap.add_argument("--short", type=int, required=True)
    ap.add_argument("--new", type=int, required=True)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from transformers import LlamaForCausalLM

    m = json.loads(args.model)
    if m.get("qk_norm", "none") != "none" or m.get("norm_placement", "pre") != "pre":
        print("# the transformers peer runs Llama-shaped models only; none for this one")
        return
    torch.manual_seed(0)
    for context in ints(args.contexts):
        model = LlamaForCausalLM(hf_config(m, context + args.short + args.new))
        model = model.to(device="cuda", dtype=torch.bfloat16).eval()
        for batch in ints(args.batches):
            ids = torch.randint(m["vocab_size"], (batch, context), device="cuda")
            most = args.short + args.new
            try:
                with torch.no_grad():
                    t0 = time.perf_counter()
                    for _ in range(2):
                        for n in (most, args.short, 1):
                            generate_s(model, ids, n, most)
                    print(f"# peer warm-up at context {context}, batch {batch}: {time.perf_counter() - t0:.0f} s",
                          file=sys.stderr, flush=True)
                    torch.cuda.reset_peak_memory_stats()
                    long = sorted(generate_s(model, ids, most, most) for _ in range(args.reps))
                    peak = torch.cuda.max_memory_allocated() / 2**30
                    short = sorted(generate_s(model, ids, args.short, most) for _ in range(args.reps))
                    first = sorted(generate_s(model, ids, 1, most) for _ in range(args.reps))
            except torch.OutOfMemoryError:
                print(f"# transformers ran out of memory at context {context}, batch {batch}")
                torch.cuda.empty_cache()
                continue
            steps = [(lo - sh) / args.new * 1e3 for lo, sh in zip(long, short)]
            mid = len(steps) // 2
            print(
                f"transformers_static,{context},{batch},{first[mid] * 1e3:.4f},"
                f"{(long[mid] - short[mid]) / args.new * 1e3:.5f},{max(steps) - min(steps):.5f},"
                f"{peak:.4f},{args.reps}",
                flush=True,
            )
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
