#!/usr/bin/env python3
"""Where a batched decode step's time goes, from a kernel timeline written by bench/gpu/timeline.cc.

usage: timeline_batch.py TIMELINE.csv

For runs whose decode steps are not CUDA graphs (timeline.py takes those): e.g. `combs-bench gpu
--only sessions --sessions 64`. Takes the kernels after the run's last prefill GEMM (cuBLAS's
nvjet / cutlass kernels, or a prefill's dequantize to BF16), i.e. its last decode phase, counts
the steps by the embedding's kernel, and prints per kernel (demangled name, grid):
  dur  its own time per step (first block's start, a PDL wait included, to last block's end)
  inc  what it adds to the chain: its end minus the latest end before it (the table to read)
The tracer adds host time between steps (the embedding's increment holds that gap).
"""
import collections
import csv
import re
import subprocess
import sys

from timeline import QUANT_TYPES  # DType values as names (timeline.py beside this file)

rows = list(csv.DictReader(open(sys.argv[1])))
rows.sort(key=lambda r: int(r["start"]))
names = sorted(set(r["name"] for r in rows))
dem = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
dm = dict(zip(names, dem))


def short(n):
    """The demangled name without namespaces and parameters, its DType values named."""
    d = re.sub(r"combs::|cuda::|\(anonymous namespace\)::|void ", "", dm.get(n, n))
    depth, cut = 0, len(d)
    for k, ch in enumerate(d):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = k
            break
    d = re.sub(r"\(DType\)(\d+)", lambda m: QUANT_TYPES[int(m.group(1))] if int(m.group(1)) < len(QUANT_TYPES) else m.group(0), d[:cut])
    return d[:70]


def prefill(s):  # cuBLAS's GEMMs, or a quantized weight dequantized to BF16 for them
    return "nvjet" in s or "cutlass" in s or ("dequantize_kernel" in s and "__nv_bfloat16>" in s)


def step_start(s):  # a step's first kernel: the embedding rows (dequantized from a quantized table)
    return "embedding_kernel" in s or ("dequantize_kernel" in s and ", float>" in s)


keys = [short(r["name"]) + f" g{r['gx']}x{r['gy']}" for r in rows]
last_prefill = max(i for i, k in enumerate(keys) if prefill(k))
D, DK = rows[last_prefill + 1:], keys[last_prefill + 1:]
t0 = int(D[0]["start"])
span = (max(int(r["end"]) for r in D) - t0) / 1e3
tot, inc, cnt = collections.defaultdict(float), collections.defaultdict(float), collections.Counter()
latest = t0
for r, k in zip(D, DK):
    start, end = int(r["start"]), int(r["end"])
    tot[k] += (end - start) / 1e3
    inc[k] += max(0, end - latest) / 1e3
    latest = max(latest, end)
    cnt[k] += 1
steps = max(1, sum(1 for k in DK if step_start(k)))
T, I = sum(tot.values()), sum(inc.values())
print(f"decode phase: {len(D)} kernels, span {span:.0f} us, steps ~{steps}, per step {span / steps:.0f} us; kernel sum {T:.0f}")
for k in sorted(tot, key=lambda k: -tot[k])[:40]:
    print(f"{tot[k] / steps:9.1f} us/step {tot[k] / T:6.3f} n/step={cnt[k] / steps:6.1f} {tot[k] / cnt[k]:8.1f} us/each  {k}")
print("\nincrements (end minus the latest end before it), per step:")
for k in sorted(inc, key=lambda k: -inc[k])[:24]:
    print(f"{inc[k] / steps:9.1f} us/step {inc[k] / I:6.3f} {inc[k] / cnt[k]:8.1f} us/each  {k}")
