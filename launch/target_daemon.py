"""Start the target daemon: load a causal LM on a device and serve generate requests.

Proposers: `remote` (a draft daemon at --drafter, falling back to n-gram lookup while it
is unreachable, before it first starts too), `local` (a drafter checkpoint in this
process), `ngram` (prompt lookup, no model) or `none` (plain greedy decoding).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from launch.common import (
    DRAFT_ADDRESS,
    TARGET_ADDRESS,
    add_model_args,
    add_settings,
    apply_runtime_args,
    resolve_model,
    settings_from,
)
from launch.net import add_server_security_args, client_security, one_line_errors, server_security
from protocol import FLOAT_DTYPES, Message
from protocol.keys import ClientKeys
from protocol.transport import stop_on_signals
from target_node.decoding.sequence import Result
from target_node.drafting.bridge import DrafterMismatch
from target_node.drafting.proposers import (
    DFlashProposer,
    DraftPass,
    LocalDraftBackend,
    NGramProposer,
    NoProposer,
    Proposer,
)
from target_node.model.cache_policy import DEFAULT_RECURRENT, RECURRENT_POLICIES
from target_node.model.target import TargetModel
from target_node.serving.daemon import TargetService
from target_node.serving.settings import ServiceSettings


def build_proposers(
    args: argparse.Namespace, target: TargetModel, count: int, drafter_keys: ClientKeys | None = None
) -> list[Proposer]:
    """One proposer per slot (each request drafts from its own state); a local drafter's weights
    are loaded once and shared, a remote one gets a session per slot."""
    if args.proposer == "none":
        return [NoProposer() for _ in range(count)]
    if args.proposer == "ngram":
        return [NGramProposer() for _ in range(count)]
    if args.proposer == "local":
        from draft_node.checkpoint import load_drafter
        from launch.common import ensure_default_drafter

        checkpoint = args.drafter_checkpoint or ensure_default_drafter(resolve_model(args.model))
        drafter = load_drafter(checkpoint, args.device, target.model.dtype)
        together = DraftPass(drafter)  # the slots' drafts of one step in one pass
        return [
            DFlashProposer(LocalDraftBackend(drafter, args.ring_capacity, together), NGramProposer())
            for _ in range(count)
        ]
    from target_node.drafting.remote import Reachability, RemoteDraftBackend

    reach = Reachability()  # one daemon behind every slot's session: one probe when it is away

    def remote() -> Proposer:
        backend = RemoteDraftBackend(
            args.drafter,
            target,
            timeout_s=args.draft_timeout,
            retry_s=args.draft_retry,
            wire_dtype=args.wire_dtype,
            curve=drafter_keys,
            reach=reach,
        )
        return DFlashProposer(backend, NGramProposer() if args.fallback == "ngram" else NoProposer())

    return [remote() for _ in range(count)]


def traffic_recorder(folder: str, model_name: str):
    """Record every served request (prompt and answer token ids, and the chat messages) as drafter
    training data in the answer-store format, so `launch.train --data FOLDER` can learn from it."""
    import hashlib
    import json

    from training.answer_store import Answer, AnswerStore

    store = AnswerStore(Path(folder), shard_records=256)  # small shards: each answer is written out at once

    def record(msg: Message, prompt: list[int], result: Result) -> None:
        messages = [[m["role"], m["content"]] for m in msg["messages"]]
        if not messages and msg["prompt"]:
            messages = [["user", msg["prompt"]]]
        tokens = prompt + result.tokens
        key = hashlib.sha1(json.dumps([messages, tokens]).encode()).hexdigest()[:20]
        finish = result.finish_reason
        store.add(Answer(key, f"traffic-{key}", "traffic", messages, tokens, len(prompt), finish, "", model_name))
        store.flush()

    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="dflash-target-daemon", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", help="local Hugging Face model folder (default: SmolLM2-135M-Instruct, converted once)"
    )
    parser.add_argument(
        "--bind", default=TARGET_ADDRESS, help="ZeroMQ address clients connect to (default %(default)s)"
    )
    parser.add_argument(
        "--proposer", default="remote", choices=["remote", "local", "ngram", "none"], help="who drafts (see above)"
    )
    parser.add_argument("--drafter", default=DRAFT_ADDRESS, help="draft daemon address for --proposer remote")
    parser.add_argument("--drafter-checkpoint", help="drafter folder for --proposer local")
    parser.add_argument(
        "--fallback", default="ngram", choices=["ngram", "none"], help="who drafts while the draft daemon is down"
    )
    parser.add_argument("--draft-timeout", type=float, default=2.0, help="seconds to wait for a draft reply")
    parser.add_argument("--draft-retry", type=float, default=5.0, help="seconds between probes of a dead draft daemon")
    parser.add_argument(
        "--wire-dtype",
        choices=FLOAT_DTYPES,
        help="feature dtype on the wire (default: negotiated)",
    )
    parser.add_argument(
        "--ring-capacity", type=int, default=4096, help="context positions a --proposer local drafter keeps"
    )
    parser.add_argument(
        "--cache-policy",
        default=DEFAULT_RECURRENT,
        choices=RECURRENT_POLICIES,
        help="how linear-attention and state-space layers roll back a verify: replay the accepted tokens "
        "from the state before it, or capture the state at every verified position (default %(default)s; "
        "see target_node/model/recurrent.py)",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="requests decoded at once, each in its own slot of the engine's cache, all in one forward per step "
        "(the transformers path, for models the engine does not serve, decodes one at a time)",
    )
    parser.add_argument(
        "--record",
        metavar="DIR",
        help="record every served request's prompt and answer (token ids and chat messages) into DIR as drafter "
        "training data (`dflash-train --data DIR`). Off by default: these are your users' conversations, "
        "kept in plain form on disk; enable it only where storing them is allowed",
    )
    parser.add_argument(
        "--drafter-key", help="the draft daemon's public key (NAME.key): CURVE on the drafter link, needs --curve-key"
    )
    add_settings(parser, ServiceSettings)
    add_server_security_args(parser)
    add_model_args(parser, "target model")
    args = parser.parse_args(argv)
    curve = server_security(parser, args, key_serves_links_out=True)
    drafter_keys = client_security(parser, args.curve_key, args.drafter_key, "--drafter-key")
    apply_runtime_args(args)
    stop = stop_on_signals()
    if args.max_batch < 1:
        parser.error("--max-batch must be at least 1")
    try:
        settings = settings_from(args, ServiceSettings)
    except ValueError as exc:
        parser.error(str(exc))
    with one_line_errors(parser, DrafterMismatch):
        target = TargetModel.load(
            resolve_model(args.model), args.device, args.dtype, args.cache_policy, slots=args.max_batch
        )
        recorder = traffic_recorder(args.record, Path(str(target.config.name_or_path)).name) if args.record else None
        proposers = build_proposers(args, target, target.slots, drafter_keys)
        service = TargetService(target, proposers, settings, on_finished=recorder)
        service.serve(args.bind, stop, curve, args.insecure_plaintext)


if __name__ == "__main__":
    main()
