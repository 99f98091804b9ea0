#!/usr/bin/env bash
# The one-shot GPU run, as the device machine gets it: install the wheels it lacks (pyzmq,
# gguf) from .whl/, join the SmolLM2 GGUF parts carried in .gpu/, then run benchmarks.gpu_run.
# Prepared here by launch/gpu_prepare.sh. Usage there:  bash launch/gpu_run.sh "$OUT" [benchmarks.gpu_run flags]
set -euo pipefail
py="${PYTHON:-python3}"  # the GPU machine's own python (torch is installed there)
root="$(CDPATH= cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:?usage: gpu_run.sh OUT_DIR [flags]}"; shift
mkdir -p "$out"
out="$(CDPATH= cd -- "$out" && pwd)"  # absolute: it is used after the cd below
cd "$root"
# The answer store is xz (data/answers/*.jsonl.xz): a python built without lzma would fail minutes in.
"$py" -c "import lzma" || { echo "gpu_run.sh: $py has no lzma module, which the answer store needs" >&2; exit 1; }
# The wheels go in where something is missing or its transformers is not the one carried.
want=$(compgen -G ".whl/transformers-*.whl" | sed -E 's/.*transformers-([^-]+)-.*/\1/' || true)
check="import sys, zmq, gguf, transformers; sys.exit(bool('$want') and transformers.__version__ != '$want')"
if compgen -G ".whl/*.whl" > /dev/null && ! "$py" -c "$check" 2>/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$root${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
fi
gguf=()
if compgen -G ".gpu/*.gguf.part*" > /dev/null; then
  mkdir -p /tmp/gguf
  cat .gpu/*.gguf.part* > /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ -f .gpu/SHA256SUMS ] && ! (cd /tmp/gguf && sha256sum --quiet -c "$root/.gpu/SHA256SUMS"); then
    echo "gpu_run.sh: the GGUF parts in .gpu/ do not make the whole file (a call's part missing?): $(ls .gpu | tr "\n" " ")" >&2
    exit 1
  fi
  gguf=(--gguf-folder /tmp/gguf)
fi
export PYTHONUNBUFFERED=1
"$py" -m benchmarks.gpu_run --out "$out" ${gguf[@]+"${gguf[@]}"} "$@" 2>&1 | tee "$out/log.txt"
