"""All in one: start the draft daemon and the target daemon as separate processes, run the
client against them, then shut both down.

Each daemon is waited for with a readiness check (it must answer a ping), never a sleep.
Addresses default to free TCP ports on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from basics.processes import dies_with
from launch import client
from launch.common import TARGET_DTYPES, at_least, device_name, number_in, resolve_model
from launch.keys import LocalKeys
from launch.net import HelpFormatter, one_line_errors, peer_address
from launch.processes import ends_on_sigterm, stop
from protocol.keys import ClientKeys
from protocol.transport import request, wait_ready
from target_node.model.default_model import ensure_default_drafter


class DaemonFailed(SystemExit):
    """A daemon did not start: its message ends a script as SystemExit did (exit 1), and a
    command's one_line_errors prints it as its error line."""


@dataclass
class LocalDaemons:
    """What `local_daemons` started: where the target daemon answers, and both processes (a
    server that outlives them watches them: `lost`, the target daemon ended while it served)."""

    address: str
    draft: subprocess.Popen
    target: subprocess.Popen
    lost: bool = False


_GIVEN: set[int] = set()  # the ports this process handed out


def free_port() -> int:
    """A port free now, and never one this process handed out before: the kernel gave the same port
    to two picks in a row about once in 6,700, and dflash-local's two daemons then shared one
    address (an audit)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def free_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


# Daemons started here share this machine's cores. An OpenMP worker spins for GOMP_SPINCOUNT
# rounds after each parallel region before it sleeps: libgomp's default is several milliseconds,
# long enough that an idle draft daemon's workers steal the cores of the target's verify right
# after a draft (measured: a 17-row verify 53 ms beside a drafter with default spinning, 30 ms
# with 20000 rounds). Short spins still bridge the gaps between one forward's kernels.
COLOCATED_SPIN = "20000"


ROOT = Path(__file__).resolve().parent.parent


def daemon_env() -> dict:
    """A daemon's environment: colocated spinning (above), and the project's packages found first
    with the caller's working directory off the path: `python -m` put it first, and a `basics.py`
    or `training.py` there was imported in place of the project's; the daemon died (an audit)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    spin = os.environ.get("GOMP_SPINCOUNT", COLOCATED_SPIN)
    return dict(os.environ, PYTHONUNBUFFERED="1", GOMP_SPINCOUNT=spin, PYTHONSAFEPATH="1", PYTHONPATH=path)


def start_daemon(
    name: str,
    module: str,
    address: str,
    args: list[str],
    ready_timeout_s: float,
    curve: ClientKeys | None = None,
    log: Path | None = None,
) -> subprocess.Popen:
    """Start `python -m module` and wait until it answers a ping (sent with `curve` keys when it
    speaks CURVE); stopped again if it does not, or if this process is told to stop meanwhile.
    `log`: a file for its output."""
    command = [sys.executable, "-m", module, "--bind", address, *args]
    # Something already answering there would pass the readiness check while this daemon still
    # loads, and the run would use a stranger's daemon, model and keys (an audit).
    if request(address, "ping", timeout_s=0.3) is not None:
        raise DaemonFailed(f"{name}: something already answers at {address}; stop it or pick another address")
    out = open(log, "ab") if log is not None else None
    try:
        # A session of its own: Ctrl-C, a terminal's hang-up or a unit's stop reach the launcher
        # alone, which stops its daemons itself (a server after its graceful shutdown; reaching
        # them at once, they aborted its answers: a review). Killed, it takes them with it (dies_with).
        proc = subprocess.Popen(
            command,
            env=daemon_env(),
            stdout=out,
            stderr=out,
            preexec_fn=dies_with(os.getpid()),
            start_new_session=True,
        )
    finally:
        if out is not None:
            out.close()  # the daemon holds its own
    try:
        ready = wait_ready(address, ready_timeout_s, alive=lambda: proc.poll() is None, curve=curve, pid=proc.pid)
    except BaseException:  # a SIGTERM or Ctrl-C while it loads: one still loading must not outlive it
        stop(proc)
        raise
    if not ready:
        code, where = proc.poll(), f"see {log}" if log is not None else "its output above says why"
        stop(proc)
        if code is None:
            raise DaemonFailed(f"{name} did not answer at {address} within {ready_timeout_s:g} s")
        raise DaemonFailed(f"{name} exited with code {code} before it was ready ({where})")
    print(f"[local] {name} ready at {address} (pid {proc.pid})", flush=True)
    return proc


@contextmanager
def daemon(
    name: str,
    module: str,
    address: str,
    args: list[str],
    ready_timeout_s: float,
    curve: ClientKeys | None = None,
    log: Path | None = None,
) -> Iterator[subprocess.Popen]:
    """`start_daemon` for the block, stopped with SIGTERM at its end."""
    proc = start_daemon(name, module, address, args, ready_timeout_s, curve, log)
    try:
        yield proc
    finally:
        if proc.poll() is not None:  # it ended on its own (no signal of the terminal's reaches it): say so
            print(f"[local] {name} exited with code {proc.returncode}", file=sys.stderr, flush=True)
        stop(proc)


def add_daemon_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `local_daemons`: models, devices, addresses."""
    parser.add_argument("--model", help="target model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter-checkpoint", help="drafter folder (default: the default model's drafter)")
    parser.add_argument(
        "--target-device", type=device_name, default="cpu", help="torch device for the target daemon, e.g. cpu, cuda:0"
    )
    parser.add_argument(
        "--draft-device", type=device_name, default="cpu", help="torch device for the draft daemon, e.g. cpu, cuda:1"
    )
    parser.add_argument(
        "--dtype", default="auto", choices=TARGET_DTYPES, help="weights dtype of both models (auto: see the daemons)"
    )
    parser.add_argument(
        "--draft-address", type=peer_address, help="where the draft daemon binds (default: a free 127.0.0.1 port)"
    )
    parser.add_argument(
        "--target-address", type=peer_address, help="where the target daemon binds (default: a free 127.0.0.1 port)"
    )
    parser.add_argument(
        "--ready-timeout", type=number_in(0, above=True), default=180.0, help="seconds to wait for each daemon"
    )
    parser.add_argument(
        "--threads",
        type=at_least(0),
        default=0,
        help="torch CPU threads per daemon (default %(default)s: torch's own choice)",
    )
    parser.add_argument(
        "--curve", action="store_true", help="CURVE on both links, with throwaway keys made for this run"
    )


@contextmanager
def local_daemons(args: argparse.Namespace) -> Iterator[LocalDaemons]:
    """The draft daemon and the target daemon as subprocesses, stopped on exit."""
    model = resolve_model(args.model)  # convert once, before two processes race to do it
    checkpoint = args.drafter_checkpoint or str(ensure_default_drafter(model))
    draft_address = args.draft_address or free_address()
    target_address = args.target_address or free_address()
    threads = ["--threads", str(args.threads)]
    with ExitStack() as stack:
        folder = tempfile.mkdtemp() if args.curve else None
        if folder is not None:
            stack.callback(shutil.rmtree, folder, ignore_errors=True)
        keys = LocalKeys(folder) if folder is not None else None
        args.client_keys = keys.client_to_target if keys else None
        draft = stack.enter_context(
            daemon(
                "draft daemon",
                "launch.draft_daemon",
                draft_address,
                ["--checkpoint", checkpoint, "--device", args.draft_device, "--dtype", args.dtype, *threads]
                + (keys.draft_args if keys else []),
                args.ready_timeout,
                keys.launcher_to_draft if keys else None,
            )
        )
        target = stack.enter_context(
            daemon(
                "target daemon",
                "launch.target_daemon",
                target_address,
                [
                    "--model",
                    str(model),
                    "--drafter",
                    draft_address,
                    "--device",
                    args.target_device,
                    "--dtype",
                    args.dtype,
                    *threads,
                    *(keys.target_args if keys else []),
                ],
                args.ready_timeout,
                args.client_keys,
            )
        )
        if folder is not None:  # both daemons hold their keys: a launcher killed now leaves none on disk (an audit)
            shutil.rmtree(folder, ignore_errors=True)
        yield LocalDaemons(target_address, draft, target)


@ends_on_sigterm
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dflash-local", description=__doc__, formatter_class=HelpFormatter)
    add_daemon_args(parser)
    client.add_client_args(parser)
    args = parser.parse_args(argv)
    client.check_client_args(parser, args)
    with (
        client.ends_quietly(),
        one_line_errors(parser.prog, client.DroppedRequest, DaemonFailed),
        local_daemons(args) as daemons,
    ):
        args.address = daemons.address
        client.run(args, args.client_keys)


if __name__ == "__main__":
    main()
