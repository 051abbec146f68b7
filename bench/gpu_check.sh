#!/usr/bin/env bash
# One-command GPU check, under 8 minutes on one H200: the gpu-marked tests, then
# opt-1.3b / opt-2.7b fp16 timings (attention backends on uniform vs skewed batches, decode
# steps vs the memory-bandwidth floor, aligned vs fcfs vs continuous engine runs). Writes
# gpu_check.json, gpu_check.md and engine_iterations.jsonl into $OUT, or into the directory
# given as the last argument.
#
#   bash bench/gpu_check.sh                      # on the GPU machine
#   bash bench/gpu_check.sh --cpu-dry-run /tmp/x # same code paths, tiny shapes, CPU only
#   bash bench/gpu_check.sh --sections=tests,engine --engine-backends=triton-splitk
#                                                # a part of it (options take `=`)
#
# The device machine has torch, triton, aiohttp, uvloop, sortedcontainers, safetensors,
# tokenizers and prometheus-client, but not msgspec (nor pytest-asyncio, which the async test
# modules need to be collected). Carry them as wheels. Once, here, in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl msgspec==0.23.0 pytest-asyncio==1.5.0
#   (add safetensors, tokenizers or prometheus-client the same way if the machine lacks them)
# then call the device tool with carry [".whl"] and command `bash bench/gpu_check.sh`, with a
# timeout_s of about 540. Each wheel whose module does not import is installed with
# `pip install --no-deps` into a private folder put on PYTHONPATH; nothing else is touched.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${TMPDIR:-/tmp}/gpu_check_site

ARGS=()
DEST=${OUT:-gpu_check_out}
for arg in "$@"; do
  case "$arg" in
    --*) ARGS+=("$arg") ;;
    *) DEST=$arg ;;
  esac
done

if compgen -G ".whl/*.whl" >/dev/null; then
  for whl in .whl/*.whl; do
    module=$(basename "$whl" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')
    if ! "$PY" -c "import $module" 2>/dev/null; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" "$whl"
    fi
  done
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" -m bench.gpu_check --out "$DEST" ${ARGS[@]+"${ARGS[@]}"}
