#!/usr/bin/env bash
# The main job: set up (or reuse) .venv, convert the default model once, then start the
# draft daemon and the target daemon as separate processes and stream answers to a few
# prompts through the client. Extra arguments go to `python -m launch.local`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/launch/setup_env.sh"
cd "$root"
exec .venv/bin/python -m launch.local --prompts-file launch/demo_prompts.txt --max-new-tokens 128 "$@"
