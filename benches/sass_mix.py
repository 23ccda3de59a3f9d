#!/usr/bin/env python3
"""Instruction mix of one tile of a Hopper list-attention kernel, from its SASS.

    nvcc -cubin -gencode=arch=compute_90a,code=sm_90a <the library's flags> \
        kernels/attention_sm90.cu -o a.cubin
    nvdisasm -c a.cubin > a.sass          # nvdisasm: the nvidia-cuda-nvdisasm wheel
    python3 benches/sass_mix.py a.sass 'list_kernelILi64ELi128ELb0ELb0E'

The tile's body is cut where its scores' wgmma group is awaited (WARPGROUP.DEPBAR after
the first HGMMA group): the mask (from there to the label its skip branch jumps to), then
the softmax, rescale and packing (to the WARPGROUP.ARRIVE before the P V group), then the
P V issue (to that group's DEPBAR). Prints each part's instruction count and commonest
opcodes, per warp and tile.
"""
import re
import sys
from collections import Counter


def body(sass, kernel):
    parts = re.split(r"\n\s*\.text\.(\S+):\n", sass)
    for name, text in zip(parts[1::2], parts[2::2]):
        if kernel in name:
            return text.splitlines()
    sys.exit(f"no function matching {kernel!r}")


def opcode(line):
    m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
    return m.group(1) if m else None


def main():
    path, kernel = sys.argv[1], sys.argv[2]
    lines = body(open(path).read(), kernel)
    first = next(i for i, l in enumerate(lines) if "HGMMA" in l)
    s_wait = next(i for i in range(first, len(lines)) if "WARPGROUP.DEPBAR" in lines[i])
    skip = re.search(r"`\((\.L_x_\d+)\)", lines[s_wait + 1])
    if not skip:
        sys.exit("no mask-skip branch after the scores' wait")
    label = next(i for i, l in enumerate(lines) if l.strip() == skip.group(1) + ":")
    arrive = next(i for i in range(label, len(lines)) if "WARPGROUP.ARRIVE" in lines[i])
    pv_wait = next(i for i in range(arrive, len(lines)) if "WARPGROUP.DEPBAR" in lines[i])
    for name, (a, b) in {
        "mask": (s_wait + 2, label),
        "softmax, rescale, packing": (label, arrive),
        "P V issue": (arrive, pv_wait + 1),
    }.items():
        c = Counter(o for o in map(opcode, lines[a:b]) if o)
        top = ", ".join(f"{n} {o}" for o, n in c.most_common(8))
        print(f"{name}: {sum(c.values())} ({top})")


if __name__ == "__main__":
    main()
