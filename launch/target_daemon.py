"""Start the target daemon: load a causal LM on a device and serve generate requests.

Proposers: `remote` (a draft daemon at --drafter, falling back to n-gram lookup while it
is unreachable, before it first starts too), `local` (a drafter checkpoint in this
process), `ngram` (prompt lookup, no model) or `none` (plain greedy decoding).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from answers.traffic import TrafficError, record_folder
from launch.common import (
    TARGET_DTYPES,
    add_model_args,
    add_settings,
    apply_runtime_args,
    at_least,
    flags_named,
    resolve_model,
    settings_from,
)
from launch.net import (
    DRAFT_ADDRESS,
    TARGET_ADDRESS,
    HelpFormatter,
    add_server_security_args,
    address,
    client_security,
    one_line_errors,
    peer_address,
    reaches_itself,
    server_security,
)
from launch.processes import ctrl_c_exits_130, stop_on_signals
from protocol import FLOAT_DTYPES
from protocol.keys import ClientKeys, ServerKeys
from protocol.messages import MAX_PREDRAFT_OUTCOMES
from protocol.transport import try_bind
from target_node.drafting.settings import PROPOSER_KINDS, ProposerSettings
from target_node.model.default_model import ensure_default_drafter
from target_node.model.policies import DEFAULT_RECURRENT, RECURRENT_POLICIES
from target_node.serving.settings import ServiceSettings

# No torch, transformers or model code above: they load in `load_and_serve`, once every flag is
# checked, so --help and a refusal take a tenth of a second, not three.


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-target-daemon", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--model", help="local Hugging Face model folder (default: SmolLM2-135M-Instruct, converted once)"
    )
    parser.add_argument(
        "--bind", type=address, default=TARGET_ADDRESS, help="ZeroMQ address clients connect to (default %(default)s)"
    )
    add_proposer_args(parser)
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
        type=at_least(1),
        default=8,
        help="requests decoded at once, each in its own slot of the engine's cache, all in one forward per step "
        "(the transformers path, for models the engine does not serve, decodes one at a time)",
    )
    parser.add_argument(
        "--record",
        metavar="DIR",
        help="record each greedy request that ends done, its prompt and answer (token ids and chat messages), "
        "into DIR as drafter training data (`dflash-train --data DIR`). Off by default: these are your users' "
        "conversations, kept in plain form on disk; enable it only where storing them is allowed",
    )
    add_settings(parser, ServiceSettings)
    add_server_security_args(parser)
    add_model_args(parser, "target model", TARGET_DTYPES)
    return parser


PROPOSING = ProposerSettings()  # the flags' defaults


def add_proposer_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--proposer", default=PROPOSING.kind, choices=PROPOSER_KINDS, help="who drafts (see above)")
    parser.add_argument(
        "--drafter", type=peer_address, default=DRAFT_ADDRESS, help="draft daemon address for --proposer remote"
    )
    parser.add_argument("--drafter-checkpoint", help="drafter folder for --proposer local")
    parser.add_argument(
        "--fallback",
        default=PROPOSING.fallback,
        choices=["ngram", "none"],
        help="who drafts while the draft daemon is down",
    )
    parser.add_argument(
        "--draft-timeout",
        type=float,
        default=PROPOSING.draft_timeout_s,
        help="seconds to wait for a draft reply, counted from the request's send",
    )
    parser.add_argument(
        "--draft-retry",
        type=float,
        default=PROPOSING.draft_retry_s,
        help="seconds between probes of a dead draft daemon",
    )
    parser.add_argument("--wire-dtype", choices=FLOAT_DTYPES, help="feature dtype on the wire (default: negotiated)")
    parser.add_argument(
        "--ring-capacity",
        type=int,
        default=PROPOSING.ring_capacity,
        help="context positions a --proposer local drafter keeps",
    )
    parser.add_argument(
        "--drafter-key", help="the draft daemon's public key (NAME.key): CURVE on the drafter link, needs --curve-key"
    )
    parser.add_argument(
        "--predraft",
        type=int,
        default=PROPOSING.predraft,
        metavar="N",
        help="with a drafter (remote or local): as each chain verify starts, draft the next block for the N likeliest "
        f"outcomes (at most {MAX_PREDRAFT_OUTCOMES}) while the target verifies; a step whose outcome was named "
        "and drafted in the verify's time waits for no drafting (0: off; see docs/deployment.md for when it pays)",
    )


# ProposerSettings' fields by the flags that set them, for its errors to name what the user wrote.
PROPOSER_FLAGS = {
    "ring_capacity": "--ring-capacity",
    "draft_timeout_s": "--draft-timeout",
    "draft_retry_s": "--draft-retry",
    "predraft": "--predraft",
}


def proposer_settings(args: argparse.Namespace) -> ProposerSettings:
    """The command line's proposer flags as settings, checked before anything loads: a value the
    settings refuse raises ValueError naming the flag. A local drafter not named is the default
    one for the model, found once the model has loaded (`with_default_drafter`)."""
    with flags_named(PROPOSER_FLAGS):
        return ProposerSettings(
            args.proposer,
            args.drafter,
            Path(args.drafter_checkpoint) if args.drafter_checkpoint else None,
            args.fallback,
            args.draft_timeout,
            args.draft_retry,
            args.wire_dtype,
            args.ring_capacity,
            args.predraft,
        )


def with_default_drafter(settings: ProposerSettings, model: Path) -> ProposerSettings:
    """A local proposer without a checkpoint drafts with the model's default drafter (the shipped
    one for the default model)."""
    if settings.kind != "local" or settings.checkpoint is not None:
        return settings
    return replace(settings, checkpoint=ensure_default_drafter(model))


@dataclass(frozen=True)
class DaemonCommand:
    """The command line with every check passed (`checked_command`): what `main` starts from."""

    parser: argparse.ArgumentParser
    args: argparse.Namespace
    settings: ServiceSettings
    drafting: ProposerSettings
    curve: ServerKeys | None
    drafter_keys: ClientKeys | None


def checked_command(argv: list[str] | None = None) -> DaemonCommand:
    """The flags parsed and checked, each refusal one line and exit 2, before anything is set,
    bound or loaded (a refusal costs a user no model load; the tests ask it in their own process)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    curve = server_security(parser, args, key_serves_links_out=bool(args.drafter_key))
    drafter_keys = client_security(parser, args.curve_key, args.drafter_key, "--drafter-key", key_serves_a_socket=True)
    settings, drafting = checked_flags(parser, args)
    return DaemonCommand(parser, args, settings, drafting, curve, drafter_keys)


@ctrl_c_exits_130
def main(argv: list[str] | None = None) -> None:
    command = checked_command(argv)
    parser, args = command.parser, command.args
    apply_runtime_args(args)
    with one_line_errors(parser.prog, TrafficError):
        # Before the model loads (minutes, on a GPU): an address this host cannot bind, a folder it
        # cannot write, a folder that holds no model.
        try_bind(args.bind, command.curve, args.insecure_plaintext)
        if args.record:
            record_folder(args.record)
        model = resolve_model(args.model)
    load_and_serve(command, model)


def load_and_serve(command: DaemonCommand, model: Path) -> None:
    """Load the target and its proposers, then serve until a signal; a model, drafter or cache
    this daemon cannot serve is one line and exit 1."""
    from answers.index import datastore_coming
    from answers.traffic import TrafficRecorder
    from draft_node.config import CheckpointError
    from target_node.drafting.bridge import DrafterMismatch
    from target_node.drafting.factory import build_proposers
    from target_node.model.cache_policy import UnsupportedCache
    from target_node.model.support import ModelLoadError, UnsupportedModel
    from target_node.model.target import TargetModel, inexact
    from target_node.serving.daemon import TargetService

    parser, args, settings = command.parser, command.args, command.settings
    refusals = (DrafterMismatch, CheckpointError, UnsupportedModel, UnsupportedCache, ModelLoadError, TrafficError)
    with one_line_errors(parser.prog, *refusals):
        with memory_for(parser, args.max_batch):  # the cache is laid out at load, filled at the first forward
            target = TargetModel.load(model, args.device, args.dtype, args.cache_policy, slots=args.max_batch)
            if not target.exact:
                parser.exit(1, f"{parser.prog}: error: {inexact(target)}\n")
            recorder = TrafficRecorder(args.record, target.name, target.numerics) if args.record else None
            drafting = with_default_drafter(command.drafting, model)
            proposers = build_proposers(drafting, target, target.slots, command.drafter_keys)
            looks_up = settings.looks_up(proposers[0])
            datastore = datastore_coming(
                settings.datastore if looks_up else "none", target.name, vocab_size=target.vocab_size
            )
            service = TargetService(target, proposers, settings, recorder, datastore)
        # Only now: a SIGTERM while the model loads ends the process at once (it waited for the load).
        stop = stop_on_signals()
        service.serve(args.bind, stop, command.curve, args.insecure_plaintext)


def checked_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[ServiceSettings, ProposerSettings]:
    """The flags as settings, each refusal one line before anything loads: a value the settings
    refuse, a bf16 the device cannot serve exactly, a flag the chosen proposer would ignore."""
    if args.dtype == "bfloat16":
        from target_node.engine.engine import declines  # torch: only where bf16 is asked for

        if why := declines(args.device):  # see TargetModel.exact
            parser.error(
                f"--dtype bfloat16 on {args.device}: {why}, and off it only float32 is exact (float32 or auto)"
            )
    if args.proposer == "remote" and reaches_itself(args.bind, args.drafter):
        parser.error(f"--drafter {args.drafter} is this daemon's own --bind: the draft daemon listens elsewhere")
    unused = ignored_flags(parser, args)
    if unused:
        why = "--no-lookup" if unused == ["--datastore"] and args.proposer != "none" else f"--proposer {args.proposer}"
        parser.error(f"{', '.join(unused)}: not used with {why}")
    try:
        return settings_from(args, ServiceSettings), proposer_settings(args)
    except ValueError as exc:
        parser.error(str(exc))


# Flags that mean something only to these proposers: given to another, each went unused without a
# word (--drafter-checkpoint without --proposer local drafted remotely, from the default address: an audit).
FLAG_PROPOSERS = {
    "drafter": ("remote",),
    "fallback": ("remote",),
    "draft_timeout": ("remote",),
    "draft_retry": ("remote",),
    "wire_dtype": ("remote",),
    "drafter_key": ("remote",),
    "drafter_checkpoint": ("local",),
    "ring_capacity": ("local",),
    "predraft": ("remote", "local"),
    "tree_nodes": ("remote", "local", "ngram"),
    "always_draft": ("remote", "local", "ngram"),
    "no_lookup": ("remote", "local", "ngram"),
    "datastore": ("remote", "local", "ngram"),
}


def ignored_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The flags given (not at their defaults) that the chosen proposer would ignore."""
    unused = [
        name
        for name, kinds in FLAG_PROPOSERS.items()
        if args.proposer not in kinds and getattr(args, name) != parser.get_default(name)
    ]
    if args.no_lookup and args.datastore != parser.get_default("datastore") and "datastore" not in unused:
        unused.append("datastore")
    return ["--" + name.replace("_", "-") for name in unused]


@contextmanager
def memory_for(parser: argparse.ArgumentParser, max_batch: int) -> Iterator[None]:
    """A machine without the memory for --max-batch slots says so in one line: torch's allocators
    raise a RuntimeError, at the load or (the cache being filled at the first forward) as the daemon
    measures its steps (--max-batch 100000 ended in a traceback there: an audit)."""
    try:
        yield
    except RuntimeError as exc:
        if "alloc" not in str(exc).lower() and "out of memory" not in str(exc).lower():
            raise
        parser.exit(1, f"{parser.prog}: error: no memory for --max-batch {max_batch}: {exc}\n")


if __name__ == "__main__":
    main()
