#!/usr/bin/env bash
# The one-shot GPU run, as the device machine gets it: join the payload parts carried in .gpu/
# (the wheels it lacks, the SmolLM2 GGUF, the answer store), then run benchmarks.gpu_run.
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
# The payload gpu_prepare.sh cut into parts, one a call: join, check, unpack into .gpu/payload/.
payload=.gpu/payload
if compgen -G ".gpu/payload.tar.part*" > /dev/null; then
  cat .gpu/payload.tar.part* > .gpu/payload.tar
  if ! (cd .gpu && sha256sum --quiet -c SHA256SUMS); then
    echo "gpu_run.sh: the parts in .gpu/ do not make the whole payload (a call's part or SHA256SUMS missing?): $(ls .gpu | tr "\n" " ")" >&2
    exit 1
  fi
  rm -rf "$payload" && mkdir -p "$payload" && tar -xf .gpu/payload.tar -C "$payload" && rm .gpu/payload.tar
fi
# The answer store stays behind with the slim checkout: the payload's copy takes its place.
if [ -d "$payload/answers" ] && ! compgen -G "data/answers/*.jsonl.xz" > /dev/null; then
  mkdir -p data && rm -rf data/answers && mv "$payload/answers" data/answers
fi
# The wheels go in where something is missing or its transformers is not the one carried.
want=$(compgen -G "$payload/whl/transformers-*.whl" | sed -E 's/.*transformers-([^-]+)-.*/\1/' || true)
check="import sys, zmq, gguf, transformers; sys.exit(bool('$want') and transformers.__version__ != '$want')"
if compgen -G "$payload/whl/*.whl" > /dev/null && ! "$py" -c "$check" 2>/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$payload"/whl/*.whl
  export PYTHONPATH="/tmp/site:$root${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
fi
gguf=()
[ -f "$payload/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" ] && gguf=(--gguf-folder "$root/$payload/gguf")
export PYTHONUNBUFFERED=1
"$py" -m benchmarks.gpu_run --out "$out" ${gguf[@]+"${gguf[@]}"} "$@" 2>&1 | tee "$out/log.txt"
