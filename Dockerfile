# combs container image (CPU, Debian 12). Builds with the same presets CI uses (`portable`: no
# -march=native, the matmul kernels pick AVX-512/AVX2 at run time); the runtime stage holds only
# the binaries, their runtime libraries and a non-root user. The CUDA image and the server entry
# point come with the deployment issue.
FROM debian:12 AS build
WORKDIR /src
COPY .ci/install-deps .ci/install-deps
RUN .ci/install-deps
COPY . .
RUN cmake --preset portable -DCOMBS_WITH_CUDA=OFF -DCOMBS_BUILD_TESTS=OFF \
 && cmake --build --preset portable --target combs-bench combs-mkmodel combs-generate combs-tokenize

FROM debian:12-slim
RUN apt-get update && apt-get install -y --no-install-recommends libicu72 \
 && rm -rf /var/lib/apt/lists/* && useradd --system --uid 10001 combs
COPY --from=build /src/build/portable/bin/combs-* /usr/local/bin/
COPY --from=build /src/tests/data/vocab/ggml-vocab-llama-bpe.gguf /usr/local/share/combs/vocab.gguf
USER combs
WORKDIR /home/combs
# Models are mounted at /models; by default a random tiny model is written and generated from.
VOLUME ["/models"]
CMD ["sh", "-c", "combs-mkmodel --shape tiny --vocab /usr/local/share/combs/vocab.gguf --out /tmp/tiny.gguf && combs-generate --model /tmp/tiny.gguf --prompt 'Hello, combs' --max-tokens 32"]
