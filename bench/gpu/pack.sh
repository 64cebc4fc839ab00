#!/bin/bash
# usage: bench/gpu/pack.sh VARIANT [BUILD_DIR]
# Copies combs-bench, combs_cuda_tests (and combs-mkmodel, combs-generate where built) from BUILD_DIR/bin (default build/portable) into
# .gpu/VARIANT, stripped and xz-compressed (~4 MB each). The device tool carries at most 64 MiB, the
# tracked tree (~11 MiB) included: with the libraries (~23 MiB) about eight binaries fit; drop a
# variant's test binary where only its speed is measured.
# .gpu/libs must hold the shared libraries the GPU machine lacks (see ../shared/gpu/README.md);
# unpack.sh (sourced by the scripts that run there) unpacks those gzipped there (*.gz).
set -eu
V=$1; B=${2:-build/portable}
mkdir -p .gpu/$V
for f in combs-bench combs_cuda_tests combs-mkmodel combs-generate; do
  [ -f "$B/bin/$f" ] || continue
  strip -o .gpu/$V/$f "$B/bin/$f" && xz -f -9 -T2 .gpu/$V/$f
done
du -sh .gpu
