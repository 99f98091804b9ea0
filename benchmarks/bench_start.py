"""What a target daemon's start costs before it serves: the model's load, and the service over it,
which measures the verify costs its governor decides with (docs/serving.md). Two trees compare by
running this file with each on PYTHONPATH, in turns (the file's own code reads only the public
constructors, which both keep).

    python -m benchmarks.bench_start --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from launch.common import resolve_model
from target_node.drafting.proposers import NGramProposer
from target_node.model.target import TargetModel
from target_node.serving.daemon import TargetService
from target_node.serving.settings import ServiceSettings


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_start", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--model", help="local HF folder (default: SmolLM2-135M-Instruct, converted once)")
    ap.add_argument("--dtype", default="auto", help="as the target daemon's --dtype (default %(default)s)")
    ap.add_argument("--slots", type=int, default=8, help="as the target daemon's --max-batch (default %(default)s)")
    ap.add_argument("--tree-nodes", type=int, default=16, help="as the target daemon's (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="starts timed; medians reported (default %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, loads, services, widths = resolve_model(args.model), [], [], 0
    for _ in range(args.repeats):
        began = time.perf_counter()
        target = TargetModel.load(model, "cpu", args.dtype, slots=args.slots)
        loaded = time.perf_counter()
        proposers = [NGramProposer() for _ in range(args.slots)]  # any proposer but none: the governor decides
        service = TargetService(target, proposers, ServiceSettings(tree_nodes=args.tree_nodes))
        loads.append(loaded - began)
        services.append(time.perf_counter() - loaded)
        widths = len(service.governor.costs.seconds)
    result = {
        "load_s": round(statistics.median(loads), 3),
        "service_s": round(statistics.median(services), 3),
        "widths_measured": widths,
        "slots": args.slots,
        "threads": args.threads,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
