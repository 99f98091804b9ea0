"""The soak test's short form: clients that behave, cancel, die or fall silent against both
daemons while the drafter is stopped and restarted, through a small prefix cache that evicts;
nothing lost, wrong or duplicated."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import soak


def test_a_short_soak_loses_nothing_and_every_greedy_output_is_its_own(tmp_path):
    out = tmp_path / "soak.json"
    command = [sys.executable, "-m", "benchmarks.soak", "--tiny", "--seconds", "16", "--clients", "4"]
    # Faults at about 3 s and 9 s (the first lasts 3 s): a third would need to start by 11 s, 5 s before the end.
    # 20 s gave every count below 5 to 10 times its bar (identical 102, cancelled 32, died 58, silent 53).
    command += ["--chaos-every", "3", "--max-batch", "4", "--json", str(out)]
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**os.environ, "TMPDIR": str(temporary)}
    # torch makes this folder (empty) wherever a process imports transformers' models, and writes its
    # variable into that process's environment: in the whole suite this one already had, and the soak's
    # processes inherited it; run alone, the test found the folder in TMPDIR and failed.
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torchinductor"))
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["wrong"] == report["lost"] == report["duplicates"] == 0
    # Passed, it leaves nothing behind (each run left 0.9 MB of models and logs in /tmp: an audit).
    assert report["logs"] is None and not list(temporary.iterdir())
    assert report["identical"] > 10 and report["cancelled"] > 0 and report["died"] > 0
    assert report["dropped_silent"] > 0  # a silent client's running request ends, and says so
    assert [f["fault"] for f in report["faults"]] == ["drafter stopped 3 s", "drafter killed and restarted"]
    assert report["ping_max_ms"] <= 250  # during the drafter's faults too
    cache = report["prefix_cache"]  # a small one: requests started from stored rows while others were evicted
    assert cache["hits"] > 0 and cache["evicted"] > 0 and cache["bytes"] <= cache["max_bytes"]


def test_a_target_that_will_not_start_leaves_no_draft_daemon_behind(tmp_path, monkeypatch):
    spawned = []

    def spawn(*args, **kwargs):
        spawned.append(real(*args, **kwargs))
        return spawned[-1]

    real = soak.start_daemon
    monkeypatch.setattr(soak, "start_daemon", spawn)
    model, checkpoint = soak.tiny_pair(tmp_path)
    (model / "config.json").write_text("{}")  # the target daemon refuses it and exits
    args = soak.parse_args(["--tiny", "--seconds", "1"])
    with pytest.raises(SystemExit, match="target daemon exited with code 1 before it was ready"):
        soak.start_daemons(args, model, checkpoint, tmp_path)
    assert len(spawned) == 1 and spawned[0].poll() is not None  # the draft daemon started, and is gone
