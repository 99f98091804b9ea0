#!/usr/bin/env bash
# Prepare here what the device machine lacks and cannot fetch (it reaches no network), and make this
# checkout small enough to travel (a call carries at most 64 MiB, the working tree included):
#  - .gpu/payload.tar.partNN: the wheels gpu_run.sh installs, the SmolLM2 GGUF and the committed
#    answer store, in one tar cut into parts that each fit in one call beside the working tree;
#  - the checkout stands on a commit of its own, HEAD minus data/answers, detached: tracked or not,
#    the store (56 MB of the 70) no longer rides with every call. Nothing is deleted from a branch;
#    `--restore` goes back to the branch, the store with it, and carries the commits made meanwhile
#    onto it (cherry-picked: the slim commit itself, which deletes the store, never reaches a branch).
# Usage: bash launch/gpu_prepare.sh [PART_MB]   (default: the largest part that fits beside the
#        working tree, with 1 MiB to spare)   |   bash launch/gpu_prepare.sh --restore
# How to carry the parts, call by call: docs/training.md, "On a GPU".
set -euo pipefail
root="$(CDPATH= cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
slim="$(git rev-parse --git-path dflash-gpu-slim)"  # "<slim commit> <branch>", while the checkout is slim
say() { echo "gpu_prepare.sh: $*" >&2; }

if [ "${1:-}" = "--restore" ]; then
  [ -f "$slim" ] || { say "this checkout is not slimmed: nothing to restore"; exit 0; }
  read -r commit branch < "$slim"
  head="$(git rev-parse HEAD)"
  # Commits made while slim stand on the slim commit: a branch made at them (or moved to them, or
  # merged with them) takes the store's deletion along, so they go over one by one instead.
  if ! git merge-base --is-ancestor "$commit" "$head"; then
    say "HEAD ${head:0:12} is not the slim commit ${commit:0:12} nor after it: check out $branch yourself, then rm $slim"
    exit 1
  fi
  made="$(git rev-list "$commit..$head")"
  if [ -n "$made" ] && ! { git diff --quiet && git diff --cached --quiet; }; then
    say "commits were made while slim and the checkout has uncommitted changes: commit or stash them, then run --restore again"
    exit 1
  fi
  git checkout -q "$branch"
  rm "$slim"
  if [ -n "$made" ] && ! git cherry-pick --allow-empty "$commit..$head"; then
    say "the commits made while slim did not all apply on $branch: resolve, then git cherry-pick --continue"
    say "(or git cherry-pick --abort; they stay at ${head:0:12}: git cherry-pick $commit..$head)"
    exit 1
  fi
  echo "Back on $branch at $(git rev-parse --short HEAD), data/answers with it$([ -z "$made" ] || echo ", and the $(echo "$made" | wc -l) commit(s) made while slim")."
  exit 0
fi

if [ -f "$slim" ]; then
  read -r commit branch < "$slim"
  [ "$(git rev-parse HEAD)" = "$commit" ] || { say "HEAD moved off the slim commit: run --restore first"; exit 1; }
  base="$(git rev-parse "$commit^")"
else
  branch="$(git symbolic-ref -q --short HEAD)" || { say "HEAD is detached: check out a branch first (--restore goes back to it)"; exit 1; }
  base="$(git rev-parse HEAD)"
  # New shards would travel as untracked files and be lost to the payload: commit or move them first.
  extra="$(git ls-files --others --exclude-standard -- data/answers)"
  [ -z "$extra" ] || { say "untracked files in data/answers (commit or move them first): $extra"; exit 1; }
  git diff --quiet HEAD -- data/answers || { say "data/answers differs from HEAD: commit or restore it first"; exit 1; }
fi
[ -x .venv/bin/python ] || bash launch/setup_env.sh
py="${DFLASH_VENV:-$root/.venv}/bin/python"

# The payload, staged in .gpu/payload/: whl/ (pyzmq and gguf are missing there, and its transformers
# may be another version than ours: 5.17 lacked a cache class we import), gguf/, answers/.
rm -rf .gpu .whl  # .whl/: where the wheels went before 2026-12-08
mkdir -p .gpu/payload/whl .gpu/payload/gguf
platforms=()
for n in 2_28 2_27 2_17; do platforms+=(--platform "manylinux_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64)
versions=$("$py" -c "import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in ('pyzmq', 'gguf', 'transformers')))")
# shellcheck disable=SC2086
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .gpu/payload/whl $versions
gguf="$("$py" -c 'from target_node.model.default_model import _wheel_folder; print(_wheel_folder())')"
cp "$gguf/SmolLM2-135M-Instruct.Q4_1.gguf" .gpu/payload/gguf/
git archive --format=tar "$base" data/answers | tar -x -C .gpu/payload
mv .gpu/payload/data/answers .gpu/payload/answers && rmdir .gpu/payload/data

if [ ! -f "$slim" ]; then
  index="$(mktemp)"
  trap 'rm -f "$index"' EXIT
  GIT_INDEX_FILE="$index" git read-tree "$base"
  GIT_INDEX_FILE="$index" git rm -r -q --cached data/answers
  tree="$(GIT_INDEX_FILE="$index" git write-tree)"
  # An identity of its own: a checkout where git has none (a fresh machine, CI) stopped here, and
  # this commit never goes on a branch (--restore cherry-picks what follows it).
  who=(GIT_AUTHOR_NAME=gpu_prepare.sh GIT_AUTHOR_EMAIL=gpu_prepare.sh@localhost)
  who+=(GIT_COMMITTER_NAME=gpu_prepare.sh GIT_COMMITTER_EMAIL=gpu_prepare.sh@localhost)
  commit="$(env "${who[@]}" git commit-tree "$tree" -p "$base" -m "gpu_prepare.sh: $branch without data/answers, for the device machine")"
  git checkout -q --detach "$commit"
  echo "$commit $branch" > "$slim"
  echo "This checkout now stands on ${commit:0:12}, $branch without data/answers (detached);"
  echo "  bash launch/gpu_prepare.sh --restore   goes back to $branch, data/answers with it."
fi

(cd .gpu/payload && tar -cf ../payload.tar whl gguf answers && cd .. && sha256sum payload.tar > SHA256SUMS)
rm -rf .gpu/payload
if [ -n "${1:-}" ]; then
  part_bytes=$(( $1 * 1024 * 1024 ))
else  # what travels with every call: the working tree (tracked and untracked, not ignored)
  tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | du --files0-from=- -cb | tail -1 | cut -f1)
  part_bytes=$(( 64 * 1024 * 1024 - tree - 1024 * 1024 - $(stat -c %s .gpu/SHA256SUMS) ))
fi
[ "$part_bytes" -gt 0 ] || { say "the working tree ($(( ${tree:-0} / 1048576 )) MiB) leaves no room for a part in a 64 MiB call"; exit 1; }
split -b "$part_bytes" -d .gpu/payload.tar .gpu/payload.tar.part
rm .gpu/payload.tar
parts=(.gpu/payload.tar.part*)
# The run's minutes from the device time the calls leave (15 minutes a session): the start (about
# 3), each carrying call (about 25 s), the run's own start and scoring past --minutes (about 1.5),
# and a minute to spare; a plan of 9 minutes and 8 calls overran that budget (an audit).
minutes=$(( (15 * 60 - 3 * 60 - ${#parts[@]} * 25 - 90 - 60) / 60 ))
[ "$minutes" -le 9 ] || minutes=9
timeout=$(( minutes * 60 + 90 > 595 ? 595 : minutes * 60 + 90 ))
[ "$minutes" -ge 3 ] || { say "${#parts[@]} calls leave under 3 minutes to run: carry less"; exit 1; }
echo "Carry, call by call, back to back on the warm machine (each command \`true\` but the last):"
for part in "${parts[@]}"; do
  if [ "$part" = "${parts[-1]}" ]; then
    echo "  [\".gpu/SHA256SUMS\", \"$part\"] with: bash launch/gpu_run.sh \$OUT --minutes $minutes --plan drafter --layers 1,2,4 (timeout_s $timeout)"
  else
    echo "  [\"$part\"]"
  fi
done
echo "Afterwards: bash launch/gpu_prepare.sh --restore"
