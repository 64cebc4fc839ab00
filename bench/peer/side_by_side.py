#!/usr/bin/env python3
"""The tables of bench/gpu/side_by_side.sh and bench/peer/cpu_side_by_side.sh: combs and the peer
on the same files, medians over the rounds, from the raw outputs in OUT.

usage: side_by_side.py OUT SHAPES ROUNDS               (GPU)
       side_by_side.py --cpu OUT LABELS ROUNDS         (CPU; a label per weight type or file)
GPU: OUT/combs-SHAPE-R.md, the row of `combs-bench gpu`; the peer: OUT/peer-decode-SHAPE-R.json and
OUT/peer-prefill-SHAPE-R.json (llama-bench -o json), OUT/peer-sessions-SHAPE-R.{jsonl,log}
(llama-batched-bench --output-format jsonl).
CPU: OUT/combs-LABEL-R.md, the row of `combs-bench model`; OUT/peer-prompt-LABEL-R.json and
OUT/peer-decode-LABEL-R.json (llama-bench -o json).
"""
import json
import statistics
import sys


def combs_row(path, shape):
    """combs-bench gpu's table row of `shape` as a dict of its figures."""
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        # the row names the file: SHAPE, or SHAPE-DTYPE-VOCAB as combs-bench writes it (SHAPE-bf16-VOCAB
        # for a BF16 shape; SHAPE-VOCAB where the label names the type, as moe.sh's qwen3-30b-a3b-q4_k_m)
        if cells and (cells[0] == shape or cells[0].startswith((shape + "-bf16-", shape + "-ggml-vocab-"))) \
                and len(cells) >= 9:
            return {"bound": float(cells[2]), "decode": float(cells[3]), "prefill": float(cells[7]),
                    "sessions": float(cells[8])}
    raise ValueError(f"{path}: no row for {shape}")


def bench_json(path):
    """llama-bench -o json: the median of each test's samples, by (n_prompt, n_gen, n_ubatch)."""
    with open(path) as f:
        tests = json.load(f)
    return {(t["n_prompt"], t["n_gen"], t["n_ubatch"]): statistics.median(t["samples_ts"]) for t in tests}


def batched_tg(paths):
    """llama-batched-bench --output-format jsonl: speed_tg of its (one) line."""
    for p in paths:
        try:
            for line in open(p):
                if line.startswith("{") and "speed_tg" in line:
                    return json.loads(line)["speed_tg"]
        except FileNotFoundError:
            pass
    raise ValueError(f"no batched-bench result in {paths}")


def cpu_main(out, labels, rounds):
    print("| model | weights | workload | combs tok/s | peer tok/s | combs / peer | combs / bound | peer / bound |\n"
          "|---|---|---|---|---|---|---|---|")
    for d in labels:
        prompt, decode, ratio, shape, dtype = ([], []), ([], []), [], "?", "?"
        for r in range(1, rounds + 1):
            try:
                # The row of combs-bench model's table, by its header's names (columns come and go).
                header, row = None, None
                for line in open(f"{out}/combs-{d}-{r}.md"):
                    if not line.startswith("|"):
                        continue
                    cells = [c.strip() for c in line.strip().strip("|").split("|")]
                    if cells[0] == "model":
                        header = cells
                    elif header and len(cells) == len(header) and not cells[0].startswith("-"):
                        row = dict(zip(header, cells))
                if row is None:
                    raise ValueError(f"combs-{d}-{r}.md: no row")
                pp = bench_json(f"{out}/peer-prompt-{d}-{r}.json")
                tg = bench_json(f"{out}/peer-decode-{d}-{r}.json")
            except (OSError, ValueError, KeyError) as e:
                print(f"<!-- round {r} {d}: {e} -->")
                continue
            bound = float(row["decode bound tok/s"])  # from the read bandwidth measured in the same run
            shape, dtype = row["model"], row["dtype"]
            prompt[0].append(float(row["prompt tok/s"]))
            prompt[1].append(max(v for (n, g, _), v in pp.items() if n == 512 and g == 0))
            decode[0].append(float(row["decode tok/s"]))
            decode[1].append(max(v for (n, g, _), v in tg.items() if g == 128))
            ratio.append((decode[0][-1] / bound, decode[1][-1] / bound))
        if not ratio:
            continue
        med = statistics.median
        for name, (cv, pv), br in (("prompt 512", prompt, None), ("decode 128 after 512", decode, ratio)):
            cm, pm = med(cv), med(pv)
            tail = f"{med(b[0] for b in br):.2f} | {med(b[1] for b in br):.2f} |" if br else "- | - |"
            print(f"| {shape} | {dtype} | {name} | {cm:,.2f} | {pm:,.2f} | {cm / pm:.2f} | {tail}")
    print(f"\n(medians over {rounds} interleaved rounds; each round: per weight type combs, then the peer, same file)")


def main():
    if sys.argv[1] == "--cpu":
        return cpu_main(sys.argv[2], sys.argv[3].split(","), int(sys.argv[4]))
    out, shapes, rounds = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
    print("| model | workload | combs tok/s | peer tok/s | combs / peer | bound tok/s | combs / bound | "
          "peer / bound |\n|---|---|---|---|---|---|---|---|")
    for s in shapes:
        figs = {"decode": ([], []), "prefill": ([], []), "sessions": ([], [])}
        bound, best_ub = [], []
        for r in range(1, rounds + 1):
            try:
                c = combs_row(f"{out}/combs-{s}-{r}.md", s)
                d = bench_json(f"{out}/peer-decode-{s}-{r}.json")
                p = bench_json(f"{out}/peer-prefill-{s}-{r}.json")
                b = batched_tg([f"{out}/peer-sessions-{s}-{r}.jsonl", f"{out}/peer-sessions-{s}-{r}.log"])
            except (OSError, ValueError, KeyError) as e:
                print(f"<!-- round {r} {s}: {e} -->")
                continue
            bound.append(c["bound"])
            figs["decode"][0].append(c["decode"])
            figs["decode"][1].append(max(v for (npp, ng, _), v in d.items() if ng == 256))
            ub, v = max(((k[2], v) for k, v in p.items() if k[0] == 2048), key=lambda kv: kv[1])
            best_ub.append(ub)
            figs["prefill"][0].append(c["prefill"])
            figs["prefill"][1].append(v)
            figs["sessions"][0].append(c["sessions"])
            figs["sessions"][1].append(b)
        if not bound:
            continue
        names = {"decode": "1 session decode (256 after 128)",
                 "prefill": f"prefill 2,048 (peer's fastest -ub: {'/'.join(map(str, sorted(set(best_ub))))})",
                 "sessions": "64 sessions decode (1,024 prompts, 128 new)"}
        for w, (cv, pv) in figs.items():
            cm, pm = statistics.median(cv), statistics.median(pv)
            bd = statistics.median(bound) if w == "decode" else None
            print(f"| {s} | {names[w]} | {cm:,.0f} | {pm:,.0f} | {cm / pm:.2f} | "
                  + (f"{bd:,.0f} | {cm / bd:.2f} | {pm / bd:.2f} |" if bd else "- | - | - |"))
    print(f"\n(medians over {rounds} rounds; per round: combs {', '.join(shapes)} then the peer, same files)")


if __name__ == "__main__":
    main()
