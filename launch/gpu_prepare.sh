#!/usr/bin/env bash
# Prepare here what the device machine lacks and cannot fetch (it reaches no network): the wheels
# launch/gpu_run.sh installs (.whl/) and the SmolLM2 GGUF in parts (.gpu/), each small enough to
# ride along with one call (a call carries at most 64 MiB, the working tree included).
# Both folders are git-ignored. How to carry them, call by call: docs/training.md, "On a GPU".
# Usage: bash launch/gpu_prepare.sh [PART_MB]   (default: the largest part that fits beside the
# working tree as it is now, tracked and untracked files and the wheels, with 1 MiB to spare)
set -euo pipefail
root="$(CDPATH= cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
[ -x .venv/bin/python ] || bash launch/setup_env.sh
rm -rf .whl .gpu
mkdir -p .whl .gpu
platforms=()
for n in 2_28 2_27 2_17; do platforms+=(--platform "manylinux_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64)
# The device machine's python is 3.12 with torch, numpy, pyyaml, tqdm and requests; pyzmq and gguf
# are missing, and its transformers may be another version than ours (5.17 lacked a cache class we
# import): all three go, at the versions this checkout is tested with.
versions=$(.venv/bin/python -c "import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in ('pyzmq', 'gguf', 'transformers')))")
# shellcheck disable=SC2086
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl $versions
gguf="$(.venv/bin/python -c 'from target_node.model.default_model import _wheel_folder; print(_wheel_folder())')"
if [ -n "${1:-}" ]; then
  part_bytes=$(( $1 * 1024 * 1024 ))
else  # what travels with every call: the working tree (tracked and untracked, not ignored)
  tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | du --files0-from=- -cb | tail -1 | cut -f1)
  part_bytes=$(( 64 * 1024 * 1024 - tree - 1024 * 1024 ))
fi
[ "$part_bytes" -gt 0 ] || { echo "gpu_prepare.sh: the working tree ($(( ${tree:-0} / 1048576 )) MiB) leaves no room for a GGUF part in a 64 MiB call: the answer store must travel once, in parts (docs/training.md, On a GPU)" >&2; exit 1; }
split -b "$part_bytes" -d "$gguf/SmolLM2-135M-Instruct.Q4_1.gguf" .gpu/SmolLM2-135M-Instruct.Q4_1.gguf.part
# What the joined parts must hash to: gpu_run.sh checks it, so a part left behind is a clear error.
(cd "$gguf" && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf) > .gpu/SHA256SUMS
# The wheels ride with the last part, the smallest, where they fit beside it; else in a call of their own.
parts=(.gpu/*.part*)
last="${parts[-1]}"
wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
# The run's minutes from the device time the calls leave (15 minutes a session): the start (about
# 3), each carrying call (about 25 s), the run's own start and scoring past --minutes (about 1.5),
# and a minute to spare; a plan of 9 minutes and 8 calls overran that budget (an audit).
calls=$(( ${#parts[@]} + ( $(stat -c %s "${parts[-1]}") + wheels > part_bytes ? 1 : 0 ) ))
minutes=$(( (15 * 60 - 3 * 60 - calls * 25 - 90 - 60) / 60 ))
[ "$minutes" -le 9 ] || minutes=9
timeout=$(( minutes * 60 + 90 > 595 ? 595 : minutes * 60 + 90 ))
[ "$minutes" -ge 3 ] || { echo "gpu_prepare.sh: $calls calls leave under 3 minutes to run: carry less" >&2; exit 1; }
echo "Carry, call by call, back to back on the warm machine (each command \`true\` but the last):"
for part in "${parts[@]}"; do
  extra=""
  [ "$part" = "${parts[0]}" ] && extra='".gpu/SHA256SUMS", '
  if [ "$part" = "$last" ]; then
    if [ $(( $(stat -c %s "$last") + wheels )) -le "$part_bytes" ]; then
      extra+='".whl", '
    else
      echo "  [\".whl\"]"
    fi
    echo "  [$extra\"$part\"] with: bash launch/gpu_run.sh \$OUT --minutes $minutes --plan drafter --layers 1,2,4 (timeout_s $timeout)"
  else
    echo "  [$extra\"$part\"]"
  fi
done
