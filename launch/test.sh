#!/usr/bin/env bash
# The test command: set up (or reuse) .venv, lint, then run the whole suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/launch/setup_env.sh"
cd "$root"
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
