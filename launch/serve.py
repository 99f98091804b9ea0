"""Serve an OpenAI-compatible HTTP API, Prometheus metrics and a live page.

Two ways to start it:

  standalone   dflash-serve --target tcp://127.0.0.1:5556
               the front end alone, as one more client of a running target daemon
  all in one   dflash-serve [--model DIR] [--threads N] ...
               also starts the draft daemon and the target daemon as subprocesses
               (like dflash-local) and stops them on exit

Then: POST /v1/chat/completions and /v1/completions (stream with "stream": true),
GET /v1/models, /health, /metrics (Prometheus), /stats (the daemon's stats as JSON) and
the live page at / (chat, tokens/s, tau, acceptance per draft position).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from frontend.drain import MIN_GRACE_S
from frontend.settings import DEFAULTS, FrontendSettings
from launch.net import HelpFormatter, client_security, one_line_errors, peer_address, tcp_port
from launch.processes import leave, stop
from protocol.transport import BindError, is_loopback, request

if TYPE_CHECKING:
    import socket

    from frontend.server import HTTPServer
    from launch.local import LocalDaemons

API_KEY_ENV = "DFLASH_API_KEY"


def api_key(text: str) -> str:
    """An --api-key value: what an Authorization header can carry as it was typed."""
    if not text or not all(33 <= ord(c) <= 126 for c in text):
        raise argparse.ArgumentTypeError("an API key is one or more printable ASCII characters, no spaces")
    return text


def host_names(text: str) -> frozenset[str]:
    """An --allowed-hosts value: names, comma-separated, or * for any."""
    names = frozenset(name.strip().lower().rstrip(".") for name in text.split(","))

    def bad(name: str) -> bool:  # an IPv6 address as a Host header gives it: [2001:db8::1]
        bracketed = name.startswith("[") and name.endswith("]")
        return not name or bool(set(name) & set(" /@*")) or (":" in name and not bracketed)  # no *.example.com

    if names != {"*"} and any(bad(name) for name in names):
        raise argparse.ArgumentTypeError(
            "host names, comma-separated (no ports, no wildcards; IPv6 in brackets), or * alone for any"
        )
    return names


def allowed_hosts(args: argparse.Namespace) -> frozenset[str] | None:
    """The Host names requests may give beside loopback ones (None: any): --allowed-hosts's, else
    none on a loopback --host (frontend/hosts.py says why), else any (a server reached from other
    hosts by names it cannot know)."""
    if args.allowed_hosts is None:
        return frozenset() if is_loopback(args.host) else None
    return None if args.allowed_hosts == {"*"} else args.allowed_hosts


def wait_http_ready(url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """GET `url` until it answers 200: a readiness check, not a sleep. `alive` aborts early."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            return False
        try:
            with urllib.request.urlopen(url, timeout=1.0) as reply:
                if reply.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)
    return False


@contextmanager
def front_end(port: int, args: list[str], ready_timeout_s: float = 120.0) -> Iterator[str]:
    """Run `python -m launch.serve` on 127.0.0.1:`port` with `args`; yields its base URL, stops it on exit."""
    command = [sys.executable, "-m", "launch.serve", "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(command, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_http_ready(f"{url}/", ready_timeout_s, alive=lambda: proc.poll() is None):
            raise RuntimeError(f"dflash-serve did not become ready at {url} (exit code {proc.poll()})")
        yield url
    finally:
        stop(proc, grace_s=30)


def exit_on_signals() -> None:
    """SIGTERM, SIGINT and SIGHUP end the process through SystemExit, so the daemons started below
    are stopped, whenever they come. While uvicorn serves it takes them itself (HTTPServer), shuts
    down gracefully, then raises the signal again, which ends here. A signal ignored (SIGHUP under
    nohup) stays ignored (a review)."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, leave)


def watch_daemons(daemons: LocalDaemons, server: HTTPServer, done: threading.Event, poll_s: float = 0.5) -> None:
    """All in one, the server owns its daemons. A target daemon that exits ends the server with
    exit 1, so a supervisor (systemd's Restart=on-failure, docker, k8s) brings the whole stack back:
    it served 503 for good, logged nothing, and exited 0 when stopped (an audit). A draft daemon
    that exits is named once; the target drafts without it, exactly, only slower. `done`: the
    server has ended, and stops its daemons itself."""
    named = False
    while not done.wait(poll_s):
        if (code := daemons.target.poll()) is not None:
            print(f"[serve] the target daemon exited with code {code}: shutting down", file=sys.stderr, flush=True)
            daemons.lost = True
            server.stop()
            return
        if (code := daemons.draft.poll()) is not None and not named:
            print(
                f"[serve] the draft daemon exited with code {code}: serving on without drafts (exact, slower)",
                file=sys.stderr,
                flush=True,
            )
            named = True


def build_parser() -> argparse.ArgumentParser:
    from launch.common import at_least, byte_size, number_in
    from launch.local import add_daemon_args

    parser = argparse.ArgumentParser(prog="dflash-serve", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--target", type=peer_address, help="a running target daemon's address (standalone); omit to start both daemons"
    )
    parser.add_argument("--curve-key", help="with --target: this server's key pair (NAME.key_secret from dflash-keys)")
    parser.add_argument(
        "--server-key", help="with --target: the target daemon's public key (NAME.key): CURVE, needs --curve-key"
    )
    add_listening_args(parser)
    parser.add_argument(
        "--served-model-name",
        help="the model id clients name in requests (default: the name of the target daemon's model folder)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=at_least(1),
        default=DEFAULTS.default_max_tokens,
        help="chat answers' token limit when a request gives none (default %(default)s)",
    )
    parser.add_argument(
        "--daemon-timeout",
        type=number_in(0, above=True),
        default=5.0,
        help="seconds the target daemon may leave a ping unanswered before requests get 503 (default %(default)s)",
    )
    parser.add_argument(
        "--max-body-size",
        type=byte_size,
        default=f"{DEFAULTS.max_body_size >> 20}M",
        help="largest request body, in bytes or with K, M or G; a larger one gets 413 (default %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        type=api_key,
        default=os.environ.get(API_KEY_ENV),
        help=f"/v1 answers only requests with `Authorization: Bearer KEY` (others: 401); best given as "
        f"${API_KEY_ENV}, which other users cannot read in the process list (default: ${API_KEY_ENV}, "
        "else none: anyone who reaches --host may use it)",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=number_in(MIN_GRACE_S),
        default=5.0,
        help="seconds the connections get when the server stops; the answers still running a second before "
        f"it ends stop with a 503 server_shutting_down error (default %(default)s, at least {MIN_GRACE_S:g})",
    )
    add_log_args(parser)
    group = parser.add_argument_group("all in one (without --target)")
    add_daemon_args(group)
    return parser


def add_listening_args(parser: argparse.ArgumentParser) -> None:
    """Where the HTTP server listens, and the host names it answers for."""
    parser.add_argument("--host", default="127.0.0.1", help="HTTP interface to listen on (default %(default)s)")
    parser.add_argument("--port", type=tcp_port, default=8000, help="HTTP port, 1-65535 (default %(default)s)")
    parser.add_argument(
        "--allowed-hosts",
        type=host_names,
        metavar="NAMES",
        help="host names requests may give in their Host header besides loopback ones, comma-separated, or * for "
        "any: a name a proxy forwards to a loopback --host (default: on a loopback --host, loopback names only, so "
        "no web page's own name pointed at 127.0.0.1 is answered; on another --host, any)",
    )


def add_log_args(parser: argparse.ArgumentParser) -> None:
    levels = ("critical", "error", "warning", "info", "debug", "trace")
    parser.add_argument("--log-level", type=str.lower, default="info", choices=levels, help="default %(default)s")
    parser.add_argument(
        "--forwarded-allow-ips",
        metavar="IPS",
        help="behind an HTTP proxy: the proxy's addresses (comma-separated, or *), whose X-Forwarded-For and "
        "X-Forwarded-Proto headers name the client in the access log (default: trust none)",
    )


def check_mode(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse the flags of the mode not chosen, which went unused without a word: `--curve-key`
    without `--target` left the link plaintext (an audit)."""
    from launch.local import add_daemon_args

    if args.target is None:
        if args.curve_key or args.server_key:
            parser.error("--curve-key and --server-key go with --target (all in one: --curve)")
        return
    defaults = argparse.ArgumentParser(add_help=False)
    add_daemon_args(defaults)
    unused = [name for name, value in vars(defaults.parse_args([])).items() if getattr(args, name) != value]
    if unused:
        flags = ", ".join("--" + name.replace("_", "-") for name in unused)
        parser.error(f"{flags}: for all in one, without --target (the daemon at --target has its own)")


STOPPED = {128 + signal.SIGTERM, 128 + signal.SIGINT, 128 + signal.SIGHUP}  # leave()'s exits


def main(argv: list[str] | None = None) -> None:
    from launch.local import DaemonFailed

    parser = build_parser()
    args = parser.parse_args(argv)
    check_mode(parser, args)
    args.client_keys = client_security(parser, args.curve_key, args.server_key, "--server-key")
    with one_line_errors(parser.prog, DaemonFailed):
        try:
            run(args)
        except SystemExit as exc:
            # Stopped as asked, and cleanly: success, as systemd's stop expects (143 left a
            # stopped unit "failed": a review).
            if exc.code in STOPPED:
                raise SystemExit(0) from None
            raise


def run(args: argparse.Namespace) -> None:
    """The front end, in front of a running daemon or of both daemons it starts."""
    from frontend.server import listening_sockets
    from launch.local import local_daemons

    exit_on_signals()
    sockets = listening_sockets(args.host, args.port)
    try:
        if args.target:
            if request(args.target, "ping", timeout_s=2.0, curve=args.client_keys) is None:  # it started in silence
                print(
                    f"[serve] warning: no target daemon answers at {args.target} yet: requests get 503 until one does",
                    file=sys.stderr,
                    flush=True,
                )
            serve(args, sockets, args.target)
            return
        with local_daemons(args) as daemons:
            serve(args, sockets, daemons.address, daemons)
    finally:
        for sock in sockets:
            sock.close()


def http_server(args: argparse.Namespace, address: str) -> HTTPServer:
    """uvicorn's server for the front end of the target daemon at `address`."""
    import uvicorn

    from frontend.app import create_app
    from frontend.connections import REFUSALS_DRAINED, bounded_h11
    from frontend.drain import Drain
    from frontend.link import TargetLink, connection_limit, open_call_limit
    from frontend.server import HTTPServer, quiet_access_log, url

    # local_daemons sets its own keys; the process may open files for as many requests as it is allowed
    open_calls = open_call_limit(raise_soft_limit=True)
    link = TargetLink(address, args.daemon_timeout, curve=args.client_keys, max_open=open_calls)
    drain = Drain(lambda: server.stopping_since, args.shutdown_grace)
    answering = FrontendSettings(
        args.served_model_name, args.default_max_tokens, args.max_body_size, args.api_key, allowed_hosts(args)
    )
    app = create_app(link, answering, drain)
    print(f"[serve] {url(args.host, args.port)} -> target daemon {address}", flush=True)
    if args.api_key is None and not is_loopback(args.host):
        print(
            f"[serve] warning: {args.host} can be reached from other hosts and no API key is set: anyone who "
            f"reaches it can generate (set ${API_KEY_ENV} or pass --api-key)",
            file=sys.stderr,
            flush=True,
        )
    # Answers still running at shutdown get --shutdown-grace, then end (drain.py).
    # The connections fit in the open files the requests' sockets leave.
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_grace,
        http=bounded_h11(max(1, connection_limit(open_calls) - REFUSALS_DRAINED)),
        # uvicorn's default trusts X-Forwarded-For from 127.0.0.1, where every client of the default
        # --host is: any of them named any address for its log lines (an audit).
        proxy_headers=args.forwarded_allow_ips is not None,
        forwarded_allow_ips=args.forwarded_allow_ips or "",
    )
    quiet_access_log()
    server = HTTPServer(config, link)
    return server


def serve(
    args: argparse.Namespace, sockets: list[socket.socket], address: str, daemons: LocalDaemons | None = None
) -> None:
    """Serve on `sockets` until a signal, or (all in one) until the target daemon is gone: exit 1."""
    server = http_server(args, address)
    done, watcher = threading.Event(), None
    if daemons is not None:
        watcher = threading.Thread(target=watch_daemons, args=(daemons, server, done), daemon=True)
        watcher.start()
    try:
        server.run(sockets=sockets)
    except OSError as exc:  # listen() failed: a server that bound the port too listened first
        if server.started:
            raise
        raise BindError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    finally:
        done.set()  # before the daemons are stopped: their exits are not the watcher's news
        if watcher is not None:
            watcher.join()
    if daemons is not None and daemons.lost:  # named by the watcher
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a stop now must not make it 0
            signal.signal(signum, signal.SIG_IGN)
        raise SystemExit(1)
    if server.signalled is not None:  # out of the event loop now: it ends the process here (leave)
        signal.raise_signal(server.signalled)


if __name__ == "__main__":
    main()
