"""Start the draft daemon: load a DFlash or DFlash2 checkpoint on a device and serve target sessions."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from draft_node.config import CheckpointError, load_config
from draft_node.settings import DraftSettings
from launch.common import add_model_args, add_settings, apply_runtime_args, named_dtype, settings_from
from launch.net import DRAFT_ADDRESS, HelpFormatter, add_server_security_args, address, one_line_errors, server_security
from launch.processes import ctrl_c_exits_130, stop_on_signals
from protocol.keys import ServerKeys
from protocol.transport import try_bind
from target_node.model.default_model import ensure_default_drafter

# No torch or drafter code above: they load in `main` once every flag is checked, so --help and a
# refusal take a tenth of a second, not two.


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-draft-daemon", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--checkpoint",
        help="drafter folder (config.json + model.safetensors) in the public DFlash or DFlash2 layout; default: the "
        "default model's drafter",
    )
    parser.add_argument(
        "--bind",
        type=address,
        default=DRAFT_ADDRESS,
        help="ZeroMQ address to bind, e.g. tcp://0.0.0.0:5555 (default %(default)s)",
    )
    add_settings(parser, DraftSettings)
    add_server_security_args(parser)
    add_model_args(parser, "drafter")
    return parser


@dataclass(frozen=True)
class DaemonCommand:
    """The command line with every check passed (`checked_command`): what `main` starts from."""

    parser: argparse.ArgumentParser
    args: argparse.Namespace
    settings: DraftSettings
    curve: ServerKeys | None


def checked_command(argv: list[str] | None = None) -> DaemonCommand:
    """The flags parsed and checked, each refusal one line and exit 2, before anything is set,
    bound or loaded (the tests ask it in their own process)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    curve = server_security(parser, args)
    if args.device.startswith("cpu") and args.dtype == "float16":  # the CPU kernels' linears take fp32 or bf16
        parser.error("--dtype float16 on a CPU: the drafter's CPU kernels take float32 or bfloat16")
    try:
        settings = settings_from(args, DraftSettings)
    except ValueError as exc:
        parser.error(str(exc))
    return DaemonCommand(parser, args, settings, curve)


@ctrl_c_exits_130
def main(argv: list[str] | None = None) -> None:
    command = checked_command(argv)
    parser, args, curve = command.parser, command.args, command.curve
    apply_runtime_args(args)
    with one_line_errors(parser.prog, CheckpointError):
        try_bind(args.bind, curve, args.insecure_plaintext)  # before the drafter loads
        if args.checkpoint:  # a folder that is no checkpoint: refused before torch loads too
            load_config(args.checkpoint)
        from draft_node.checkpoint import load_drafter
        from draft_node.daemon import DraftService, serve

        dtype = named_dtype(args.dtype, args.device)
        drafter = load_drafter(args.checkpoint or ensure_default_drafter(), args.device, dtype)
        service = DraftService(drafter, command.settings)
        logging.getLogger("draft_daemon").info(
            "drafter: %d layers, block %d, taps %s on %s/%s",
            drafter.config.num_hidden_layers,
            drafter.config.block_size,
            list(drafter.config.target_layer_ids),
            args.device,
            str(dtype).removeprefix("torch."),
        )
        stop = stop_on_signals()  # only now: a SIGTERM while the drafter loads ends the process at once
        serve(service, args.bind, stop, curve, args.insecure_plaintext)


if __name__ == "__main__":
    main()
