#!/usr/bin/env bash
# The test command: set up (or reuse) .venv, lint, then run the whole suite.
set -euo pipefail
root="$(CDPATH= cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"  # CDPATH set, cd printed the path too
venv="${DFLASH_VENV:-$root/.venv}"
bash "$root/launch/setup_env.sh"
# The live page's test drives a real browser: Debian's chromium and chromedriver, installed
# here where apt-get can (CI runs as root on Debian). Elsewhere that one test skips and says why.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  if command -v apt-get >/dev/null && { [ -z "$sudo" ] || command -v sudo >/dev/null; }; then
    { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium chromium-driver; } \
      >/dev/null 2>&1 || echo "launch/test.sh: could not install chromium; the browser test will skip" >&2
  fi
fi
cd "$root"
"$venv/bin/ruff" check --no-cache .  # no cache: a read-only checkout made ruff panic
"$venv/bin/python" -m pytest -q "$@"
