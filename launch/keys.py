"""Make CURVE key pairs for the daemons and their clients.

Each NAME gets NAME.key (the public key: copy it to the peers that must know it) and
NAME.key_secret (the key pair, readable by its owner only: it stays on its host). A typical
deployment, the draft daemon on host B and the target daemon on host A:

  dflash-keys --out keys draft target client
  B: dflash-draft-daemon --bind tcp://0.0.0.0:5555 --curve-key keys/draft.key_secret --curve-allow keys/target.key
  A: dflash-target-daemon --drafter tcp://B:5555 --drafter-key keys/draft.key --curve-key keys/target.key_secret \\
       --bind tcp://0.0.0.0:5556 --curve-allow keys/client.key
  C: dflash-client --address tcp://A:5556 --curve-key keys/client.key_secret --server-key keys/target.key ...
(Without --curve-allow the target daemon's own socket stays plaintext, for clients on its host alone.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from launch.net import HelpFormatter, one_line_errors
from protocol.keys import client_keys, create_keypair, load_keypair


class LocalKeys:
    """Throwaway keys for one all-in-one run (`dflash-local --curve`): the flags each daemon
    gets, and this process's keys as a client of each. Only the target's key opens the draft
    daemon, so this process pings it for readiness as the target it starts; the client's key
    opens the target daemon alone."""

    def __init__(self, folder: str | Path) -> None:
        keys = Path(folder)
        for name in ("draft", "target", "client"):
            create_keypair(keys, name)
        self.draft_args = ["--curve-key", str(keys / "draft.key_secret"), "--curve-allow", str(keys / "target.key")]
        self.target_args = ["--curve-key", str(keys / "target.key_secret"), "--drafter-key", str(keys / "draft.key")]
        self.target_args += ["--curve-allow", str(keys / "client.key")]
        self.launcher_to_draft = client_keys(keys / "target.key_secret", keys / "draft.key")
        self.client_to_target = client_keys(keys / "client.key_secret", keys / "target.key")


def key_name(text: str) -> str:
    """A parser type: a key pair's name, a plain file name within --out (`''` wrote hidden files,
    `../x` wrote outside it: an audit)."""
    if not text or text in (".", "..") or "/" in text or "\\" in text or text.startswith("."):
        raise argparse.ArgumentTypeError(f"a key name is a plain file name (no '/', not hidden), got {text!r}")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dflash-keys", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("names", nargs="+", type=key_name, help="one key pair per name, e.g. draft target client")
    parser.add_argument("--out", default=".", help="folder to write the key files into (default: here)")
    parser.add_argument("--force", action="store_true", help="overwrite existing key files")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if len(set(args.names)) < len(args.names):
        parser.error(f"a name given twice: {' '.join(args.names)}")
    for name in args.names:  # all checked before any is written
        if not args.force and (out / f"{name}.key_secret").exists():
            parser.error(f"{out / name}.key_secret exists; --force replaces it (and locks out its old peers)")
    for name in args.names:
        with one_line_errors(parser.prog, OSError):  # a file in the way, a read-only or full disk
            public, secret = create_keypair(out, name)
        print(f"{name}: public {public} ({load_keypair(secret)[0].decode()}), secret {secret}")


if __name__ == "__main__":
    main()
