"""CURVE key files: a secret is never readable by others, and a key that cannot work is refused
as it is read, before a daemon loads its model."""

import os

import pytest
import zmq.auth

from protocol import keys
from protocol.keys import KeyFileError, client_keys, create_keypair, load_keypair


def test_a_secret_is_written_owner_only_from_the_start(tmp_path, monkeypatch):
    """It was written with the usual umask (0644) and narrowed afterwards: readable by every local
    user for a moment (an audit). The mode is now taken right as the certificate is written."""
    written = zmq.auth.create_certificates
    modes = {}

    def watched(folder, name):
        public, secret = written(folder, name)
        modes.update(public=os.stat(public).st_mode & 0o777, secret=os.stat(secret).st_mode & 0o777)
        return public, secret

    monkeypatch.setattr(keys.zmq.auth, "create_certificates", watched)
    before = os.umask(0o022)
    try:
        public, secret = create_keypair(tmp_path, "daemon")
        assert os.umask(0o022) == 0o022  # the process's umask is given back
    finally:
        os.umask(before)
    assert modes["secret"] == 0o600, oct(modes["secret"])
    assert os.stat(secret).st_mode & 0o777 == 0o600 and os.stat(public).st_mode & 0o777 == 0o644
    assert load_keypair(secret)[0] == keys.load_public(public)


def test_a_secret_others_may_read_is_refused(tmp_path):
    _, secret = create_keypair(tmp_path, "daemon")
    os.chmod(secret, 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_keypair(secret)


def rewrite(path, old: bytes, new: bytes) -> None:
    text = path.read_bytes()
    assert old in text
    path.write_bytes(text.replace(old, new))


def test_a_key_outside_z85_is_refused_as_read_not_by_zeromq_later(tmp_path):
    """ZeroMQ refused such a key only as the daemon bound, after its model loaded, as a bare
    "Invalid argument" traceback (an audit)."""
    public, secret = create_keypair(tmp_path, "daemon")
    key = keys.load_public(public)
    rewrite(public, key, b"~" + key[1:])
    with pytest.raises(KeyFileError, match="z85"):
        keys.load_public(public)
    _, client_secret = create_keypair(tmp_path, "client")
    with pytest.raises(KeyFileError, match="z85"):
        client_keys(client_secret, public)


def test_a_key_pair_whose_halves_do_not_match_is_refused(tmp_path):
    _, secret = create_keypair(tmp_path, "one")
    other, _ = create_keypair(tmp_path, "two")
    mine, theirs = load_keypair(secret)[0], keys.load_public(other)
    rewrite(secret, mine, theirs)
    with pytest.raises(KeyFileError, match="not the one of its secret key"):
        load_keypair(secret)


def test_a_pair_made_again_over_a_readable_one_is_owner_only_too(tmp_path):
    """Rewritten in place (dflash-keys --force), a secret file kept its old 0644 mode, and the new
    secret was readable by every local user, then refused at load (a review)."""
    public, secret = zmq.auth.create_certificates(tmp_path, "daemon")
    os.chmod(secret, 0o644)
    _, secret = create_keypair(tmp_path, "daemon")
    assert os.stat(secret).st_mode & 0o777 == 0o600
    assert load_keypair(secret)


def test_a_key_of_z85_characters_past_32_bits_a_group_is_refused_as_a_key_error(tmp_path):
    public, _ = create_keypair(tmp_path, "daemon")
    rewrite(public, keys.load_public(public), b"%" * 40)
    with pytest.raises(KeyFileError, match="z85"):
        keys.load_public(public)


def test_a_disk_that_refuses_a_key_is_one_line_and_leaves_no_half_pair(tmp_path, monkeypatch, capsys):
    """`dflash-keys` on a full or read-only disk ended in a traceback (an audit), and a public key
    written before the disk filled stayed beside no secret. Here the disk fills after the public
    half (as zmq.auth writes it: public first)."""
    from launch.keys import main

    made = zmq.auth.create_certificates

    def disk_fills(folder, name):
        made(folder, name)
        (tmp_path / f"{name}.key_secret").write_bytes(b"#   ZeroMQ")  # cut short
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(zmq.auth, "create_certificates", disk_fills)
    with pytest.raises(SystemExit) as ended:
        main(["--out", str(tmp_path), "client"])
    assert ended.value.code == 1
    assert capsys.readouterr().err.strip() == "dflash-keys: error: [Errno 28] No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_a_key_folder_others_may_write_is_made_so_by_no_one_and_allows_no_one(tmp_path):
    """Under umask 000, `dflash-keys --out DIR` made DIR anyone's to write, and `--curve-allow DIR`
    took every key a local user put there (an audit)."""
    umask = os.umask(0)
    try:
        create_keypair(tmp_path / "keys", "client")
    finally:
        os.umask(umask)
    assert (tmp_path / "keys").stat().st_mode & 0o777 == 0o755
    (tmp_path / "keys").chmod(0o777)
    with pytest.raises(KeyFileError, match="others may write this folder"):
        keys.load_allowed([tmp_path / "keys"])
    (tmp_path / "keys").chmod(0o755)
    assert len(keys.load_allowed([tmp_path / "keys"])) == 1


def test_a_public_key_others_may_rewrite_is_refused_as_a_server_allows_or_a_client_expects_it(tmp_path):
    """A 0666 `client.key` named by --curve-allow, or in a 0755 folder of keys, and a --server-key
    in a folder anyone may write, were read as given: any local user could put their key on the
    allow-list, or stand in for the server (an audit). A folder with the sticky bit (/tmp) is fine."""
    folder = tmp_path / "keys"
    public, secret = create_keypair(folder, "client")
    create_keypair(folder, "server")
    assert len(keys.load_allowed([public])) == 1 and len(keys.load_allowed([folder])) == 2
    public.chmod(0o666)
    for allow in ([public], [folder]):
        with pytest.raises(KeyFileError, match=r"client.key: others may write it"):
            keys.load_allowed(allow)
    public.chmod(0o644)
    server = folder / "server.key"
    folder.chmod(0o777)
    with pytest.raises(KeyFileError, match=r"keys: others may write it, and so put their own key in server.key"):
        client_keys(secret, server)
    folder.chmod(0o1777)  # sticky: no one replaces another's file
    assert client_keys(secret, server).server == keys.load_public(server)
    folder.chmod(0o775)  # a group's folder, as umask 002 makes a user's: its members' choice
    assert client_keys(secret, server).server == keys.load_public(server)
    link = tmp_path / "link.key"
    link.symlink_to(public)
    folder.chmod(0o777)  # what a link points at, in the folder that holds it, is what counts (a review)
    with pytest.raises(KeyFileError, match=r"keys: others may write it"):
        keys.load_public(link)
    folder.chmod(0o755)
    public.chmod(0o646)
    with pytest.raises(KeyFileError, match="client.key: others may write it"):
        keys.load_public(link)


def test_keys_made_into_a_groups_folder_are_listed_not_a_traceback(tmp_path):
    """Under umask 002 (a user's own group), `dflash-keys --out DIR` into an existing 0775 folder
    wrote the keys, then ended in a traceback reading the public key back (a review)."""
    from launch.keys import main

    folder = tmp_path / "keys"
    folder.mkdir(mode=0o775)
    folder.chmod(0o775)
    umask = os.umask(0o002)
    try:
        main(["--out", str(folder), "draft"])
    finally:
        os.umask(umask)
    assert keys.load_allowed([folder / "draft.key"]) == {load_keypair(folder / "draft.key_secret")[0]}


def test_a_secret_key_given_as_a_public_one_or_a_key_file_not_there_is_refused_saying_so(tmp_path):
    """`--curve-allow keys/target.key_secret` was taken (a key pair copied where its public half
    belongs), and a file not there was "Invalid certificate file" (an audit)."""
    public, secret = create_keypair(tmp_path, "target")
    with pytest.raises(KeyFileError, match=r"target.key_secret is a secret key.*give its public half, target.key"):
        keys.load_allowed([secret])
    with pytest.raises(KeyFileError, match="no CURVE key file at .*/nowhere.key"):
        keys.load_allowed([tmp_path / "nowhere.key"])
    with pytest.raises(KeyFileError, match="no CURVE key file at .*/gone.key_secret"):
        load_keypair(tmp_path / "gone.key_secret")
    assert keys.load_allowed([public]) == {keys.load_public(public)}


def test_a_secret_made_inside_the_checkout_is_never_staged():
    """`dflash-keys --out keys draft target client`, as docs/deployment.md has it, run in the
    checkout: `git add -A` staged the secrets (an audit)."""
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("keys/draft.key_secret", "target.key_secret"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=root).returncode == 0, path
