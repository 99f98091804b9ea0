"""Pieces every entry point shares: defaults, device and dtype flags, logging."""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from protocol import FLOAT_DTYPES
from protocol.tensors import torch_dtype
from target_node.model.default_model import ensure_default_model, model_folder

if TYPE_CHECKING:  # torch loads where a model runs, not in the HTTP front end that shares these flags
    import torch

DTYPE_CHOICES = ("auto", *FLOAT_DTYPES)  # a drafter's: its drafts are verified, any dtype will do
# A target's: float16 is on no engine, and off it a verify row was not the plain step's bits (an
# audit: 2 of 40 outputs differed, at exact fp16 ties, and the drafter's heads refused fp16).
TARGET_DTYPES = ("auto", "float32", "bfloat16")


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )


def add_model_args(parser: argparse.ArgumentParser, what: str, dtypes: tuple[str, ...] = DTYPE_CHOICES) -> None:
    """Device, dtype, threads and verbosity: what every daemon asks for."""
    parser.add_argument(
        "--device", type=device_name, default="cpu", help=f"torch device for the {what}, e.g. cpu, cuda:0, cuda:1"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=dtypes,
        help=f"{what} weights dtype (auto: bfloat16 where the device has native bf16 and, for a target, the "
        "engine serves it exactly; float32 elsewhere)",
    )
    parser.add_argument(
        "--threads", type=at_least(0), default=0, help="torch CPU threads (default %(default)s: torch's own choice)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def device_name(text: str) -> str:
    """A --device value torch knows and this machine has: refused by the parser, not by a traceback
    from deep inside the first load. "cpu" (every default) imports no torch: a front end's flags
    alone took 2.4 s and 220 MB to parse with it (a review)."""
    if text == "cpu":
        return text
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (e.g. cpu, cuda:0)") from None
    if device.type not in ("cpu", "cuda"):  # mps, xpu, meta...: each failed in a traceback deep in the load
        raise argparse.ArgumentTypeError(f"{text}: the daemons run on cpu or cuda[:N] devices")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text}: this machine's torch sees no CUDA device")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(
                f"{text}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}"
            )
    return text


def at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A parser type: a whole number of at least `minimum` (--threads: 0, torch's default, or more)
    and at most `maximum` where given."""

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value

    return whole_number


def layer_ids(text: str) -> list[int]:
    """A parser type: comma-separated layer ids, whole numbers of 0 or more ("" for none given)."""
    try:
        ids = [int(part) for part in text.split(",")] if text else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer ids such as 3,10,17, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"layer ids are 0 or more, got {text!r}")
    return ids


def number_in(low: float, high: float | None = None, above: bool = False) -> Callable[[str], float]:
    """A parser type: a finite number of at least `low` (more than `low` where `above`), at most
    `high` where given (--gamma 0 trained to NaN weights and saved them: an audit)."""

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (above and value == low) or (high is not None and value > high):
            bound = f"more than {low:g}" if above else f"at least {low:g}"
            raise argparse.ArgumentTypeError(
                f"must be {bound}{f' and at most {high:g}' if high is not None else ''}, got {text}"
            )
        return value

    return number


def apply_runtime_args(args: argparse.Namespace) -> None:
    setup_logging(args.verbose)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


def resolve_model(folder: str | Path | None) -> Path:
    """A local HF folder, or the default SmolLM2-135M-Instruct converted once into the cache. A
    folder that holds no model is refused here, before anything is loaded or started from it."""
    return model_folder(folder) if folder else ensure_default_model()


def named_dtype(name: str, device: str) -> torch.dtype:
    """The torch dtype a dtype flag's value names; "auto" as a drafter resolves it: bf16 where the
    device computes it natively (drafts need not be exact), else fp32. A target resolves "auto"
    itself (`TargetModel.load`), since it also depends on whether the engine serves the model."""
    if name != "auto":
        return torch_dtype(name)
    import torch

    from dflash_kernels import computes_bf16

    return torch.bfloat16 if computes_bf16(device) else torch.float32


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


def add_settings(parser: argparse.ArgumentParser, settings: type) -> None:
    """One flag per field of a settings dataclass (`--max-queued` for `max_queued`), with the
    field's default and help: the settings object is where a limit is written."""
    for f in fields(settings):
        flag, meta = "--" + f.name.replace("_", "-"), f.metadata
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=meta["help"])
            continue
        kind = byte_size if meta.get("unit") == "bytes" else {"int": int, "float": float}.get(str(f.type), str)
        parser.add_argument(flag, type=kind, default=f.default, help=meta["help"] + " (default %(default)s)")


def settings_from(args: argparse.Namespace, settings: type):
    """The settings object the flags `add_settings` made describe; a value it refuses raises
    ValueError naming the flag, as the user wrote it."""
    with flags_named({f.name: "--" + f.name.replace("_", "-") for f in fields(settings)}):
        return settings(**{f.name: getattr(args, f.name) for f in fields(settings)})


@contextmanager
def flags_named(flags: dict[str, str]) -> Iterator[None]:
    """A ValueError a settings object raises here names the flags the user wrote (`flags`: field
    name -> flag), not its fields."""
    try:
        yield
    except ValueError as exc:
        message = str(exc)
        for name in sorted(flags, key=len, reverse=True):  # max_queued_per_client before max_queued
            message = message.replace(name, flags[name])
        raise ValueError(message) from None
