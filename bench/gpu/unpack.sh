# Sourced by the GPU machine's scripts: `. bench/gpu/unpack.sh VARIANT...` unpacks .gpu/libs/*.{gz,xz}
# into /tmp/gpulibs and each variant's compressed binaries (pack.sh's) into /tmp/bin/VARIANT, and
# points LD_LIBRARY_PATH at the libraries. (xz where gzip leaves the carried tree over 64 MiB.)
# Each file unpacked beside its place and renamed over it: a program still running from an earlier
# call (a model being written in the background) keeps its old binary and libraries (writing over a
# mapped library in place crashed one).
unpack_one() {
  local to=$2/$(basename "${1%.*}")
  case $1 in *.gz) gunzip -c "$1" > "$to.new" ;; *.xz) xz -dc "$1" > "$to.new" ;; esac && mv -f "$to.new" "$to"
}
mkdir -p /tmp/gpulibs
for f in .gpu/libs/*.gz .gpu/libs/*.xz; do [ -e "$f" ] && unpack_one "$f" /tmp/gpulibs; done
for v in "$@"; do
  mkdir -p /tmp/bin/$v
  for f in .gpu/$v/*.gz .gpu/$v/*.xz; do [ -e "$f" ] && unpack_one "$f" /tmp/bin/$v; done
  chmod +x /tmp/bin/$v/*
done
export LD_LIBRARY_PATH=$PWD/.gpu/libs:/tmp/gpulibs:/usr/local/cuda/lib64
