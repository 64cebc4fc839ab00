# combs container images, multi-stage.
#   docker build -t combs:cuda .                          # CUDA 13 on Ubuntu 24.04 (the default)
#   docker build -t combs:cpu --build-arg VARIANT=cpu .   # CPU only, Debian 12
# Both build stages install the packages CI installs (.ci/install-deps) and build with the preset CI
# builds too (`cmake --workflow --preset image`: portable x86-64, the matmul kernels pick
# AVX-512/AVX2 at run time; CUDA where nvcc is found). The runtime stage holds the installed
# binaries, the shared libraries they need (copied from the build stage by .ci/runtime-libs), the
# default model's vocabulary, and a non-root user.
ARG VARIANT=cuda

FROM nvidia/cuda:13.0.0-devel-ubuntu24.04 AS build-cuda
FROM debian:12 AS build-cpu
FROM build-${VARIANT} AS build
WORKDIR /src
COPY .ci/install-deps .ci/install-deps
RUN .ci/install-deps
COPY . .
RUN cmake --workflow --preset image \
 && cmake --install build/image --prefix /opt/combs \
 && .ci/runtime-libs /opt/combs/bin /opt/combs/lib

FROM nvidia/cuda:13.0.0-runtime-ubuntu24.04 AS runtime-cuda
FROM debian:12-slim AS runtime-cpu
FROM runtime-${VARIANT}
RUN (getent passwd combs || useradd --system --create-home --uid 10001 combs) \
 && mkdir -p /models /var/cache/combs && chown combs /var/cache/combs
COPY --from=build /opt/combs /opt/combs
# oneDNN's OpenMP threads wait passively between products instead of spinning on the cores combs's
# own pool uses next (bench/RESULTS.md, 2026-12-05: CPU prompts 7-36% faster); override at run time.
ENV PATH=/opt/combs/bin:$PATH LD_LIBRARY_PATH=/opt/combs/lib OMP_WAIT_POLICY=passive
USER combs
WORKDIR /home/combs
# gRPC and Prometheus metrics.
EXPOSE 50051 9464
# Models are mounted read-only at /models: `--model /models/NAME.gguf`. Without one the server
# serves its embedded default (a small random-weight model written into /var/cache/combs) with
# Llama 3's vocabulary, which cmake --install put in /opt/combs/share/combs: combs-server finds it
# beside its binary (bin/../share/combs), so no --vocab is needed.
VOLUME ["/models", "/var/cache/combs"]
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["combs", "--server", "127.0.0.1:50051", "health"]
ENTRYPOINT ["combs-server", "--listen", "0.0.0.0:50051", "--metrics-listen", "0.0.0.0:9464", \
            "--cache-dir", "/var/cache/combs"]
