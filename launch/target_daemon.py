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
    apply_runtime_args,
    resolve_model,
)
from launch.net import add_server_security_args, client_security, one_line_errors, server_security
from protocol import FLOAT_DTYPES, Message
from protocol.keys import ClientKeys
from protocol.messages import MAX_REPLY_TOKENS
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
from target_node.serving.prefix_cache import PrefixCache, default_budget_mb


def byte_size(text: str) -> int:
    """'268435456', '256M', '1G' -> bytes (K, M, G are powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    scale = units.get(text[-1:].upper(), 1)
    try:
        value = int(text[:-1] if scale > 1 else text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes such as 268435456 or 256M, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value * scale


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
        "--max-new-tokens-limit",
        type=int,
        default=4096,
        help=f"largest max_new_tokens accepted (at most {MAX_REPLY_TOKENS}, what one reply carries)",
    )
    parser.add_argument("--max-queued", type=int, default=1024, help="requests queued over all clients (then: busy)")
    parser.add_argument("--max-queued-per-client", type=int, default=64, help="requests one client may queue")
    parser.add_argument(
        "--max-queued-bytes",
        type=byte_size,
        default="256M",
        help="memory queued requests may hold, over all clients (then: busy); a number of bytes, or with K, M or G",
    )
    parser.add_argument(
        "--record",
        metavar="DIR",
        help="record every served request's prompt and answer (token ids and chat messages) into DIR as drafter "
        "training data (`dflash-train --data DIR`). Off by default: these are your users' conversations, "
        "kept in plain form on disk; enable it only where storing them is allowed",
    )
    parser.add_argument(
        "--tree-nodes",
        type=int,
        default=16,
        help="verify greedy drafts as a tree of up to this many nodes (0: one chain of guesses); the "
        "governor picks how many pay, from verify costs it measures at start",
    )
    parser.add_argument(
        "--always-draft",
        action="store_true",
        help="draft every step, even while measured speculation is slower than plain decoding",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        help="the most prompt tokens in one forward; between chunks the daemon serves its socket and the "
        "other requests step (0: no cap)",
    )
    parser.add_argument(
        "--prefill-budget-ms",
        type=float,
        default=150.0,
        help="size prompt chunks so a forward that carries one takes about this long, from prefill rates "
        "measured as it runs: other requests' tokens and first tokens wait at most about this (0: fixed "
        "chunks of --prefill-chunk). A prompt alone, with no other request running or queued, takes "
        "--prefill-chunk tokens a forward: it pauses no one",
    )
    parser.add_argument(
        "--max-silence",
        type=float,
        default=600.0,
        help="seconds a client that promised no heartbeats (heartbeat_s 0) may send nothing while its requests "
        "run or wait; then they are cancelled, as for a client gone (0: wait forever). Clients that heartbeat "
        "(dflash-client, dflash-serve) are dropped after 3 missed beats instead",
    )
    parser.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=default_budget_mb(),
        help="MB of committed KV and feature rows kept by token prefix for later prompts that start with them "
        "(a chat's next turn, a shared system prompt); least recently used out first (0: off; default: a tenth "
        "of this machine's memory, at most 4 GiB). The engine's targets only",
    )
    parser.add_argument(
        "--max-messages-per-step",
        type=int,
        default=64,
        help="messages taken in between two decode steps (bounds what a flood from one peer costs the others)",
    )
    parser.add_argument(
        "--drafter-key", help="the draft daemon's public key (NAME.key): CURVE on the drafter link, needs --curve-key"
    )
    add_server_security_args(parser)
    add_model_args(parser, "target model")
    args = parser.parse_args(argv)
    curve = server_security(parser, args, key_serves_links_out=True)
    drafter_keys = client_security(parser, args.curve_key, args.drafter_key, "--drafter-key")
    apply_runtime_args(args)
    stop = stop_on_signals()
    if args.max_batch < 1:
        parser.error("--max-batch must be at least 1")
    if args.prefix_cache_mb < 0:
        parser.error("--prefix-cache-mb must be 0 (off) or a number of MB")
    if args.max_silence < 0:
        parser.error("--max-silence must be 0 (wait forever) or a number of seconds")
    if not 1 <= args.max_new_tokens_limit <= MAX_REPLY_TOKENS:
        parser.error(f"--max-new-tokens-limit must be in [1, {MAX_REPLY_TOKENS}]: one reply carries at most that many")
    with one_line_errors(parser, DrafterMismatch):
        target = TargetModel.load(
            resolve_model(args.model), args.device, args.dtype, args.cache_policy, slots=args.max_batch
        )
        service = TargetService(
            target,
            build_proposers(args, target, target.slots, drafter_keys),
            args.max_new_tokens_limit,
            adaptive=not args.always_draft,
            max_queued=args.max_queued,
            max_queued_per_client=args.max_queued_per_client,
            max_queued_bytes=args.max_queued_bytes,
            tree_nodes=args.tree_nodes,
            on_finished=traffic_recorder(args.record, Path(str(target.config.name_or_path)).name)
            if args.record
            else None,
            prefill_chunk=args.prefill_chunk,
            prefill_budget_s=args.prefill_budget_ms / 1000,
            max_messages_per_step=args.max_messages_per_step,
            max_silence_s=args.max_silence,
            prefix_cache=PrefixCache(args.prefix_cache_mb << 20)
            if args.prefix_cache_mb and target.engine is not None
            else None,
        )
        service.serve(args.bind, stop, curve, args.insecure_plaintext)


if __name__ == "__main__":
    main()
