"""CURVE key files: who a daemon is, whom it lets in, and whom a client expects to reach.

The files are ZeroMQ's own certificate format (`zmq.auth`), so keys made by any ZeroMQ
tool work, once the secret is readable by its owner only (`chmod 600`): `NAME.key` holds a
public key and may be handed out; `NAME.key_secret` holds the key pair and never leaves its host.
A server needs its key pair and an allow-list of client public keys; a client needs its key pair
and the server's public key.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85


class KeyFileError(ValueError):
    """A key file that is missing or does not hold what its role needs."""


@dataclass(frozen=True)
class ServerKeys:
    """A CURVE server: its key pair, and the z85 public keys of the clients it lets in."""

    public: bytes
    secret: bytes = field(repr=False)  # an object printed, logged or in a traceback shows no secret
    allowed: frozenset[bytes]


@dataclass(frozen=True)
class ClientKeys:
    """A CURVE client: its key pair, and the z85 public key of the server it talks to."""

    public: bytes
    secret: bytes = field(repr=False)
    server: bytes


def create_keypair(folder: str | Path, name: str) -> tuple[Path, Path]:
    """Write `name.key` (public) and `name.key_secret` (readable by its owner only) into `folder`."""
    folder = Path(folder)
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)  # under umask 000 it was anyone's to add keys to
    # Written owner-only from the start: made with the usual umask and then narrowed, the secret
    # was readable by every local user for a moment (an audit).
    umask = os.umask(0o077)
    files = (folder / f"{name}.key", folder / f"{name}.key_secret")
    try:
        for old in files:
            old.unlink(missing_ok=True)  # rewritten in place, a file keeps its old mode (--force over 0644)
        public, secret = (Path(p) for p in zmq.auth.create_certificates(folder, name))
    except OSError:  # a full disk: no half-written key left to be refused (or loaded) later
        for half in files:
            half.unlink(missing_ok=True)
        raise
    finally:
        os.umask(umask)
    os.chmod(public, 0o644)  # the public half is for handing out
    return public, secret


def load_keypair(path: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) from a `.key_secret` file."""
    public, secret = _load(path)
    if secret is None:
        raise KeyFileError(f"{path} holds only a public key; give the .key_secret file made with it")
    if os.name == "posix" and os.stat(path).st_mode & 0o077:
        raise KeyFileError(f"{path} holds a secret key and others may read it: chmod 600 {path}")
    if zmq.curve_public(secret) != public:
        raise KeyFileError(f"{path}: its public key is not the one of its secret key (a file edited by hand?)")
    return public, secret


def load_public(path: str | Path) -> bytes:
    """The public key from a `.key` file that only its owner may rewrite: one others could rewrite
    (0666, or in a folder anyone may write) let any local user put their key on a server's
    allow-list, or in place of the server a client expects (an audit). A `.key_secret` is refused:
    it never leaves its host, and one named here was a key pair copied where its public half belongs."""
    path = Path(path)
    if path.name.endswith(".key_secret"):
        raise KeyFileError(
            f"{path} is a secret key, which never leaves its host: give its public half, {path.name[:-7]}"
        )
    held = path.resolve()  # what a link points at, in the folder that holds it (a review)
    for shared, others in ((held, 0o022), (held.parent, 0o002)):
        if _may_write(shared, others):
            raise KeyFileError(
                f"{shared}: others may write it, and so put their own key in {path.name}: chmod go-w {shared}"
            )
    return _load(path)[0]


def _may_write(path: Path, others: int) -> bool:
    """Whether the `others` bits (group 0o020, anyone 0o002) let someone else replace what `path`
    holds. A folder's group is its members' (umask 002 makes a user's folders so); a folder with
    the sticky bit (/tmp) lets no one replace another's file."""
    if os.name != "posix":
        return False
    try:
        mode = path.stat().st_mode
    except OSError:
        return False  # a file that is not there is refused by what reads it
    return bool(mode & others) and not (path.is_dir() and mode & stat.S_ISVTX)


def load_allowed(paths: Iterable[str | Path]) -> frozenset[bytes]:
    """Public keys from files and from folders of `*.key` files: a server's allow-list."""
    keys: set[bytes] = set()
    for path in map(Path, paths):
        if path.is_dir() and os.name == "posix" and path.stat().st_mode & 0o022:
            raise KeyFileError(
                f"{path}: others may write this folder, and so put their keys on the allow-list: chmod go-w {path}"
            )
        files = sorted(path.glob("*.key")) if path.is_dir() else [path]
        keys.update(load_public(f) for f in files)
    if not keys:
        raise KeyFileError(f"no public keys (*.key) found in {[str(p) for p in paths]}: nobody could connect")
    return frozenset(keys)


def server_keys(keypair: str | Path, allowed: Iterable[str | Path]) -> ServerKeys:
    public, secret = load_keypair(keypair)
    return ServerKeys(public, secret, load_allowed(allowed))


def client_keys(keypair: str | Path, server_public: str | Path) -> ClientKeys:
    public, secret = load_keypair(keypair)
    return ClientKeys(public, secret, load_public(server_public))


def _load(path: str | Path) -> tuple[bytes, bytes | None]:
    if not Path(path).is_file():  # zmq says "Invalid certificate file" of a file that is not there
        raise KeyFileError(f"no CURVE key file at {path}")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot read a CURVE key from {path}: {exc}") from None
    for key in (public, secret):
        if key is not None and len(key) != 40:
            raise KeyFileError(f"{path}: a CURVE key is 40 z85 characters, found {len(key)}")
        try:  # checked here, or ZeroMQ refused it as a bare "Invalid argument" once the model had loaded
            if key is not None:
                z85.decode(key)
        except (KeyError, ValueError, struct.error):  # a character outside the alphabet, or a group past 32 bits
            raise KeyFileError(
                f"{path}: not a CURVE key (not z85: a character outside its alphabet or a group past 32 bits)"
            ) from None
    return public, secret
