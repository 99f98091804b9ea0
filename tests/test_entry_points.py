"""Every console script the package declares imports and explains itself."""

import argparse
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from helpers import hang_ups_by_default, long_ago, running, signals_by_default

DRAFTER = Path(__file__).resolve().parent.parent / "drafters" / "smollm2"
SCRIPTS = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]["scripts"]
BENCHMARKS = sorted(
    p for p in (Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py") if "\ndef main(" in p.read_text()
)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_console_script_answers_help(name):
    module, func = SCRIPTS[name].split(":")
    code = f"import sys; sys.argv = [{name!r}, '--help']; from {module} import {func}; {func}()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout and "--help" in done.stdout


def test_the_repository_files_each_benchmark_names_exist():
    """`benchmarks.bench_http` looked for its prompts beside itself after the benchmarks moved out of
    launch/, and failed before it measured anything (an audit)."""
    import importlib
    import pkgutil

    import benchmarks

    root = DRAFTER.parent.parent
    named = []
    for info in pkgutil.iter_modules(benchmarks.__path__):
        module = importlib.import_module(f"benchmarks.{info.name}")
        named += [(info.name, v) for v in vars(module).values() if isinstance(v, Path) and root in v.parents]
    assert any(name == "bench_http" for name, _ in named)
    assert [(name, str(path)) for name, path in named if not path.exists()] == []


@pytest.fixture(scope="module")
def taken_address():
    """An address something already listens on."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    sock.close(0)


LOG_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [\w.]+ (INFO|WARNING) ")
MISTAKES = [
    pytest.param(
        *("launch.target_daemon", ["--model", "/nowhere/model", "--proposer", "none"], "no config.json"),
        id="target-no-model",
    ),
    pytest.param(
        *("launch.target_daemon", ["--model", "DRAFTER", "--proposer", "none"], "is a DFlash drafter checkpoint"),
        id="target-model-is-a-drafter",
    ),
    pytest.param(
        *("launch.target_daemon", ["--model", "CHAT", "--proposer", "local", "--drafter-checkpoint", "EMPTY"]),
        "is not a drafter checkpoint",
        id="target-local-no-checkpoint",
    ),
    pytest.param(
        *("launch.target_daemon", ["--model", "CHAT", "--proposer", "local", "--drafter-checkpoint", "DRAFTER"]),
        "does not fit this target",
        id="target-local-drafter-of-another-target",
    ),
    pytest.param(
        *("launch.draft_daemon", ["--checkpoint", "EMPTY"], "is not a drafter checkpoint"), id="draft-no-checkpoint"
    ),
    pytest.param(
        *("launch.draft_daemon", ["--bind", "TAKEN"], "cannot listen on tcp://127.0.0.1:"), id="draft-address-taken"
    ),
    pytest.param(  # said so only once the model had loaded (an audit): here, before it looks for one
        *("launch.target_daemon", ["--bind", "TAKEN", "--model", "/nowhere/model", "--proposer", "none"]),
        "cannot listen on tcp://127.0.0.1:",
        id="target-address-taken",
    ),
    pytest.param(
        *("launch.target_daemon", ["--record", "FILE", "--model", "/nowhere/model", "--proposer", "none"]),
        "cannot write there",
        id="target-record-folder-a-file",
    ),
    pytest.param(
        *(
            "launch.client",
            ["--address", "tcp://127.0.0.1:9", "--prompt", "hi", "--timeout", "0.5"],
            "no target daemon answered a ping",
        ),
        id="client-nobody-there",
    ),
    pytest.param(
        *("launch.local", ["--model", "/nowhere/model", "--prompt", "hi"], "no config.json"), id="local-no-model"
    ),
    # Each ended in a traceback, or (a tensor missing) served nonsense from random weights (an audit).
    pytest.param(
        *("launch.target_daemon", ["--model", "LACKING"], "its weights lack 1 tensors the model needs"),
        id="target-tensor-missing",
    ),
    pytest.param(
        *("launch.target_daemon", ["--model", "NOT_JSON"], "its config.json does not load"), id="target-config-broken"
    ),
    pytest.param(  # its default drafter was looked for before the model loaded, outside the one-line errors
        *("launch.target_daemon", ["--model", "NOT_JSON", "--proposer", "local"], "its config.json does not load"),
        id="target-local-config-broken",
    ),
    pytest.param(*("launch.draft_daemon", ["--checkpoint", "DRAFT_NOT_JSON"], "is not JSON"), id="draft-config-broken"),
    pytest.param(  # its random drafter's config was read outside the one-line errors (an audit)
        *("launch.local", ["--model", "NOT_JSON", "--prompt", "hi"], "holds no model transformers can load"),
        id="local-config-broken",
    ),
    pytest.param("launch.serve", ["--model", "/nowhere/model"], "no config.json", id="serve-no-model"),
    pytest.param(
        *("launch.train", ["--stage", "train", "--model", "/nowhere/model"], "no config.json"), id="train-no-model"
    ),
    pytest.param("launch.keys", ["--out", "FILE", "client"], "File exists", id="keys-into-a-file"),
    pytest.param(
        *("benchmarks.evaluate", ["--model", "/nowhere/model", "--drafter", "EMPTY"], "no config.json"),
        id="evaluate-no-model",
    ),
    pytest.param(
        *("benchmarks.bench", ["--model", "/nowhere/model", "--skip-engines"], "no config.json"), id="bench-no-model"
    ),
    pytest.param(
        *("benchmarks.evaluate", ["--prompts", "TEXT", "--drafter", "EMPTY"], "line 1: expected a JSON object"),
        id="evaluate-prompts-not-jsonl",
    ),
    pytest.param(
        *("benchmarks.evaluate", ["--prompts", "FILE", "--drafter", "EMPTY"], "holds no prompts"),
        id="evaluate-no-prompts",
    ),
]


def broken_folders(tmp_path, model_dir, wanted) -> dict[str, str]:
    """Copies of a good model and drafter, each broken one way, for the names in `wanted`."""
    import shutil

    from safetensors.torch import load_file, save_file

    folders = {}
    if "LACKING" in wanted:
        folder = shutil.copytree(model_dir, tmp_path / "lacking")
        weights = load_file(folder / "model.safetensors")
        weights.pop(sorted(name for name in weights if "layers.0." in name)[0])
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        folders["LACKING"] = str(folder)
    if "NOT_JSON" in wanted:
        folder = shutil.copytree(model_dir, tmp_path / "not-json")
        (folder / "config.json").write_text("{not json")
        folders["NOT_JSON"] = str(folder)
    if "DRAFT_NOT_JSON" in wanted:
        folder = shutil.copytree(DRAFTER, tmp_path / "draft-not-json")
        (folder / "config.json").write_text("{not json")
        folders["DRAFT_NOT_JSON"] = str(folder)
    return folders


@pytest.mark.parametrize("module, args, says", MISTAKES)
def test_a_users_mistake_is_one_line_on_stderr_not_a_traceback(
    module, args, says, tmp_path, taken_address, chat_model_dir
):
    (tmp_path / "file").write_text("")
    (tmp_path / "prompts.txt").write_text("Explain tides.\n")
    places = {"EMPTY": str(tmp_path), "TAKEN": taken_address, "FILE": str(tmp_path / "file")}
    places.update(DRAFTER=str(DRAFTER), CHAT=str(chat_model_dir), TEXT=str(tmp_path / "prompts.txt"))
    places.update(broken_folders(tmp_path, chat_model_dir, args))
    args = [places.get(a, a) for a in args]
    done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120)
    *logged, last = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr[-2000:]
    assert says in last and last.startswith("dflash-"), done.stderr[-2000:]
    # The mistake is one line; what comes before it is the daemon's own log of its start (and
    # transformers' progress bar where a model loaded, and its report of weights it found lacking),
    # nothing else.
    report = next((i for i, line in enumerate(logged) if "LOAD REPORT" in line), len(logged))
    logged = logged[:report]
    assert all(LOG_RECORD.match(line) or line.startswith("Loading weights") for line in logged), done.stderr[-2000:]


def test_a_cache_that_cannot_take_the_default_model_is_one_line_before_any_conversion(tmp_path):
    """A read-only or full cache converted the default model for half a minute, then ended in a
    traceback (an audit): a cache under a file (one that no user, root included, can write) is
    refused at once, in one line that says what to do."""
    (tmp_path / "file").write_text("")
    env = {**os.environ, "DFLASH_SPLIT_CACHE": str(tmp_path / "file" / "cache")}
    argv = [sys.executable, "-m", "launch.target_daemon", "--proposer", "none"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith("dflash-target-daemon: error:"), done.stderr[-2000:]
    assert "cannot take it" in last and "DFLASH_SPLIT_CACHE" in last, last


@pytest.mark.parametrize("given, found", [("~/c", "home/c"), ("rel", "work/rel")])
def test_the_cache_is_one_absolute_folder_however_its_variable_is_written(tmp_path, given, found):
    """A literal `~` (systemd's Environment=) or a relative $DFLASH_SPLIT_CACHE made a cache per
    working directory for the models, drafters and indexes, while the kernels' was absolute (an
    audit): one rule for all now."""
    (tmp_path / "work").mkdir()
    env = {**os.environ, "DFLASH_SPLIT_CACHE": given, "HOME": str(tmp_path / "home")}
    show = "import target_node, dflash_kernels.build as b; print(target_node.CACHE_ROOT, b.KERNEL_CACHE)"
    root = str(DRAFTER.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", show], cwd=tmp_path / "work", env=env, capture_output=True, text=True)
    cache, kernels = done.stdout.split()
    assert cache == str(tmp_path / found) and kernels == str(tmp_path / found / "kernels"), done.stderr


def test_a_user_without_a_home_gets_a_cache_of_their_own_not_a_traceback(tmp_path, monkeypatch):
    """With no $HOME and no passwd entry (a container's arbitrary user) Path.home() raised at
    import and every command ended in a traceback; an empty HOME made the cache /.cache (an audit)."""
    import tempfile

    from basics.cache import cache_root

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    own = tmp_path / f"dflash-split-{os.getuid()}"
    for home in ("~", "relative/home"):
        assert cache_root(None, home) == own and own.stat().st_mode & 0o777 == 0o700
    assert cache_root(None, "/home/u") == Path("/home/u/.cache/dflash-split")
    assert cache_root("rel", "") == Path("rel").absolute()
    env = {**os.environ, "HOME": "", "TMPDIR": str(tmp_path), "PYTHONPATH": str(DRAFTER.parent.parent)}
    env.pop("DFLASH_SPLIT_CACHE", None)
    shown = subprocess.run([sys.executable, "-c", "import basics.cache as c; print(c.CACHE_ROOT)"], env=env,
                           capture_output=True, text=True)  # fmt: skip
    assert shown.stdout.strip() == str(own), shown.stderr
    own.chmod(0o777)  # another's to write in (or another user's, or a link): refused, not used
    with pytest.raises(PermissionError, match="not a folder of this user's alone"):
        cache_root(None, "")


def test_a_cache_without_room_for_the_default_model_is_refused_before_converting(tmp_path, monkeypatch):
    import shutil

    from target_node.model import default_model

    def converted(*_):
        raise AssertionError("the conversion started")

    monkeypatch.setattr(default_model, "_wheel_folder", converted)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10 << 30, 10 << 30, 100 << 20))
    with pytest.raises(default_model.DefaultModelError, match="100 MiB free, 560 MiB needed"):
        default_model.ensure_default_model(tmp_path / "models" / "SmolLM2")


def test_an_upgrade_mends_the_mode_of_the_model_an_older_version_converted_0600(tmp_path):
    """A model converted (safetensors: 0600) before its files were made as the umask allows stayed
    unreadable to the cache's other users after every upgrade (an audit): its next start mends it
    (the kernel library likewise: tests/test_kernel_build.py)."""
    from basics.files import umask
    from target_node.model import default_model

    model = tmp_path / "models" / "SmolLM2"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "model.safetensors").chmod(0o600)
    assert default_model.ensure_default_model(model) == model
    assert (model / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask()
    (model / "model.safetensors").chmod(0o640)  # opened to some by its owner, on purpose: kept (a review)
    assert default_model.ensure_default_model(model) == model
    assert (model / "model.safetensors").stat().st_mode & 0o777 == 0o640


def test_a_targets_random_drafter_is_one_per_shape_and_never_taken_half_written(tmp_path, monkeypatch, chat_model_dir):
    """Named by the target's path, every test session and every copy of a model added one for good;
    a save killed after its config left a drafter without weights, which every later start took
    and failed on (an audit)."""
    import shutil

    from draft_node.checkpoint import load_drafter
    from target_node.model import default_model

    monkeypatch.setattr(default_model, "RANDOM_DRAFTERS", tmp_path / "random")
    copy = tmp_path / "elsewhere" / chat_model_dir.name
    shutil.copytree(chat_model_dir, copy)
    first = default_model.ensure_default_drafter(chat_model_dir)
    assert default_model.ensure_default_drafter(copy) == first  # the same shape: the same drafter
    (first / "model.safetensors").unlink()  # as a save killed before its weights left it
    dead = first.with_name(f"{first.name}.{2**22 + 1}-7.partial")  # above any pid_max: a killed start's
    dead.mkdir()
    long_ago(dead)
    assert default_model.ensure_default_drafter(copy) == first and load_drafter(first) is not None
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]


def test_a_random_drafter_is_said_and_a_copy_of_the_default_model_gets_the_shipped_one(
    tmp_path, monkeypatch, chat_model_dir, caplog
):
    """Another model ran with a random drafter and said nothing: "proposer dflash", tau 1.00; and the
    default model copied elsewhere got a random drafter, not the one trained for it (an audit)."""
    from target_node.model import default_model

    monkeypatch.setattr(default_model, "RANDOM_DRAFTERS", tmp_path / "random")
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_DIR", tmp_path / "default")
    shutil.copytree(chat_model_dir, tmp_path / "default")
    with caplog.at_level("WARNING", logger="dflash"):
        assert default_model.ensure_default_drafter(tmp_path / "default") == default_model.SHIPPED_DRAFTER
        copy = tmp_path / "elsewhere" / "my-model"
        shutil.copytree(chat_model_dir, copy)
        assert default_model.ensure_default_drafter(copy) == default_model.SHIPPED_DRAFTER  # its config, byte for byte
        assert not caplog.records
        (copy / "config.json").write_text((copy / "config.json").read_text().replace("{", '{"note": 1, ', 1))
        assert default_model.ensure_default_drafter(copy).parent == tmp_path / "random"
    assert "no trained drafter for my-model: drafting with random weights" in caplog.text


def test_a_model_loaded_with_its_output_in_a_log_draws_no_progress_bar(chat_model_dir):
    """transformers' bar of weights loaded was a line of carriage returns in every start's log (an audit)."""
    script = "import sys, torch; from target_node.model.target import load_causal_lm; load_causal_lm("
    script += f"__import__('pathlib').Path({str(chat_model_dir)!r}), torch.float32); print('loaded')"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "loaded", done.stderr[-2000:]
    assert "Loading weights" not in done.stderr and "\r" not in done.stderr, done.stderr[-2000:]


def test_two_starts_on_a_fresh_cache_convert_the_default_model_once(tmp_path, monkeypatch):
    """Two processes converting at once wrote one partial folder: one failed with a traceback and
    538 MB stayed in the model's folder for good (an audit). One converts, the other waits and
    takes its model."""
    import threading
    import time

    from target_node.model import default_model

    converted = []

    def convert(folder, gguf_folder):  # as _convert does, slowly
        converted.append(folder)
        folder.mkdir()
        time.sleep(0.3)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(default_model, "_convert", convert)
    target, found = tmp_path / "models" / "SmolLM2", []

    def start() -> None:
        found.append(default_model.ensure_default_model(target))

    starts = [threading.Thread(target=start) for _ in range(2)]
    for start in starts:
        start.start()
    for start in starts:
        start.join(30)
    assert found == [target, target] and len(converted) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == [".lock", "SmolLM2"]


DAEMONS = ["launch.target_daemon", "launch.draft_daemon"]
REFUSED_FLAGS = [
    *[(module, ["--device", "gpu"], "'gpu' is not a torch device") for module in DAEMONS],
    *[(module, ["--device", "cuda:7"], "CUDA device") for module in DAEMONS],  # none here, or fewer than eight
    *[(module, ["--threads", "-1"], "must be at least 0, got -1") for module in DAEMONS],
    *[(module, ["--device", "meta"], "the daemons run on cpu or cuda[:N] devices") for module in DAEMONS],
    ("launch.train", ["--stage", "train", "--threads", "0"], "must be at least 1"),
    ("launch.draft_daemon", ["--dtype", "float16"], "take float32 or bfloat16"),  # was: a traceback from the kernels
    (
        "launch.draft_daemon",
        ["--bind", "localhost:5555"],
        "expected tcp://HOST:PORT",
    ),  # was: "reachable from other hosts"
    ("launch.draft_daemon", ["--bind", "tcp://127.0.0.1:99999"], "a port of 1-65535"),  # was: bound 34463, silently
    # A traceback; then a list of schemes that offered inproc://, which a peer's address is refused (an audit).
    ("launch.client", ["--address", "localhost:5556", "--prompt", "hi"], "expected a tcp://HOST:PORT or ipc://PATH"),
    # Each of these was refused only by the daemon, or ended in a ZeroMQ traceback (an audit).
    ("launch.client", ["--prompt", "hi", "--address", "tcp://localhost:*"], "a tcp://HOST:PORT or ipc://PATH to reach"),
    ("launch.client", ["--prompt", "hi", "--address", "tcp://*:5599"], "a tcp://HOST:PORT or ipc://PATH to reach"),
    ("launch.client", ["--prompt", "hi", "--json", "/nowhere/at/all.json"], "not a file in an existing folder"),
    ("launch.client", ["--prompt", "hi", "--address", "ipc:///" + "a" * 120], "an ipc path holds at most 107 bytes"),
    ("launch.local", ["--prompt", "hi", "--target-address", "inproc://t"], "a tcp://HOST:PORT or ipc://PATH to reach"),
    ("launch.client", ["--prompt", "hi", "--heartbeat", "0.001"], "heartbeat_s is 0 (none) or in [0.05, 3600] s"),
    ("launch.client", ["--prompt", "hi", "--stop", ""], "generate.stop[0]: expected str of 1..256 chars"),
    ("launch.client", ["--raw", "--prompt", ""], "prompt 1 is empty"),
    ("launch.serve", ["--target", "localhost:5556"], "expected a tcp://HOST:PORT or ipc://PATH"),  # was: 500s
    ("launch.serve", ["--allowed-hosts", "*.example.com"], "no wildcards"),  # taken, and matched nothing (a review)
    # Each of these was taken: a daemon that read nothing (not even pings), refused every request,
    # failed every prompt, or ended in a traceback once the model had loaded (an audit).
    ("launch.target_daemon", ["--max-messages-per-step", "0"], "--max-messages-per-step must be at least 1"),
    ("launch.target_daemon", ["--max-queued-per-client", "0"], "--max-queued-per-client must be at least 1"),
    ("launch.target_daemon", ["--prefill-chunk", "-1"], "--prefill-chunk must be 0 or more"),
    ("launch.target_daemon", ["--proposer", "local", "--ring-capacity", "0"], "--ring-capacity must be in 1..1048576"),
    ("launch.target_daemon", ["--draft-timeout", "0"], "--draft-timeout must be above 0"),
    ("launch.target_daemon", ["--draft-retry", "0"], "--draft-retry must be above 0"),
    ("launch.target_daemon", ["--predraft", "99"], "--predraft names 0 to 16 outcomes, got 99"),  # a traceback
    ("launch.serve", ["--port", "70000"], "a port of 1-65535"),  # was: three tracebacks from uvicorn's bind
    # Each of these started, then failed once the model had loaded or at the first request, measured
    # for minutes, or meant something else without a word (an audit of option combinations).
    ("launch.target_daemon", ["--tree-nodes", "100000"], "--tree-nodes must be at most 256, got 100000"),
    ("launch.target_daemon", ["--prefix-cache-mb", "nan"], "--prefix-cache-mb must be a finite number, got nan"),
    ("launch.target_daemon", ["--draft-timeout", "inf"], "--draft-timeout must be a finite number, got inf"),
    ("launch.draft_daemon", ["--keep-mb", "inf"], "--keep-mb must be a finite number, got inf"),
    ("launch.draft_daemon", ["--ring-capacity", "2000000"], "--ring-capacity must be at most 1048576"),
    ("launch.target_daemon", ["--drafter-checkpoint", "x"], "--drafter-checkpoint: not used with --proposer remote"),
    (
        "launch.target_daemon",
        ["--proposer", "none", "--predraft", "4", "--always-draft"],
        "--predraft, --always-draft: not used with --proposer none",
    ),
    ("launch.target_daemon", ["--no-lookup", "--datastore", "none"], "--datastore: not used with --no-lookup"),
    ("launch.serve", ["--log-level", "garbage"], "invalid choice: 'garbage'"),  # was: a KeyError once models loaded
    ("launch.train", ["--stage", "train", "--taps", "x,y"], "expected layer ids such as 3,10,17"),
    ("launch.train", ["--stage", "train", "--block-size", "500"], "must be at most 128, got 500"),
    ("launch.train", ["--device", "garbage"], "'garbage' is not a torch device"),
    # Said without the command's name, after torch had loaded (an audit).
    ("launch.train", ["--stage", "average", "--init", "A"], "--stage average needs --init A and --average-with B"),
    ("launch.train", ["--stage", "grow", "--layers", "2"], "--stage grow needs --init A"),
    ("launch.keys", ["--out", "/nowhere", "../escape"], "a key name is a plain file name"),
    # Was: a server whose every chat naming no max_tokens got a 400 blaming the client (an audit).
    ("launch.serve", ["--default-max-tokens", "0"], "must be at least 1, got 0"),
    ("launch.serve", ["--daemon-timeout", "0"], "must be more than 0"),
    # Each of these went unused without a word: a link left plaintext, a flag of the other mode (an audit).
    ("launch.serve", ["--target", "tcp://127.0.0.1:1", "--curve-key", "k"], "--curve-key needs --server-key"),
    ("launch.client", ["--curve-key", "k", "--prompt", "hi"], "--curve-key needs --server-key"),
    ("launch.target_daemon", ["--curve-key", "k"], "--curve-key needs --curve-allow"),
    ("launch.serve", ["--curve-key", "k", "--server-key", "s"], "--curve-key and --server-key go with --target"),
    ("launch.serve", ["--target", "tcp://127.0.0.1:1", "--curve", "--threads", "2"], "--threads, --curve: for all"),
    # Each passed the parser: a traceback from ZeroMQ, or "No such device" and a 5 s wait for nothing (an audit).
    ("launch.client", ["--prompt", "hi", "--address", "tcp://127.0.0.1:\u0665\u0665\u0665"], "a port of 1-65535"),
    ("launch.serve", ["--port", "\u0665\u0665"], "a port of 1-65535"),
    ("launch.target_daemon", ["--bind", "tcp://::1:5556"], "an IPv6 host goes in brackets"),
    ("launch.draft_daemon", ["--bind", "tcp://127.0.0.1 :5555"], "an address holds no spaces"),
    # A target daemon that would draft with itself: its hello to itself went unanswered for ever (an audit).
    (
        "launch.target_daemon",
        ["--bind", "tcp://127.0.0.1:5600", "--drafter", "tcp://localhost:5600"],
        "own --bind: the draft daemon",
    ),
]


# What the commands that import torch and transformers (3 s a start) check before they start,
# asked in this process; each command's main asks it first (the test after).
CHECKED_IN_PROCESS = {
    "launch.target_daemon": "checked_command",
    "launch.draft_daemon": "checked_command",
    "launch.train": "parse_args",
}


@pytest.mark.parametrize("module, args, says", REFUSED_FLAGS)
def test_a_flag_no_machine_can_honour_is_refused_by_the_parser(module, args, says, capsys):
    """Before, --device cuda:0 without CUDA and --threads -1 loaded the model and then ended in a
    traceback from deep inside torch (an audit of the commands)."""
    if module not in CHECKED_IN_PROCESS:
        done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and says in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]
        return
    checked = getattr(importlib.import_module(module), CHECKED_IN_PROCESS[module])
    with pytest.raises(SystemExit) as refused:
        checked(args)
    stderr = capsys.readouterr().err
    assert refused.value.code == 2 and says in stderr.strip().splitlines()[-1], stderr[-2000:]


@pytest.mark.parametrize("module", sorted(CHECKED_IN_PROCESS))
def test_each_command_checked_in_process_refuses_so_when_run(module):
    """The command itself refuses as its check does, at once: its main asks the check first."""
    module, args, says = next(row for row in REFUSED_FLAGS if row[0] == module)
    done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and says in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]


def test_every_console_script_is_tried_with_a_users_mistake():
    tried = {case.values[0] for case in MISTAKES}
    assert {target.split(":")[0] for target in SCRIPTS.values()} <= tried


def test_launch_holds_only_entry_points_and_their_helpers():
    """Benchmarks, harnesses and library code live elsewhere: launch/ is where a user starts a command."""
    launch = Path(__file__).resolve().parent.parent / "launch"
    entry_points = {target.split(":")[0] for target in SCRIPTS.values() if target.startswith("launch.")}
    helpers = {"launch.__init__", "launch.common", "launch.net", "launch.processes"}
    modules = {f"launch.{path.stem}" for path in launch.glob("*.py")}
    assert modules - entry_points - helpers == set()


def test_a_training_run_writes_its_drafter_beside_its_state_unless_told_where(tmp_path):
    """The default --out was the shipped drafter's folder: a run without --out overwrote it (an audit)."""
    from launch.train import parse_args, run_options

    args = parse_args(["--stage", "train", "--name", "trial", "--cache", str(tmp_path)])
    assert args.out == str(tmp_path / "train" / "trial" / "drafter")
    assert run_options(args).training.out == tmp_path / "train" / "trial" / "drafter"
    assert parse_args(["--stage", "train", "--out", str(tmp_path / "mine")]).out == str(tmp_path / "mine")


class _Parsed(Exception):
    """Raised in place of parsing: carries the parser a command built."""


def _parser_of(target: str, monkeypatch) -> argparse.ArgumentParser:
    import importlib

    def capture(self, *args, **kwargs):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    module, func = target.split(":")
    with pytest.raises(_Parsed) as parsed:
        getattr(importlib.import_module(module), func)([])
    return parsed.value.args[0]


# Every benchmark's main too: the docs send users to them, and 33 of their flags had no help.
COMMANDS = {**SCRIPTS, **{f"benchmarks.{p.stem}": f"benchmarks.{p.stem}:main" for p in BENCHMARKS}}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_flag_that_takes_a_value_says_what_it_does_and_its_default(name, monkeypatch):
    """`--help` is the manual: a flag left without help, or whose default a user cannot see, is a
    flag a user must read the source for."""
    parser = _parser_of(COMMANDS[name], monkeypatch)
    formatter = parser._get_formatter()
    silent, no_default = [], []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if not action.help:
            silent.append(action.option_strings[-1])
        elif action.nargs != 0 and action.default is not None and "default" not in formatter._expand_help(action):
            no_default.append(action.option_strings[-1])
    assert silent == [] and no_default == [], f"no help: {silent}; default not shown: {no_default}"


def test_a_prompts_file_line_is_a_json_records_prompt_or_the_line_itself(tmp_path):
    """A plain prompt that starts with a brace ended the client in a JSONDecodeError traceback
    (an audit); a JSON line without its "prompt" ended in a KeyError one."""
    from launch.client import prompts_given

    good = tmp_path / "good.txt"
    good.write_text('{curly braces are fun}\n\n{"prompt": "from JSON"}\nplain\n{"prompt": "{nested}"}\n')
    args = argparse.Namespace(prompt=["given"], prompts_file=str(good))
    assert prompts_given(args) == ["given", "{curly braces are fun}", "from JSON", "plain", "{nested}"]
    bad = tmp_path / "bad.txt"
    bad.write_text('hello\n{"text": "no prompt key"}\n')
    with pytest.raises(SystemExit, match=r"bad.txt:2: a JSON line needs a \"prompt\" string"):
        prompts_given(argparse.Namespace(prompt=None, prompts_file=str(bad)))


def test_a_sigterm_to_the_all_in_one_launcher_stops_both_daemons(chat_model_dir):
    """systemd, docker stop and kill send SIGTERM: it ended dflash-local alone and left both
    daemons running, holding their ports (an audit)."""
    import signal
    import time

    run = subprocess.Popen(
        [sys.executable, "-m", "launch.local", "--model", str(chat_model_dir), "--prompt", "hi"]
        + ["--max-new-tokens", "1800", "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids = []
    try:
        for line in run.stdout:
            if "ready at" in line:
                pids.append(int(re.search(r"\(pid (\d+)\)", line).group(1)))
            if "target daemon ready" in line:
                break
        assert len(pids) == 2, pids
        run.send_signal(signal.SIGTERM)
        assert run.wait(60) == 143
    finally:
        run.kill()
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if running(pid)]
        time.sleep(0.2)
    assert not alive, f"daemons left running: {alive}"


SCRIPT_STARTING_A_DAEMON = """
import sys, time
from launch.local import daemon, free_address
from launch.processes import ends_on_sigterm

@ends_on_sigterm
def main():
    flags = ["--checkpoint", sys.argv[1], "--threads", "1"]
    with daemon("draft daemon", "launch.draft_daemon", free_address(), flags, 120) as p:
        print("started", p.pid, flush=True)
        time.sleep(600)

main()
"""


@pytest.mark.parametrize("ending, code", [("SIGTERM", 143), ("SIGHUP", 129), ("SIGKILL", -9)])
def test_a_script_that_starts_a_daemon_stops_it_however_the_script_ends(tmp_path, ending, code):
    """Only dflash-local turned SIGTERM into an orderly exit: a benchmark killed with SIGTERM
    (soak, flood, bench_serving) left its daemons running with no parent (an audit). Each
    script's main now ends on SIGTERM through the code that stops them; SIGHUP (a terminal
    closed) and SIGKILL left dflash-local's daemons serving, 2.3 GB (an audit): a hang-up ends
    as SIGTERM does, and a daemon gets SIGTERM when the process that started it dies."""
    import signal
    import time

    from helpers import drafter_config

    from draft_node.checkpoint import random_drafter, save_drafter

    checkpoint = save_drafter(random_drafter(drafter_config()), tmp_path / "drafter")
    run = subprocess.Popen(
        [sys.executable, "-c", SCRIPT_STARTING_A_DAEMON, str(checkpoint)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=DRAFTER.parent.parent,
        preexec_fn=hang_ups_by_default,
    )
    pid = None
    try:
        for line in run.stdout:
            if line.startswith("started"):
                pid = int(line.split()[1])
                break
        assert pid is not None and running(pid)
        run.send_signal(getattr(signal, ending))
        assert run.wait(60) == code
    finally:
        run.kill()
    deadline = time.monotonic() + 20
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(pid), "the daemon outlived the script that started it"


def test_only_a_scripts_main_ends_on_sigterm_and_the_handlers_come_back_after_it(tmp_path):
    """Set by the library's daemon(), the handler stayed for good: a test run that started a
    daemon ignored SIGTERM and Ctrl-C after one of them (a review). The daemon leaves the
    handlers alone; a script's main has them back as it found them when it ends."""
    import signal

    from helpers import draft_daemon, drafter_config

    from draft_node.checkpoint import random_drafter, save_drafter
    from launch.processes import ends_on_sigterm

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    checkpoint = save_drafter(random_drafter(drafter_config()), tmp_path / "drafter")
    with draft_daemon(f"ipc://{tmp_path}/d.sock", checkpoint):
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    seen = []

    @ends_on_sigterm
    def main() -> str:
        seen.append(signal.getsignal(signal.SIGTERM))
        return "done"

    assert main() == "done" and seen[0] not in (before[0], signal.SIG_IGN)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_the_flood_benchmark_refuses_a_long_prompt_the_model_cannot_hold(chat_model_dir, capsys):
    """A prompt past the model's context was refused by the daemon at once, so the flood met no
    long step and yet passed (an audit); now it is refused before any daemon starts."""
    from benchmarks import flood

    context = json.loads((chat_model_dir / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(SystemExit) as ended:
        flood.main(["--model", str(chat_model_dir), "--only", "flood", "--prompt-tokens", str(context)])
    assert ended.value.code == 2 and "holds" in capsys.readouterr().err


def _fake_venv(folder: Path, pip_works: bool = True, index: str = "exit 0", installed_from: str | None = None) -> Path:
    """A venv whose python logs its arguments (and has pip or not, and whose `-m answers.index`
    runs `index`), stamped as set up (from this checkout, or `installed_from`): what launch/*.sh
    run, without installing anything."""
    root = DRAFTER.parent.parent
    bin_ = folder / "bin"
    bin_.mkdir(parents=True)
    pip = "exit 0" if pip_works else '[ -f "$(dirname "$0")/../pip-installed" ] || exit 1'
    script = f"""#!/usr/bin/env bash
echo "$@" >> "$(dirname "$0")/../calls"
echo "$PWD" > "$(dirname "$0")/../cwd"
if [ "$1 $2" = "-m pip" ] && [ "$3" = "--version" ]; then {pip}; fi
if [ "$1 $2" = "-m ensurepip" ]; then touch "$(dirname "$0")/../pip-installed"; fi
if [ "$1 $2" = "-m answers.index" ]; then {index}; fi
"""
    for name in ("python", "ruff"):
        (bin_ / name).write_text(script)
        (bin_ / name).chmod(0o755)
    import hashlib

    installed = (root / "pyproject.toml").read_bytes() + (root / "launch/setup_env.sh").read_bytes()
    stamp = hashlib.sha256(installed + f"{installed_from or root}\n".encode())
    (folder / ".dflash-split-installed").write_text(stamp.hexdigest() + "\n")
    return folder


def test_the_demo_takes_the_callers_venv_and_its_own_prompts_replace_the_demos(tmp_path):
    """demo.sh ran .venv/bin/python whatever DFLASH_VENV said, and always added its prompts file,
    so `--prompt Hi` answered Hi and the three demo prompts (an audit)."""
    import os

    venv = _fake_venv(tmp_path / "venv")
    env = dict(os.environ, DFLASH_VENV=str(venv))
    for extra, demo_prompts in ((["--prompt", "Hi"], False), (["--max-new-tokens", "5"], True)):
        (venv / "calls").unlink(missing_ok=True)
        subprocess.run(["bash", str(DRAFTER.parent.parent / "launch/demo.sh"), *extra], env=env, check=True)
        run = (venv / "calls").read_text().splitlines()[-1]
        assert run.startswith("-m launch.local") and run.endswith(" ".join(extra))
        assert ("demo_prompts.txt" in run) == demo_prompts


def test_the_demo_reads_and_writes_the_callers_relative_paths_where_the_caller_is(tmp_path, monkeypatch):
    """demo.sh changed into the repository: `--prompts-file mine.txt --json out.json` looked for
    the prompts, and wrote the answers, there (an audit)."""
    venv = _fake_venv(tmp_path / "venv")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    env = dict(os.environ, DFLASH_VENV=str(venv))
    demo = [str(DRAFTER.parent.parent / "launch/demo.sh"), "--json", "out.json", "--prompts-file", "mine.txt"]
    subprocess.run(["bash", *demo], env=env, check=True)
    assert (venv / "cwd").read_text().strip() == str(tmp_path / "work")


def test_the_demo_goes_on_without_the_datastores_index_where_it_cannot_be_built(tmp_path):
    venv = _fake_venv(tmp_path / "venv", index="exit 1")
    env = dict(os.environ, DFLASH_VENV=str(venv))
    demo = [str(DRAFTER.parent.parent / "launch/demo.sh"), "--prompt", "Hi"]
    done = subprocess.run(["bash", *demo], env=env, capture_output=True, text=True, check=True)
    assert (venv / "calls").read_text().splitlines()[-1].startswith("-m launch.local")
    assert "going on without the datastore's index" in done.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_demo_stopped_while_it_indexes_stops_its_indexer(tmp_path, signum):
    """SIGTERM to the demo's script ended it and left its indexer running, orphaned (an audit)."""
    venv = _fake_venv(tmp_path / "venv", index='echo $$ > "$(dirname "$0")/../indexer"; exec sleep 60')
    env = dict(os.environ, DFLASH_VENV=str(venv))
    demo = subprocess.Popen(
        ["bash", str(DRAFTER.parent.parent / "launch/demo.sh")], env=env, preexec_fn=signals_by_default
    )
    deadline = time.monotonic() + 30
    while not (venv / "indexer").is_file() or not (venv / "indexer").read_text().strip():
        assert time.monotonic() < deadline and demo.poll() is None, "the indexer never started"
        time.sleep(0.05)
    indexer = int((venv / "indexer").read_text())
    demo.send_signal(signum)
    assert demo.wait(30) == 128 + signum
    while running(indexer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(indexer), "the indexer outlived the demo"
    assert "-m launch.local" not in (venv / "calls").read_text()


def test_a_venv_another_checkout_installed_is_installed_again_from_this_one(tmp_path):
    """The stamp named what was installed, not from where: a second checkout sharing $DFLASH_VENV
    found it and ran the first checkout's code (an audit). A CPU machine asks PyTorch's index for
    torch (PyPI's Linux wheel is the CUDA build)."""
    root, other = DRAFTER.parent.parent, tmp_path / "other"
    (other / "launch").mkdir(parents=True)  # a second checkout of the same files
    shutil.copy(root / "pyproject.toml", other)
    shutil.copy(root / "launch/setup_env.sh", other / "launch")
    venv = _fake_venv(tmp_path / "venv", installed_from=str(other))
    env = {k: v for k, v in os.environ.items() if k != "PIP_INDEX_URL"}
    env.update(DFLASH_VENV=str(venv), PATH=f"{tmp_path / 'no-gpu'}:/usr/bin:/bin")
    subprocess.run(["bash", str(other / "launch/setup_env.sh")], env=env, check=True)
    assert not (venv / "calls").read_text().count(" install ")  # installed from there: its stamp says so
    subprocess.run(["bash", str(root / "launch/setup_env.sh")], env=env, check=True)
    calls = (venv / "calls").read_text().splitlines()
    assert any(call.endswith(f"-e {root}[test,default-model]") for call in calls), calls
    (torch,) = [call for call in calls if call.endswith("torch==2.13.0")]
    gpu = shutil.which("nvidia-smi", path=env["PATH"]) or os.path.exists("/proc/driver/nvidia")
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in torch or gpu
    calls_before = len(calls)
    subprocess.run(["bash", str(root / "launch/setup_env.sh")], env=env, check=True)
    assert not any("install" in call for call in (venv / "calls").read_text().splitlines()[calls_before:])


def test_a_python_older_than_3_11_is_refused_in_words(tmp_path):
    """3.10 ran without PYTHONSAFEPATH (a module in the caller's folder replaced the project's)
    and without tomllib; a 3.9 failed in pip's resolver, in other words (an audit)."""
    old = tmp_path / "python3.9"
    old.write_text('#!/usr/bin/env bash\n[ "$1" = "-V" ] && echo "Python 3.9.18"; exit 1\n')
    old.chmod(0o755)
    env = dict(os.environ, DFLASH_VENV=str(tmp_path / "venv"), PYTHON=str(old))
    done = subprocess.run(["bash", str(DRAFTER.parent.parent / "launch/setup_env.sh")], env=env, capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 1 and "Python 3.9.18; 3.11 or newer is needed" in done.stderr, done.stderr
    assert not (tmp_path / "venv").exists()
    # A folder whose python is too old and that is no venv ($DFLASH_VENV=/usr/local) is left alone:
    # the first version of this check removed whatever the variable named (a review).
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    shutil.copy(old, tmp_path / "venv" / "bin" / "python")
    (tmp_path / "venv" / "precious").write_text("mine")
    env["PYTHON"] = sys.executable
    done = subprocess.run(["bash", str(DRAFTER.parent.parent / "launch/setup_env.sh")], env=env, capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 1 and "is no venv: set DFLASH_VENV elsewhere" in done.stderr, done.stderr
    assert (tmp_path / "venv" / "precious").read_text() == "mine"


def test_a_venv_left_without_pip_by_an_interrupted_setup_gets_pip_back(tmp_path):
    """A first run stopped during ensurepip left bin/python without pip, and every later run
    failed with `No module named pip` (an audit)."""
    import os

    venv = _fake_venv(tmp_path / "venv", pip_works=False)
    env = dict(os.environ, DFLASH_VENV=str(venv))
    subprocess.run(["bash", str(DRAFTER.parent.parent / "launch/setup_env.sh")], env=env, check=True)
    assert "-m ensurepip --upgrade" in (venv / "calls").read_text().splitlines()
    assert (venv / "pip-installed").exists()


@pytest.mark.parametrize(
    "flags, says",
    [
        ([], "no prompts"),
        (["--prompts-file", "/nonexistent/prompts.txt"], "No such file"),
        (["--prompt", "hi", "--max-new-tokens", "-3"], "at least 1"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--top-p", "0"], "top_p"),
        (["--prompt", "hi", "--ready-timeout", "-5"], "more than 0"),
        (["--prompt", "hi", "--timeout", "0"], "more than 0"),
        (["--prompt", "hi", "--target-device", "tpu:7"], "torch device"),
    ],
)
def test_the_all_in_one_launcher_refuses_bad_client_values_before_it_loads_a_model(flags, says, capsys, monkeypatch):
    """It loaded both models (10-15 s with tiny ones) before it said "no prompts" or passed a
    negative length to the daemon (an audit)."""
    from launch import local

    monkeypatch.setattr(local, "local_daemons", lambda args: pytest.fail("started daemons"))
    with pytest.raises(SystemExit) as ended:
        local.main(["--model", "/nonexistent", *flags])
    assert ended.value.code == 2 and says in capsys.readouterr().err


def test_every_commands_flags_are_checked_without_torch():
    """A device flag's check imported torch for the default "cpu": `dflash-serve --target` (a
    front end alone, which never loads a model) took 2.4 s and 220 MB to parse (a review); each
    daemon's --help, and every refusal of its flags, took 2-3.5 s of imports (an audit)."""
    script = (
        "import sys\nfrom launch.serve import build_parser\n"
        "build_parser().parse_args(['--target', 'tcp://127.0.0.1:5555'])\n"
        "from launch import draft_daemon, target_daemon, train\n"
        "target_daemon.checked_command(['--proposer', 'local', '--predraft', '2'])\n"
        "draft_daemon.checked_command(['--max-sessions', '4'])\n"
        "train.parse_args(['--stage', 'train', '--layers', '2'])\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=DRAFTER.parent.parent)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


def test_a_daemon_stops_on_sigint_and_sigterm_even_where_started_ignoring_them_but_keeps_nohups_hang_ups():
    """A daemon started with `&` from a script inherits SIGINT ignored: `kill -INT` had to stop it,
    and did until the nohup rule for SIGHUP was applied to every signal (a review)."""
    import signal

    from launch.processes import stop_on_signals

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for s in before:
            signal.signal(s, signal.SIG_IGN)
        stop_on_signals()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN  # as under nohup
        for s in (signal.SIGINT, signal.SIGTERM):
            assert callable(signal.getsignal(s)), s
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_a_second_signal_arriving_inside_the_firsts_handler_does_not_hang_the_daemon():
    """Python runs a signal's handler between any two bytecodes, another's too: a SIGHUP whose
    handler ran inside a SIGTERM's stop.set() waited for the lock that one held, for good (a daemon
    hung in 1 of 6 runs of the test below once SIGHUP was handled)."""
    import signal
    import threading

    from launch.processes import stop_on_signals

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        stop = stop_on_signals()
        handler = signal.getsignal(signal.SIGTERM)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    handler(signal.SIGTERM, None)
    assert stop.is_set()

    def inside_the_first():  # as if the second arrived while the first held the event's lock
        with stop._cond:
            handler(signal.SIGHUP, None)

    nested = threading.Thread(target=inside_the_first, daemon=True)
    nested.start()
    nested.join(5)
    assert not nested.is_alive()


def test_a_daemon_started_from_a_folder_holding_a_module_of_the_projects_name_imports_the_projects(
    tmp_path, monkeypatch
):
    """`python -m` put the working directory first on a daemon's path: a user's `basics.py` there
    was imported in place of the project's, and dflash-local's draft daemon died (an audit)."""
    from launch.local import daemon

    for name in ("basics", "protocol", "draft_node"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('the user´s module, not the project´s')\n")
    monkeypatch.chdir(tmp_path)
    address = f"ipc://{tmp_path}/draft.sock"
    with daemon("draft daemon", "launch.draft_daemon", address, ["--checkpoint", str(DRAFTER), "--threads", "1"], 120):
        pass


def test_a_drafter_address_is_the_daemons_own_only_where_it_reaches_that_socket():
    """The first check refused two distinct sockets (127.0.0.2 and 127.0.0.1, [::1] and 127.0.0.1)
    and missed `[::]`, which listens everywhere; ZeroMQ's SOURCE;DESTINATION form was refused (a review)."""
    from launch.net import address, reaches_itself

    assert reaches_itself("tcp://[::]:5600", "tcp://localhost:5600")
    assert reaches_itself("tcp://*:5600", "tcp://127.0.0.1:5600")
    assert not reaches_itself("tcp://127.0.0.2:5600", "tcp://127.0.0.1:5600")
    assert not reaches_itself("tcp://[::1]:5600", "tcp://127.0.0.1:5600")
    assert not reaches_itself("tcp://*:5600", "tcp://10.0.0.1:5600")
    assert address("tcp://127.0.0.1:5000;127.0.0.1:5555") == "tcp://127.0.0.1:5000;127.0.0.1:5555"


def test_the_ports_a_launcher_picks_are_never_the_same_twice():
    """Two picks in a row got the same port from the kernel about once in 6,700 (3 of 20,000 pairs):
    dflash-local's two daemons were then given one address, and the run failed (an audit)."""
    from launch.local import free_port

    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)
