"""Addresses, link-security flags, and how a command explains itself and fails, without torch: the client
imports only these.

Both daemons take the same server flags (`--curve-key`, `--curve-allow`,
`--insecure-plaintext`); every link a process opens takes its own key pair plus the
server's public key. Misuse is refused at parse time, before any model is loaded.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from protocol import ProtocolError
from protocol.keys import ClientKeys, KeyFileError, ServerKeys, client_keys, server_keys
from protocol.transport import BindError, InsecureBind, check_bind, is_loopback

DRAFT_ADDRESS = "tcp://127.0.0.1:5555"
TARGET_ADDRESS = "tcp://127.0.0.1:5556"


PORTS = range(1, 65536)


def is_port_number(text: str) -> bool:
    """ASCII digits only: `str.isdigit` and `int` take other scripts' digits, which ZeroMQ refuses
    later (`tcp://127.0.0.1:٥٥٥` passed the parser and ended in a traceback: an audit)."""
    return text.isascii() and text.isdigit() and int(text) in PORTS


def tcp_port(text: str) -> int:
    """A port flag's value (before: dflash-serve --port 70000 ended in three tracebacks from uvicorn's bind)."""
    if not is_port_number(text):
        raise argparse.ArgumentTypeError(f"a port of 1-65535, got {text}")
    return int(text)


IPC_PATH_BYTES = 107  # a Unix socket's path (sun_path less its NUL): ZeroMQ failed "File name too long"


def address(text: str) -> str:
    """A ZeroMQ address flag's value, refused by the parser where ZeroMQ would fail on it later (with
    a traceback, or a 500 for every HTTP request) or quietly use another port (99999 bound 34463)."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {text!r}")
    for endpoint in rest.split(";") if scheme == "tcp" else ():  # ZeroMQ's SOURCE;DESTINATION form too
        host, colon, port = endpoint.rpartition(":")
        if not colon or not host or not (port == "*" or is_port_number(port)):
            raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT with a port of 1-65535, got {text!r}")
        # Each got "No such device" from a daemon and a 5 s wait for nothing from a client (an audit).
        if ":" in host and not (host.startswith("[") and host.endswith("]")):
            raise argparse.ArgumentTypeError(f"an IPv6 host goes in brackets, as tcp://[::1]:PORT, got {text!r}")
        if any(char.isspace() for char in endpoint):
            raise argparse.ArgumentTypeError(f"an address holds no spaces, got {text!r}")
    if scheme == "ipc" and len(os.fsencode(rest)) > IPC_PATH_BYTES:
        raise argparse.ArgumentTypeError(f"an ipc path holds at most {IPC_PATH_BYTES} bytes, got {text!r}")
    return text


def peer_address(text: str) -> str:
    """An address another process connects to: no wildcard port, no inproc (one process's own),
    which got a ZeroMQ traceback or a 5 s wait for nothing (an audit)."""
    scheme, sep, _ = text.partition("://")
    if not sep or scheme not in ("tcp", "ipc"):  # address() would offer inproc://, refused below (an audit)
        raise argparse.ArgumentTypeError(f"expected a tcp://HOST:PORT or ipc://PATH to reach, got {text!r}")
    text = address(text)
    scheme, _, rest = text.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme == "inproc" or (scheme == "tcp" and "*" in (host, port)) or (scheme == "ipc" and rest == "*"):
        raise argparse.ArgumentTypeError(f"expected a tcp://HOST:PORT or ipc://PATH to reach, got {text!r}")
    return text


def reaches_itself(bind: str, peer: str) -> bool:
    """Whether connecting to `peer` would reach the socket bound at `bind` on this host: a target
    daemon whose --drafter was its own --bind sent its hello to itself and retried for ever, its
    log saying only that the drafter was unavailable (an audit)."""
    if bind == peer:
        return True
    bind_scheme, _, bind_rest = bind.partition("://")
    peer_scheme, _, peer_rest = peer.partition("://")
    if bind_scheme != "tcp" or peer_scheme != "tcp":
        return False
    bind_host, _, bind_port = bind_rest.rpartition(":")
    peer_host, _, peer_port = peer_rest.rpartition(":")
    if bind_port != peer_port:
        return False
    if bind_host in ("*", "0.0.0.0", "[::]"):
        return is_loopback(peer_host)
    names = {"localhost": {"127.0.0.1", "[::1]"}, "lo": {"127.0.0.1", "[::1]"}}
    return bool(names.get(bind_host, {bind_host}) & names.get(peer_host, {peer_host}))


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks, and every flag that takes a value shows its default in
    `--help` (unless its help already says it), so a user sees what a run does with the flag left out."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = "default" in text or "%(default)" in text
        if shown or not action.option_strings or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            return action.help
        return f"{text} (default %(default)s)"


@contextmanager
def one_line_errors(prog: str, *more: type[BaseException]) -> Iterator[None]:
    """A user's mistake ends the command with one line on stderr and exit 1, not a traceback: a
    folder that holds no model, an address taken or that no daemon answers, a request the daemon
    refuses, and the `more` a command knows (a checkpoint that is none, a drafter that does not
    fit). Anything else is a bug and keeps its traceback."""
    mistakes = (FileNotFoundError, NotADirectoryError, BindError, InsecureBind, ProtocolError, TimeoutError, *more)
    try:
        yield
    except mistakes as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        raise SystemExit(1) from None


def add_server_security_args(parser: argparse.ArgumentParser) -> None:
    """CURVE for a daemon's own socket: its key pair, whom it lets in, or plaintext on purpose."""
    parser.add_argument(
        "--curve-key", help="this daemon's key pair (NAME.key_secret, from dflash-keys); CURVE with --curve-allow"
    )
    parser.add_argument(
        "--curve-allow",
        action="append",
        help="public key file (NAME.key), or a folder of them, of a client allowed to connect (repeatable)",
    )
    parser.add_argument(
        "--insecure-plaintext",
        action="store_true",
        help="serve a non-loopback --bind without CURVE: unencrypted, anyone who can reach it can use it",
    )


def server_security(
    parser: argparse.ArgumentParser, args: argparse.Namespace, key_serves_links_out: bool = False
) -> ServerKeys | None:
    """The daemon's CURVE keys (None: plaintext), refusing a plaintext non-loopback bind unless
    --insecure-plaintext says so: checked before any model is loaded. `key_serves_links_out`:
    --curve-key without --curve-allow is fine, it identifies this daemon on a link it opens."""
    curve = None
    if args.curve_key and not args.curve_allow and not key_serves_links_out:
        parser.error("--curve-key needs --curve-allow: the public keys of the clients to let in")
    try:
        if args.curve_allow:
            if not args.curve_key:
                parser.error("--curve-allow needs --curve-key (this daemon's own key pair)")
            curve = server_keys(args.curve_key, args.curve_allow)
        check_bind(args.bind, curve, args.insecure_plaintext)
    except (KeyFileError, InsecureBind) as exc:
        parser.error(str(exc))
    return curve


def client_security(
    parser: argparse.ArgumentParser,
    keypair: str | None,
    server_public: str | None,
    flag: str,
    key_serves_a_socket: bool = False,
) -> ClientKeys | None:
    """CURVE keys for a link this process opens: its key pair plus the server's public key (`flag`).
    A key pair without that key is refused, unless it also serves this process's own socket
    (`key_serves_a_socket`): the link went plaintext, the key unused, without a word (an audit)."""
    if not server_public:
        if keypair and not key_serves_a_socket:
            parser.error(f"--curve-key needs {flag} (the server's public key); without it the link is plaintext")
        return None
    if not keypair:
        parser.error(f"{flag} needs --curve-key (this side's own key pair)")
    try:
        return client_keys(keypair, server_public)
    except KeyFileError as exc:
        parser.error(str(exc))
