"""One setting of the target's side, two ways: every mode of `benchmarks.evaluate`, prompt by prompt in
turns, in one process, so load drifts over both alike.

    python -m benchmarks.bench_ab --compare head --threads 1 --dtype bfloat16        # screened head vs whole

- `head`: greedy steps through the int8 screen (the widths this machine measured it faster for) against
  the whole head every step. Where the CPU has no AVX512-VNNI the two are the same code.
- `screen-path`: the int8 screen's sums on AMX's int8 tiles against VNNI, each path serving the widths
  this machine measured it faster than the whole head for (a CPU without AMX: nothing to compare).
- `chances`: the datastore's vote shares as often as such shares came out right lately
  (`Governor.chance_reach`) against the shares as given.
- `lookup-kinds`: the context's continuations priced by how far back their match reached (1, 2 or 3
  tokens: `PromptLookup.by_length`) against all of them as one.

A setting is a class whose `apply(side)` is called before each side's runs are prepared and before
each of its prompts. Each side has its own runs (governors, their verify costs
measured with its own setting, its own datastore); both must give the plain greedy output token for
token: every mode its own side's plain output, and the two sides' plain outputs each other's (a
setting that changes the head changes a side's plain output too, which its own check cannot see).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.evaluate import Runs, mode_table, parse_args, prepare_runs, run_prompt
from launch.common import resolve_model
from launch.net import HelpFormatter
from target_node.model.default_model import SHIPPED_DRAFTER


class Head:
    """The int8-screened greedy head (side "new") against the whole head ("old")."""

    def __init__(self, target) -> None:
        self.engine = target.engine
        self.rows = {"new": self.engine.screen_rows if self.engine else 0, "old": 0}

    def apply(self, side: str) -> None:
        if self.engine is not None:
            self.engine.screen_rows = self.rows[side]


class ScreenPath:
    """The screen on AMX's int8 tiles (side "new") against VNNI ("old"), each at its own measured widths."""

    def __init__(self, target) -> None:
        self.engine = target.engine
        if self.engine is None or "amx" not in self.engine.screen_rows_by_path:
            raise SystemExit("screen-path: this CPU has no AMX int8 tiles (or no screen): nothing to compare")
        self.paths = {"new": "amx", "old": "vnni"}

    def apply(self, side: str) -> None:
        path = self.paths[side]
        self.engine.screen_path, self.engine.screen_rows = path, self.engine.screen_rows_by_path[path]


class Chances:
    """Looked-up chances calibrated by the governor (side "new") against as given ("old")."""

    def __init__(self, target) -> None:
        from target_node.decoding.governor import Governor

        self.governor, self.calibrated = Governor, Governor.chance_reach

    def apply(self, side: str) -> None:
        self.governor.chance_reach = self.calibrated if side == "new" else _as_given


def _as_given(governor, chances: list[float], source: str, kind: str = "") -> list[float]:
    out, path = [], 1.0
    for chance in chances:
        path *= chance
        out.append(path)
    return out


class LookupKinds:
    """The context's continuations priced by the length of the tail they matched (side "new") against
    all as one ("old")."""

    def __init__(self, target) -> None:
        from target_node.drafting.proposers import PromptLookup

        self.lookup = PromptLookup

    def apply(self, side: str) -> None:
        self.lookup.by_length = side == "new"


SETTINGS = {"head": Head, "screen-path": ScreenPath, "chances": Chances, "lookup-kinds": LookupKinds}


def bench(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_ab",
        description=__doc__,
        formatter_class=HelpFormatter,
        epilog="Every other flag is `python -m benchmarks.evaluate`'s (--threads, --dtype, --limit, --prompts, ...),\n"
        "with --drafter the shipped drafter, --modes adaptive and --max-new-tokens 96 unless given.",
    )
    ap.add_argument("--compare", choices=sorted(SETTINGS), required=True, help="the setting compared (above)")
    ap.add_argument("--out", default="", help="where to write the JSON (default: print only)")
    own, rest = ap.parse_known_args(argv)
    args = parse_args(["--drafter", str(SHIPPED_DRAFTER), "--modes", "adaptive", "--max-new-tokens", "96", *rest])
    from target_node.model.target import TargetModel
    from training.prompts import read_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    target = TargetModel.load(resolve_model(args.model), device=args.device, dtype=args.dtype)
    setting = SETTINGS[own.compare](target)
    runs = {}
    for side in ("new", "old"):
        setting.apply(side)
        runs[side] = prepare_runs(args, target)
    prompts = read_prompts(args.prompts)[: args.limit or None]
    for i, text in enumerate(prompts):
        for side in list(runs)[:: 1 if i % 2 == 0 else -1]:
            setting.apply(side)
            run_prompt(runs[side], text)
    setting.apply("new")
    tables = {side: mode_table(side_runs) for side, side_runs in runs.items()}
    result = {
        "compare": own.compare,
        "dtype": str(target.head.weight.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "prompts": len(prompts),
        "modes": tables,
        "new_vs_old": {
            mode: round(tables["new"][mode]["tok_s"] / tables["old"][mode]["tok_s"], 3)
            for mode in tables["old"]
            if tables["old"][mode]["tok_s"]
        },
        "sides_differing": sides_differing(runs["new"], runs["old"]),
    }
    result["mismatches"] = sum(t[m]["mismatches"] for t in tables.values() for m in t) + result["sides_differing"]
    if own.out:
        Path(own.out).write_text(json.dumps(result, indent=1))
    return result


def sides_differing(new: Runs, old: Runs) -> int:
    """Prompts whose plain output the two settings gave differently."""
    return sum(a != b for a, b in zip(new.plain_outputs, old.plain_outputs, strict=True))


def main(argv: list[str] | None = None) -> int:
    result = bench(argv)
    print(f"{result['compare']}: {result['dtype']}, {result['threads']} threads, {result['prompts']} prompts")
    for mode, ratio in result["new_vs_old"].items():
        old, new = result["modes"]["old"][mode], result["modes"]["new"][mode]
        print(
            f"{mode:>12}: old {old['tok_s']:7.2f} tok/s (tau {old['tau']:.3f}) -> new {new['tok_s']:7.2f} "
            f"(tau {new['tau']:.3f}): {ratio:.3f}x"
        )
    differing = result["sides_differing"]
    print(f"outputs differing from plain: {result['mismatches']} ({differing} between the sides' plain)")
    return 0 if result["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
