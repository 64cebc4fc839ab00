# combs container image (CPU, Debian 12). Builds with the `portable` preset (no -march=native; the
# matmul kernels pick AVX-512/AVX2 at run time); the runtime stage holds the binaries, their
# runtime libraries, the Llama 3 vocabulary for the embedded default model, and a non-root user.
# The CUDA image and the compose deployment come with the deployment issue.
FROM debian:12 AS build
WORKDIR /src
COPY .ci/install-deps .ci/install-deps
RUN .ci/install-deps
COPY . .
RUN cmake --preset portable -DCOMBS_WITH_CUDA=OFF -DCOMBS_BUILD_TESTS=OFF \
 && cmake --build --preset portable \
      --target combs-server combs combs-bench combs-mkmodel combs-generate combs-tokenize

FROM debian:12-slim
RUN apt-get update && apt-get install -y --no-install-recommends \
      libgrpc++1.51 libprotobuf32 libicu72 libdnnl2 libgomp1 ca-certificates \
 && rm -rf /var/lib/apt/lists/* && useradd --system --create-home --uid 10001 combs
COPY --from=build /src/build/portable/bin/combs /src/build/portable/bin/combs-* /usr/local/bin/
COPY --from=build /src/tests/data/vocab/ggml-vocab-llama-bpe.gguf /usr/local/share/combs/vocab.gguf
USER combs
WORKDIR /home/combs
EXPOSE 50051
# Models are mounted at /models (`--model /models/NAME.gguf`); without one, the embedded default.
VOLUME ["/models"]
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s CMD ["combs", "--server", "127.0.0.1:50051", "health"]
ENTRYPOINT ["combs-server", "--listen", "0.0.0.0:50051", "--vocab", "/usr/local/share/combs/vocab.gguf"]
