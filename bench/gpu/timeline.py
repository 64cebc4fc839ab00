#!/usr/bin/env python3
"""Where a decode step's time goes, from a kernel timeline written by bench/gpu/timeline.cc.

usage: timeline.py TIMELINE.csv [--layer N] [--kernels N]

Takes the steps run as CUDA graphs (one per decode step: each begins with the embedding kernel),
drops the first fifth (warm-up), and reports per kernel role the median over steps of:
  dur   its own time, first block's start (PDL wait included) to last block's end
  inc   what it adds to the chain: its end minus the end of the kernel before it
and the step's span (first start to last end) and the gap to the next step's first kernel.
The increments of a step add up to its span less the first kernel's own time.
"""
import csv
import re
import statistics
import sys
from collections import defaultdict

KERNELS = [("gemv_kernel", "gemv"), ("flash_kernel", "attention"), ("attention_kernel", "attention"),
           ("write_kv_kernel", "append"), ("merge_splits_kernel", "merge"), ("argmax_kernel", "argmax"),
           ("embedding_kernel", "embedding"), ("sample_kernel", "sample"), ("add_rms_norm", "norm"),
           ("rope_table", "rope_table")]


QUANT_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
               "iq4_nl", "iq4_xs", "mxfp4"]


def short(name):
    if "expert_gemv" in name:  # expert_gemv(_staged)_kernel<DType T, N, PAIRS(, stages)>
        m = re.search(r"ELi(\d+)ELb(\d)E", name)
        return "experts_gate_up" if m and m.group(2) == "1" else "experts_down"
    for key, role in (("router_route_kernel", "router+route"), ("route_kernel", "route"), ("combine_kernel", "combine")):
        if key in name:
            return role
    if "quant_gemv_kernel" in name:  # quant_gemv_kernel<DType T, N, PAIRS>: ...LN5combs5DTypeE<T>ELi<N>ELb<PAIRS>E
        m = re.search(r"DTypeE?(\d+)ELi(\d+)ELb(\d)E", name)
        if m:
            t = QUANT_TYPES[int(m.group(1))] if int(m.group(1)) < len(QUANT_TYPES) else m.group(1)
            return ("q_gate_up_" if m.group(3) == "1" else "qgemv_") + t
        return "qgemv"
    if "quantize_act_kernel" in name:
        return "quantize_x"
    if "dequantize_kernel" in name:  # a quantized model's embedding rows: the step's first kernel
        return "embedding"
    for key, role in KERNELS:
        if key in name:
            if role == "gemv":  # gemv_kernel<T, N, XT, PAIRS>: ...Li<N>ELb<XT>ELb<PAIRS>E
                m = re.search(r"Li(\d+)ELb(\d)ELb(\d)E", name)
                if m and m.group(3) == "1":
                    return "gate_up"
                if m and m.group(2) == "1":
                    return "down"
            return role
    return name[:40]


def main():
    path = sys.argv[1]
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            rows.append((int(r["start"]), int(r["end"]), int(r["graph"]), short(r["name"])))
    rows.sort()
    graph_rows = [r for r in rows if r[2] != 0]
    steps, cur = [], []
    for r in graph_rows:
        if r[3] == "embedding" and cur:
            steps.append(cur)
            cur = []
        cur.append(r)
    if cur:
        steps.append(cur)
    if not steps:
        sys.exit("no graph steps in " + path)
    counts = sorted(set(len(s) for s in steps))
    if len(counts) > 1:  # e.g. a split merge kernel per layer once contexts grow past a bound
        print("steps by kernel count: " + ", ".join(f"{n}: {sum(1 for s in steps if len(s) == n)}" for n in counts))
    modal = statistics.mode(len(s) for s in steps)
    if "--kernels" in sys.argv:
        modal = int(sys.argv[sys.argv.index("--kernels") + 1])
    keep = [i for i, s in enumerate(steps) if len(s) == modal]
    keep = keep[len(keep) // 5:]
    # Roles within a step: the plain GEMVs alternate qkv, wo; the last one is the logits'.
    roles = []
    plain = 0
    names = [r[3] for r in steps[keep[0]]]
    n_plain = sum(1 for n in names if n == "gemv")
    for n in names:
        if n == "gemv":
            roles.append("logits" if plain == n_plain - 1 and n_plain % 2 == 1 else ("qkv" if plain % 2 == 0 else "wo"))
            plain += 1
        else:
            roles.append(n)
    dur, inc = defaultdict(list), defaultdict(list)
    spans, gaps = [], []
    for i in keep:
        s = steps[i]
        spans.append((s[-1][1] - s[0][0]) / 1e3)
        if i + 1 < len(steps):
            gaps.append((steps[i + 1][0][0] - s[-1][1]) / 1e3)
        per_role_inc = defaultdict(float)
        per_role_dur = defaultdict(float)
        for j, r in enumerate(s):
            per_role_dur[roles[j]] += (r[1] - r[0]) / 1e3
            if j:
                per_role_inc[roles[j]] += (r[1] - s[j - 1][1]) / 1e3
        for k in per_role_dur:
            dur[k].append(per_role_dur[k])
            inc[k].append(per_role_inc[k])
    count = defaultdict(int)
    for r in roles:
        count[r] += 1
    med = statistics.median
    print(f"{len(steps)} graph steps of {modal} kernels; {len(keep)} measured. step span {med(spans):.1f} us, "
          f"gap to the next step {med(gaps) if gaps else 0:.1f} us")
    print("| role | per step | dur per kernel us | inc per kernel us | inc per step us | share of span |")
    print("|---|---|---|---|---|---|")
    for k in sorted(inc, key=lambda k: -med(inc[k])):
        c = count[k]
        print(f"| {k} | {c} | {med(dur[k]) / c:.2f} | {med(inc[k]) / c:.2f} | {med(inc[k]):.1f} | "
              f"{med(inc[k]) / med(spans):.3f} |")
    # One layer in the middle, kernel by kernel (start and end relative to the layer's first start).
    layer = int(sys.argv[sys.argv.index("--layer") + 1]) if "--layer" in sys.argv else None
    qkv_at = [j for j, r in enumerate(roles) if r == "qkv"]
    if qkv_at:
        li = layer if layer is not None else len(qkv_at) // 2
        a = qkv_at[li]
        b = qkv_at[li + 1] if li + 1 < len(qkv_at) else len(roles)
        print(f"\nlayer {li}, kernel by kernel (medians; us from the layer's first kernel's start; "
              f"prev end = the kernel before's end):")
        print("| kernel | start | wait from prev end | end | dur | inc |")
        print("|---|---|---|---|---|---|")
        for j in range(a, b + 1 if b < len(roles) else b):
            st = med([(steps[i][j][0] - steps[i][a][0]) / 1e3 for i in keep])
            en = med([(steps[i][j][1] - steps[i][a][0]) / 1e3 for i in keep])
            lag = med([(steps[i][j][0] - steps[i][j - 1][1]) / 1e3 for i in keep])
            d = med([(steps[i][j][1] - steps[i][j][0]) / 1e3 for i in keep])
            ic = med([(steps[i][j][1] - steps[i][j - 1][1]) / 1e3 for i in keep])
            print(f"| {roles[j]} | {st:.2f} | {lag:.2f} | {en:.2f} | {d:.2f} | {ic:.2f} |")


if __name__ == "__main__":
    main()
