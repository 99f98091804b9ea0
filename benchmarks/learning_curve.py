"""The drafter's learning curve: held-out tau against answer tokens trained on.

    python -m benchmarks.learning_curve                       # print the table from docs/results/learning_curve.json
    python -m benchmarks.learning_curve --png docs/results/learning_curve.png   # and draw it (needs matplotlib)

Each point is one drafter measured by `benchmarks.evaluate` (chain, drafting every step, at
temperature 0, on `data/eval_prompts.jsonl`); points are added by hand to the JSON file with
the data they were trained on, because a drafter's training history lives in no checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from launch.net import HelpFormatter

DEFAULT_POINTS = Path(__file__).resolve().parent.parent / "docs" / "results" / "learning_curve.json"


def table(points: list[dict]) -> str:
    lines = [
        "| drafter | answer tokens trained on | of them varied | training steps | held-out tau (chain) |",
        "|---|---|---|---|---|",
    ]
    for p in points:
        millions = f"{p['tokens'] / 1e6:.2f}M", f"{p['varied_tokens'] / 1e6:.2f}M"
        cells = [p["name"], *millions, p["steps"], f"{p['tau']:.2f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def draw(points: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Points, not a line: each comes from its own run and prompt subset (see `measured`).
    fig, ax = plt.subplots(figsize=(7, 5), dpi=120)
    for i, p in enumerate(points, 1):
        x = p["tokens"] / 1e6
        ax.scatter([x], [p["tau"]], label=f"{i}. {p['name']}")
        ax.annotate(str(i), (x, p["tau"]), textcoords="offset points", xytext=(5, 3), fontsize=8)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=7, frameon=False)
    ax.set_xlabel("answer tokens trained on (millions)")
    ax.set_ylabel("held-out tau (chain, T=0)")
    ax.set_title("SmolLM2 drafter on data/eval_prompts.jsonl")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.learning_curve",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--points", type=Path, default=DEFAULT_POINTS, help="JSON list of measured drafters")
    ap.add_argument("--png", type=Path, help="also draw the curve here")
    args = ap.parse_args(argv)
    points = sorted(json.loads(args.points.read_text()), key=lambda p: p["tokens"])
    print(table(points))
    if args.png:
        draw(points, args.png)


if __name__ == "__main__":
    main()
