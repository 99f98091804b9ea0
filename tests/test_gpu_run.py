"""The one-shot GPU script runs end to end on CPU in its tiny mode, and records every phase."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # it converts SmolLM2 once for its tokenizer, like the other real-model tests
def test_tiny_mode_runs_every_phase(tmp_path):
    env = dict(os.environ, DFLASH_GPU_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1", PYTHON=sys.executable)
    out = tmp_path / "out"
    done = subprocess.run(
        [
            "bash",
            str(ROOT / "launch" / "gpu_run.sh"),
            str(out),
            "--tiny",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--minutes",
            "4",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    phases = results["phases"]
    assert list(phases) == [
        "tests",
        "invariance",
        "exactness",
        "bench",
        "batching",
        "draft_batch",
        "gen",
        "train",
        "eval",
    ]
    assert all(p["ok"] for p in phases.values()), {k: p.get("error") for k, p in phases.items()}
    assert phases["tests"]["returncode"] == 0  # on CPU: collected and skipped
    assert phases["invariance"]["returncode"] == 0, phases["invariance"]["output"]
    exact = phases["exactness"]["targets"]
    assert set(exact) == {f"{d} {p}" for d in ("bfloat16", "float32") for p in ("engine", "transformers path")}
    assert all(n == 0 for name, row in exact.items() if "engine" in name for n in row["differs"].values())
    assert phases["bench"]["mismatches"] == 0 and set(phases["bench"]["modes"]) >= {"plain", "chain", "adaptive"}
    drafts = phases["draft_batch"]["rows"]
    assert {r["sessions"] for r in drafts} == {1, 4} and all(r["batched_in_one_pass"] for r in drafts)
    rounds = phases["batching"]["rounds"]
    assert set(rounds) == {f"{k} x{b}" for k in ("plain", "dflash") for b in (1, 3)}
    assert all(r["differs"] == 0 for r in rounds.values()) and rounds["dflash x3"]["drafted_steps"] > 0
    assert phases["gen"]["answers"] > 0 and list((out / "answers").glob("*.jsonl.gz"))
    assert (out / "drafter" / "model.safetensors").is_file()
    assert json.loads((out / "drafter" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    compared = {k: v for k, v in phases["eval"].items() if k in ("shipped", "new")}
    assert len(compared) == 2 and all(m["mismatches"] == 0 and m["tau"] >= 1.0 for m in compared.values())
    assert (out / "log.txt").read_text().count("== ") == len(phases)
