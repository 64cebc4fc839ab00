# Sourced by the GPU machine's scripts: `. bench/gpu/unpack.sh VARIANT...` unpacks .gpu/libs/*.gz
# into /tmp/gpulibs and each variant's gzipped binaries (pack.sh's) into /tmp/bin/VARIANT, and
# points LD_LIBRARY_PATH at the libraries.
mkdir -p /tmp/gpulibs
for f in .gpu/libs/*.gz; do gunzip -c "$f" > /tmp/gpulibs/$(basename "$f" .gz); done
for v in "$@"; do
  mkdir -p /tmp/bin/$v
  for f in .gpu/$v/*.gz; do gunzip -c "$f" > /tmp/bin/$v/$(basename "$f" .gz); done
  chmod +x /tmp/bin/$v/*
done
export LD_LIBRARY_PATH=$PWD/.gpu/libs:/tmp/gpulibs:/usr/local/cuda/lib64
