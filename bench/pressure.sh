#!/bin/bash
# usage: bench/pressure.sh [BUILD_DIR] [ROUNDS] [DURATION_S]
# Issue 27's pressure run on this machine's CPU: combs-server on its default model with a 6 MiB
# page pool, combs-loadgen --concurrency 96 (the default flow mix), without and with a 16 MiB host
# tier (--host-kv-restore copy), alternating, ROUNDS rounds each. Prints one line per run
# (requests, errors, failed checks, output tok/s, TTFT p50/p99) and the server's pressure
# counters (evictions, preemptions, host tier moves); the JSON reports stay in /tmp/combs-pressure.
set -eu
B=${1:-build/release}/bin; ROUNDS=${2:-3}; DUR=${3:-15}
OUTDIR=/tmp/combs-pressure; mkdir -p $OUTDIR
port=51871; mport=9471
for r in $(seq 1 "$ROUNDS"); do
  for tier in off on; do
    extra=(); [ $tier = on ] && extra=(--host-kv-memory-mib 16 --host-kv-restore copy)
    "$B/combs-server" --listen 127.0.0.1:$port --metrics-listen 127.0.0.1:$mport --kv-memory-mib 6 \
      --log-level warn "${extra[@]}" > $OUTDIR/server-$tier-$r.log 2>&1 &
    pid=$!
    for _ in $(seq 1 100); do curl -sf 127.0.0.1:$mport/metrics > /dev/null && break; sleep 0.1; done
    "$B/combs-loadgen" --server 127.0.0.1:$port --concurrency 96 --duration-s "$DUR" --warmup-s 2 --quiet \
      --json $OUTDIR/tier-$tier-$r.json > /dev/null
    m=$(curl -s 127.0.0.1:$mport/metrics | grep -E '^combs_(kv_evictions|preemptions|kv_host_offloads|kv_host_restored_tokens|kv_host_dropped)_total' | awk '{printf "%s=%s ", $1, $2}')
    kill $pid; wait $pid || true
    python3 - "$OUTDIR/tier-$tier-$r.json" "$tier" "$r" "$m" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
failed = sum(c["failed"] for c in r["checks"].values())
print(f"host tier {sys.argv[2]:3} round {sys.argv[3]}: {r['requests']} requests, {r['errors']} errors, {failed} failed checks, "
      f"{r['output_tokens_per_s']:.1f} output tok/s, TTFT p50 {r['ttft']['p50_ms']:.0f} ms p99 {r['ttft']['p99_ms']:.0f} ms | {sys.argv[4].replace('combs_', '')}")
PY
  done
done
