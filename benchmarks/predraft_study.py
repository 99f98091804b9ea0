"""Can the draft daemon draft the next block while the target still verifies this one? (issue 31)

Pre-drafting must guess the verify's outcome, the accepted length j and the bonus token b, and
draft without the target features of the rows under verification, which do not exist yet. The
form measured here keeps the drafter's context as it is (features up to the block's anchor) and
puts the outcome in the block instead: [last_tok, d_1 .. d_j, b, MASK ...] at the anchor's
positions, so the slots after b draft the next step's tokens. The drafter was trained with masks
there; this measures what that costs against a fresh draft, and how often the outcome is among
the A likeliest the target can name before its verify (by the drafter's own probabilities of the
path and of b: target_node/drafting/outcomes.py); and the same hit rate had the step verified a
tree of TREE_NODES nodes, as the default mode often does.

Offline, from the target's greedy answers: one forward per prompt gives every position's
features (the engine computes a row the same whichever way it runs), and each chain step's
outcome follows from the answer itself, so no verify runs. Prints and writes:
hit rate by A, and on hits the accepted drafts of the pre-draft against a fresh draft.

    python -m benchmarks.predraft_study --limit 20 --json docs/results/predraft_study.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draft_node.checkpoint import load_drafter
from draft_node.kv_cache import DraftKVCache
from draft_node.predraft import predraft as draft_predrafts
from launch.common import TARGET_DTYPES, resolve_model
from launch.net import HelpFormatter
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.drafting.bridge import DrafterBridge
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.outcomes import likeliest_outcomes
from target_node.drafting.proposers import NoProposer
from target_node.drafting.tree import DraftTree
from target_node.model.default_model import ensure_default_drafter
from target_node.model.target import TargetModel, inexact
from training.prompts import read_prompts

ROOT = Path(__file__).resolve().parent.parent
ALTERNATIVES = (1, 2, 4, 8, 16)
TREE_NODES = 8


@dataclass
class Tally:
    steps: int = 0
    answer_positions: int = 0  # answer tokens that anchored a step or were drafted (all but the last)
    outcomes: Counter = field(default_factory=Counter)  # accepted length j -> steps
    hits: Counter = field(default_factory=Counter)  # A -> steps whose outcome was among the A likeliest
    tree_hits: Counter = field(default_factory=Counter)  # ... had the step verified a tree of TREE_NODES
    fresh_on_hits: int = 0  # accepted drafts of the fresh draft after a hit (at the largest A)
    pre_on_hits: int = 0  # ... of the pre-draft for the same step
    paired: int = 0
    draft_s: float = 0.0
    drafts: int = 0

    def report(self) -> dict:
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "answer_positions": self.answer_positions,
            "accepted_length": {str(j): n for j, n in sorted(self.outcomes.items())},
            "hit_rate": {str(a): round(self.hits[a] / steps, 4) for a in ALTERNATIVES},
            "tree_nodes": TREE_NODES,
            "tree_hit_rate": {str(a): round(self.tree_hits[a] / steps, 4) for a in ALTERNATIVES},
            "paired_steps": self.paired,
            "accepted_per_step_fresh": round(self.fresh_on_hits / max(self.paired, 1), 4),
            "accepted_per_step_predraft": round(self.pre_on_hits / max(self.paired, 1), 4),
            "draft_ms_per_block": round(1000 * self.draft_s / max(self.drafts, 1), 3),
        }


def accepted(drafts: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(drafts) and n < len(truth) and drafts[n] == truth[n]:
        n += 1
    return n


def study_prompt(
    target: TargetModel, bridge: DrafterBridge, cache: DraftKVCache, ids: list[int], answer: list[int], tally: Tally
) -> None:
    sequence = ids + answer
    target.reset(0, expect=len(sequence))
    features = target.forward_batch([(0, sequence, None)], bridge.taps)[0][1]
    cache.reset(0)
    tally.answer_positions += len(answer) - 1
    block = bridge.block_size
    position, synced, pending = len(ids), 0, None  # pending: the pre-draft of the step now drafted
    while position + 1 < len(sequence):
        cache.append(synced, features[synced:position])
        synced = position
        began = time.perf_counter()
        hidden, _ = cache.draft_rows(bridge.noise(sequence[position]), position, block - 1)
        tally.draft_s += time.perf_counter() - began
        tally.drafts += 1
        proposal = bridge.guesses(hidden, None, sequence[position])
        logprobs = proposal.logits.float().log_softmax(-1)
        chain = DraftTree.best_first(logprobs, block - 1, block - 1, 1, proposal.columns)
        drafts = chain.tokens
        truth = sequence[position + 1 : position + block]
        j = accepted(drafts, truth)
        tree = DraftTree.best_first(logprobs, TREE_NODES, block - 1, 8, proposal.columns)
        node = tree_outcome(tree, truth)
        if node is not None and depth_of(tree, node[0]) <= block - 3:
            ranked = likeliest_outcomes(proposal.logits, tree, max(ALTERNATIVES), block - 3, proposal.columns)
            for count in ALTERNATIVES:
                tally.tree_hits[count] += node in ranked[:count]
        if pending is not None:  # the previous step's outcome was predicted: both drafts for this step
            tally.paired += 1
            tally.fresh_on_hits += j
            tally.pre_on_hits += accepted(pending, truth)
        pending = None
        if j < len(drafts) and position + 1 + j < len(sequence):
            outcome = (j, sequence[position + 1 + j])
            ranked = likeliest_outcomes(proposal.logits, chain, max(ALTERNATIVES), block - 3, proposal.columns)
            for count in ALTERNATIVES:
                tally.hits[count] += outcome in ranked[:count]
            if outcome in ranked:
                pending = predraft(bridge, cache, sequence[position], drafts[:j], outcome[1], position)
        tally.outcomes[j] += 1
        tally.steps += 1
        position += j + 1


def tree_outcome(tree: DraftTree, truth: list[int]) -> tuple[int, int] | None:
    """How verifying `tree` against the target's tokens `truth` ends (the verify's own walk,
    `DraftTree.accept`): (deepest node accepted, the target's token after it); None where the
    answer ends first."""
    depths = [0, *tree.depths]
    path = tree.accept([truth[d] if d < len(truth) else -1 for d in depths])  # -1: no token, the walk stops
    node = path[-1] if path else 0
    return (node, truth[depths[node]]) if depths[node] < len(truth) else None


def depth_of(tree: DraftTree, node: int) -> int:
    return tree.depths[node - 1] if node else 0


def predraft(
    bridge: DrafterBridge, cache: DraftKVCache, last: int, kept: list[int], bonus: int, position: int
) -> list[int]:
    """The next step's drafts for outcome (len(kept), bonus), as the draft daemon pre-drafts them."""
    heads = bridge.target.embed([last, *kept, bonus])
    hidden, _ = draft_predrafts(cache, heads, [heads.shape[0]], bridge.mask_row).drafted[0]
    return bridge.project(hidden).argmax(-1).tolist()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.predraft_study",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--model", help="target folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", help="drafter folder (default: the shipped drafter)")
    parser.add_argument("--prompts", default=str(ROOT / "data" / "eval_prompts.jsonl"), help="held-out prompts (jsonl)")
    parser.add_argument("--limit", type=int, default=0, help="first N prompts (0: all)")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens per answer at most")
    parser.add_argument(
        "--dtype", default="auto", choices=TARGET_DTYPES, help="the target's dtype (auto: as the daemon picks)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own choice)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    target = TargetModel.load(model, dtype=args.dtype)
    if not target.exact:  # a target off the engine in fp16 or bf16: its drafts measured nothing (an audit)
        raise SystemExit(inexact(target))
    drafter = load_drafter(args.drafter or ensure_default_drafter(model), dtype=target.model.dtype)
    backend = LocalDraftBackend(drafter)
    bridge = DrafterBridge(target, backend.info)
    tally = Tally()
    for text in read_prompts(args.prompts)[: args.limit or None]:
        ids = target.encode_chat([{"role": "user", "content": text}])
        answer = generate(target, ids, NoProposer(), DecodeOptions(args.max_new_tokens)).tokens
        study_prompt(target, bridge, backend.cache, ids, answer, tally)
    figures = {"model": model.name, "dtype": str(target.model.dtype), **tally.report()}
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
