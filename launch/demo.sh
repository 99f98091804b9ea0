#!/usr/bin/env bash
# The main job: set up (or reuse) .venv, index the committed answers and convert the default
# model once, then start the draft daemon and the target daemon as separate processes and
# stream answers to a few prompts through the client. Extra arguments go to
# `python -m launch.local`; with a --prompt or --prompts-file of its own, the demo's prompts
# are left out.
set -euo pipefail
root="$(CDPATH= cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"  # CDPATH set, cd printed the path too
venv="${DFLASH_VENV:-$root/.venv}"
bash "$root/launch/setup_env.sh"
# Where the caller is, so that relative paths in the arguments are theirs (they were read and
# written in the repository: an audit); the installed packages, not modules there, are imported.
export PYTHONSAFEPATH=1
# The datastore's index, once per machine and store; the daemon serves without it where it cannot be
# built. A signal to this script stops it too (it ran on, orphaned: an audit).
"$venv/bin/python" -m answers.index &
indexer=$!
trap 'kill "$indexer" 2>/dev/null; exit 130' INT # a job in the background ignores Ctrl-C itself
trap 'kill "$indexer" 2>/dev/null; exit 143' TERM
trap 'kill "$indexer" 2>/dev/null; exit 129' HUP
wait "$indexer" || echo "demo: going on without the datastore's index" >&2
trap - INT TERM HUP
prompts=(--prompts-file "$root/launch/demo_prompts.txt")
for arg in "$@"; do
  case "$arg" in --prompt | --prompt=* | --prompts-file | --prompts-file=*) prompts=() ;; esac
done
exec "$venv/bin/python" -m launch.local ${prompts[@]+"${prompts[@]}"} --max-new-tokens 128 "$@"
