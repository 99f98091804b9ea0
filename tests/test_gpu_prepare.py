"""gpu_prepare.sh fits each device call in 64 MiB, gpu_run.sh rebuilds what they carried, and
--restore gives the checkout back its branch and answer store.

Run on a clone of this checkout with this checkout's two scripts, and fake wheels: pip reads a
folder of them instead of an index (there is no network in CI).
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from target_node.model.default_model import _wheel_folder

ROOT = Path(__file__).resolve().parent.parent
CALL_LIMIT = 64 * 1024 * 1024  # what one device call carries, the working tree included
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=check)


def fake_wheels(folder: Path) -> None:
    """Wheels of the three packages gpu_prepare.sh downloads, at this venv's versions."""
    folder.mkdir()
    for name, module, tag in (
        ("pyzmq", "zmq", "cp312-abi3-manylinux_2_28_x86_64"),
        ("gguf", "gguf", "py3-none-any"),
        ("transformers", "transformers", "py3-none-any"),
    ):
        version = metadata.version(name)
        info = f"{name}-{version}.dist-info"
        with zipfile.ZipFile(folder / f"{name}-{version}-{tag}.whl", "w") as wheel:
            wheel.writestr(f"{module}/__init__.py", "")
            wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
            wheel_file = f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}\n"
            wheel.writestr(f"{info}/WHEEL", wheel_file)
            wheel.writestr(f"{info}/RECORD", "")


def travelling(repo: Path) -> list[str]:
    """What a device call takes of the checkout: tracked files, and untracked ones git does not ignore."""
    listed = git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard").stdout
    return sorted({p for p in listed.split("\0") if p and (repo / p).is_file()})


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.jsonl.xz"))}


def prepare(repo: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    command = ["bash", "launch/gpu_prepare.sh", *args]
    return subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=600)


def test_the_calls_fit_the_device_and_restore_gives_the_store_back(tmp_path):
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", "--shared", str(ROOT), str(repo)], check=True)
    git(repo, "checkout", "-q", "-B", "main")  # on a branch, also where this checkout's HEAD is detached
    for script in ("gpu_prepare.sh", "gpu_run.sh"):
        shutil.copy(ROOT / "launch" / script, repo / "launch" / script)
    (repo / ".venv").symlink_to(Path(sys.prefix))
    fake_wheels(tmp_path / "wheels")
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path / "wheels"))
    # Where git knows no one (a fresh machine, CI): the slim commit must not need the user's identity.
    no_one = {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_COUNT": "1"}
    env |= no_one | {"GIT_CONFIG_KEY_0": "user.useConfigOnly", "GIT_CONFIG_VALUE_0": "true"}
    env = {k: v for k, v in env.items() if not k.startswith(("GIT_AUTHOR_", "GIT_COMMITTER_"))}
    branch = "main"
    store = digests(repo / "data" / "answers")
    assert store and sum((repo / "data" / "answers" / n).stat().st_size for n in store) > 30e6

    stray = repo / "data" / "answers" / "new.jsonl.xz"  # a new shard would be left out: refused
    stray.write_bytes(b"x")
    refused = prepare(repo, env)
    assert refused.returncode == 1 and "untracked files in data/answers" in refused.stderr
    assert git(repo, "symbolic-ref", "--short", "HEAD").stdout.strip() == branch
    stray.unlink()

    done = prepare(repo, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert git(repo, "symbolic-ref", "-q", "HEAD", check=False).returncode == 1  # detached, the branch untouched
    assert git(repo, "ls-files", "data/answers").stdout == "" and not list((repo / "data").glob("answers/*"))
    assert git(repo, "rev-parse", f"{branch}:data/answers").returncode == 0
    tree = travelling(repo)
    tree_bytes = sum((repo / p).stat().st_size for p in tree)
    calls = [re.findall(r'"([^"]+)"', line) for line in done.stdout.splitlines() if line.lstrip().startswith("[")]
    assert len(calls) >= 3 and "gpu_run.sh $OUT --minutes" in done.stdout.splitlines()[-2]
    for carried in calls:
        assert tree_bytes + sum((repo / p).stat().st_size for p in carried) <= CALL_LIMIT, carried

    # The device machine: the tree with every call, the carried files kept between calls.
    device = tmp_path / "device"
    for path in tree + [p for carried in calls for p in carried]:
        (device / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(repo / path, device / path)
    env_run = dict(os.environ, PYTHON=sys.executable)
    command = ["bash", "launch/gpu_run.sh", str(tmp_path / "out"), "--help"]
    ran = subprocess.run(command, cwd=device, env=env_run, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and "--plan" in ran.stdout, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert digests(device / "data" / "answers") == store
    assert (device / ".gpu/payload/gguf" / GGUF).read_bytes() == (Path(_wheel_folder()) / GGUF).read_bytes()
    assert len(list((device / ".gpu/payload/whl").glob("*.whl"))) == 3
    (device / calls[0][0]).unlink()  # a part that did not stay: one clear line
    lost = subprocess.run(command, cwd=device, env=env_run, capture_output=True, text=True, timeout=300)
    assert lost.returncode == 1 and "do not make the whole payload" in lost.stderr

    # Work goes on while slim: a commit on the slim commit, which deletes the store. A branch made at
    # it (what --restore once advised) fast-forwards or merges that deletion into the branch; the
    # commit goes over alone, and no branch ever holds the slim commit.
    base = git(repo, "rev-parse", branch).stdout.strip()
    slim = git(repo, "rev-parse", "HEAD").stdout.strip()
    (repo / "README.md").write_text((repo / "README.md").read_text() + "\nmeanwhile\n")
    who = ("-c", "user.name=t", "-c", "user.email=t@t")
    git(repo, *who, "commit", "-q", "-am", "meanwhile")
    (repo / "README.md").write_text((repo / "README.md").read_text() + "uncommitted\n")
    dirty = prepare(repo, env, "--restore")  # uncommitted changes beside commits to carry: refused, nothing moved
    assert dirty.returncode == 1 and "uncommitted changes" in dirty.stderr
    assert git(repo, "symbolic-ref", "-q", "HEAD", check=False).returncode == 1
    git(repo, "checkout", "-q", "README.md")
    back = prepare(repo, env.copy() | {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}, "--restore")
    assert back.returncode == 0, back.stdout + back.stderr
    assert git(repo, "symbolic-ref", "--short", "HEAD").stdout.strip() == branch
    assert git(repo, "rev-parse", f"{branch}^").stdout.strip() == base  # the commit, on the branch as it was
    assert git(repo, "log", "-1", "--format=%s", branch).stdout.strip() == "meanwhile"
    assert (repo / "README.md").read_text().endswith("\nmeanwhile\n")
    assert git(repo, "merge-base", "--is-ancestor", slim, branch, check=False).returncode == 1
    assert digests(repo / "data" / "answers") == store
    assert git(repo, "status", "--porcelain").stdout == ""
    assert prepare(repo, env, "--restore").returncode == 0  # twice: nothing to do
