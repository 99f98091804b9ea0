"""Start the draft daemon: load a DFlash or DFlash2 checkpoint on a device and serve target sessions."""

from __future__ import annotations

import argparse
import logging

from draft_node.checkpoint import load_drafter
from draft_node.config import CheckpointError
from draft_node.daemon import KEEP_BYTES, MAX_PASS_ROWS, DraftService, serve
from launch.common import (
    DRAFT_ADDRESS,
    add_model_args,
    apply_runtime_args,
    dtype_of,
    ensure_default_drafter,
)
from launch.net import add_server_security_args, one_line_errors, server_security
from protocol.messages import KEEPALIVE_S
from protocol.transport import stop_on_signals


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dflash-draft-daemon", description=__doc__)
    parser.add_argument(
        "--checkpoint",
        help="drafter folder (config.json + model.safetensors) in the public DFlash or DFlash2 layout; default: the "
        "default model's drafter",
    )
    parser.add_argument(
        "--bind", default=DRAFT_ADDRESS, help="ZeroMQ address to bind, e.g. tcp://0.0.0.0:5555 (default %(default)s)"
    )
    parser.add_argument("--ring-capacity", type=int, default=4096, help="context positions kept per session")
    parser.add_argument("--max-sessions", type=int, default=64, help="sessions held at once, over all targets")
    parser.add_argument(
        "--max-sessions-per-peer",
        type=int,
        default=32,
        help="sessions one target (one CURVE key, or one connection without CURVE) may hold; a target "
        "needs one per request it runs at once (its --max-batch)",
    )
    parser.add_argument("--idle-timeout", type=float, default=600.0, help="seconds before an idle session is evicted")
    parser.add_argument(
        "--reclaim-after",
        type=float,
        default=30.0,
        help="when all sessions are taken, a session idle this many seconds may be evicted if its target holds "
        "more than its fair share and has said nothing for as long (live targets ping every "
        f"{KEEPALIVE_S:g} s, so keep this well above that)",
    )
    parser.add_argument(
        "--max-pass-rows",
        type=int,
        default=MAX_PASS_ROWS,
        help="feature rows one drafting pass takes at most: proposes that arrive together are drafted in one "
        "pass up to this, so a burst of whole-ring resends costs what drafting them one by one does",
    )
    parser.add_argument(
        "--keep-mb",
        type=int,
        default=KEEP_BYTES >> 20,
        help="MB of prefixes' context keys and values kept for targets' prefix caches (`keep`), over all peers, "
        "least recently used out first: a target's later request with that prefix sends none of its feature rows "
        "(0: off)",
    )
    add_server_security_args(parser)
    add_model_args(parser, "drafter")
    args = parser.parse_args(argv)
    curve = server_security(parser, args)
    apply_runtime_args(args)
    stop = stop_on_signals()
    dtype = dtype_of(args)
    with one_line_errors(parser, CheckpointError):
        drafter = load_drafter(args.checkpoint or ensure_default_drafter(), args.device, dtype)
        service = DraftService(
            drafter,
            args.ring_capacity,
            args.max_sessions,
            args.idle_timeout,
            args.reclaim_after,
            max_sessions_per_peer=args.max_sessions_per_peer,
            max_pass_rows=args.max_pass_rows,
            keep_bytes=args.keep_mb << 20,
        )
        logging.getLogger("draft_daemon").info(
            "drafter: %d layers, block %d, taps %s on %s/%s",
            drafter.config.num_hidden_layers,
            drafter.config.block_size,
            list(drafter.config.target_layer_ids),
            args.device,
            str(dtype).removeprefix("torch."),
        )
        serve(service, args.bind, stop, curve, args.insecure_plaintext)


if __name__ == "__main__":
    main()
