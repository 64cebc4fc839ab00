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
import csv, subprocess, re, collections, sys
rows = list(csv.DictReader(open(sys.argv[1])))
rows.sort(key=lambda r: int(r["start"]))
names = sorted(set(r["name"] for r in rows))
dem = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
dm = dict(zip(names, dem))
def short(n):
    d = dm.get(n, n)
    d = re.sub(r"combs::|cuda::|\(anonymous namespace\)::|void ", "", d)
    depth=0; cut=len(d)
    for k,ch in enumerate(d):
        if ch=='<': depth+=1
        elif ch=='>': depth-=1
        elif ch=='(' and depth==0: cut=k; break
    return d[:cut][:70]
S = [short(r["name"]) for r in rows]
last_prefill = max(i for i, s in enumerate(S) if "nvjet" in s or "cutlass" in s or "dequantize_kernel<(DType)10, __nv_bfloat16>" in s)
D = rows[last_prefill+1:]; DS = S[last_prefill+1:]
t0 = int(D[0]["start"]); t1 = max(int(r["end"]) for r in D)
span = (t1-t0)/1e3
tot = collections.defaultdict(float); cnt = collections.Counter()
for r, s in zip(D, DS):
    k = s + f" g{r['gx']}x{r['gy']}"
    tot[k] += (int(r["end"]) - int(r["start"]))/1e3; cnt[k] += 1
steps = cnt[max(cnt, key=lambda k: cnt[k] if "embedding" in k or "dequantize_kernel<(DType)12, float>" in k else 0)]
print(f"decode phase: {len(D)} kernels, span {span:.0f} us, steps ~{steps}, per step {span/max(steps,1):.0f} us; kernel sum {sum(tot.values()):.0f}")
for k in sorted(tot, key=lambda k: -tot[k])[:40]:
    print(f"{tot[k]/max(steps,1):9.1f} us/step {tot[k]/sum(tot.values()):6.3f} n/step={cnt[k]/max(steps,1):6.1f} {tot[k]/cnt[k]:8.1f} us/each  {k}")
print("\nincrements (end minus the latest end before it), per step:")
inc = collections.defaultdict(float); mx = int(D[0]["start"])
for r, s in zip(D, DS):
    k = s + f" g{r['gx']}x{r['gy']}"
    e = int(r["end"])
    inc[k] += max(0, e - mx)/1e3; mx = max(mx, e)
T = sum(inc.values())
for k in sorted(inc, key=lambda k: -inc[k])[:24]:
    print(f"{inc[k]/max(steps,1):9.1f} us/step {inc[k]/T:6.3f} {inc[k]/cnt[k]:8.1f} us/each  {k}")
