#!/bin/bash
# Session 15, call B: llama.cpp and combs (main at e9c97ad) side by side on the same Q4_K_M files
# (llama-1b and llama-8b shapes, Llama 3's vocabulary, quantized by llama.cpp's llama-quantize),
# two rounds: one session's decode, prefill of 2,048, 64 sessions (bench/gpu/side_by_side.sh).
set -u
. bench/gpu/call.sh
timeout 545 bash bench/gpu/side_by_side.sh 2 llama-1b,llama-8b s15b Q4_K_M 2>&1 | tee -a $O/log.txt
echo "side_by_side rc ${PIPESTATUS[0]}" | tee -a $O/log.txt
[ -e $O/side-by-side-raw.tar.gz ] || tar czf $O/side-by-side-raw.tar.gz -C /tmp/side-by-side .
