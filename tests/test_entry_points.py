"""Every console script the package declares imports and explains itself."""

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

SCRIPTS = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_console_script_answers_help(name):
    module, func = SCRIPTS[name].split(":")
    code = f"import sys; sys.argv = [{name!r}, '--help']; from {module} import {func}; {func}()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout and "--help" in done.stdout


@pytest.fixture(scope="module")
def taken_address():
    """An address something already listens on."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    sock.close(0)


@pytest.mark.parametrize(
    "module, args, says",
    [
        ("launch.target_daemon", ["--model", "/nowhere/model", "--proposer", "none"], "no config.json"),
        ("launch.draft_daemon", ["--checkpoint", "EMPTY"], "is not a drafter checkpoint"),
        ("launch.draft_daemon", ["--bind", "TAKEN"], "cannot listen on tcp://127.0.0.1:"),
        ("launch.client", ["--address", "tcp://127.0.0.1:9", "--prompt", "hi"], "no target daemon answered a ping"),
    ],
    ids=["target-no-model", "draft-no-checkpoint", "draft-address-taken", "client-nobody-there"],
)
def test_a_users_mistake_is_one_line_on_stderr_not_a_traceback(module, args, says, tmp_path, taken_address):
    args = [str(tmp_path) if a == "EMPTY" else taken_address if a == "TAKEN" else a for a in args]
    done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and says in last and last.startswith("dflash-"), done.stderr[-2000:]


def test_launch_holds_only_entry_points_and_their_helpers():
    """Benchmarks, harnesses and library code live elsewhere: launch/ is where a user starts a command."""
    launch = Path(__file__).resolve().parent.parent / "launch"
    entry_points = {target.split(":")[0] for target in SCRIPTS.values() if target.startswith("launch.")}
    helpers = {"launch.__init__", "launch.common", "launch.net", "launch.processes"}
    modules = {f"launch.{path.stem}" for path in launch.glob("*.py")}
    assert modules - entry_points - helpers == set()
