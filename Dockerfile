# combs container image (CPU, Debian 12). Builds with the same presets CI uses; the runtime stage
# holds only the binaries and a non-root user. The CUDA image and the server entry point come with
# the deployment issue.
FROM debian:12 AS build
WORKDIR /src
COPY .ci/install-deps .ci/install-deps
RUN .ci/install-deps
COPY . .
RUN cmake --preset portable -DCOMBS_WITH_CUDA=OFF -DCOMBS_BUILD_TESTS=OFF \
 && cmake --build --preset portable --target combs-bench

FROM debian:12-slim
RUN useradd --system --uid 10001 combs
COPY --from=build /src/build/portable/bin/combs-bench /usr/local/bin/
USER combs
ENTRYPOINT ["combs-bench"]
CMD ["kv", "--contexts", "512,2048", "--reps", "5"]
