"""The one-shot GPU script runs end to end on CPU in its tiny mode, and records every phase."""

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks import gpu_run

ROOT = Path(__file__).resolve().parent.parent


def run_tiny(tmp_path: Path, *flags: str) -> tuple[Path, dict]:
    """`launch/gpu_run.sh OUT --tiny ...` as the device machine runs it, on CPU: OUT and its results."""
    env = dict(os.environ, DFLASH_GPU_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1", PYTHON=sys.executable)
    env["TMPDIR"] = str(tmp_path)  # torchrun's folders (torchelastic_*) were left in /tmp, one a run
    out = tmp_path / "out"
    command = ["bash", str(ROOT / "launch" / "gpu_run.sh"), str(out), "--tiny", "--device", "cpu", "--threads", "1"]
    done = subprocess.run([*command, *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow  # it converts SmolLM2 once for its tokenizer, like the other real-model tests
def test_tiny_mode_runs_every_phase(tmp_path):
    out, results = run_tiny(tmp_path, "--minutes", "4", "--format", "dflash2")  # the default is dflash
    phases = results["phases"]
    assert list(phases) == [
        "tests",
        "invariance",
        "exactness",
        "bench",
        "split",
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
    split = phases["split"]
    assert split["mismatches"] == 0 and set(split["modes"]) >= {"chain", "chain@baseline", "chain@predraft"}
    assert [row["batch"] for row in split["overlap"]] == [1, 2] and split["overlap"][1]["halves_tok_s"] > 0
    drafts = phases["draft_batch"]["rows"]
    assert {r["sessions"] for r in drafts} == {1, 4} and all(r["batched_in_one_pass"] for r in drafts)
    rounds = phases["batching"]["rounds"]
    assert set(rounds) == {f"{k} x{b}" for k in ("plain", "dflash") for b in (1, 3)}
    assert all(r["differs"] == 0 for r in rounds.values()) and rounds["dflash x3"]["drafted_steps"] > 0
    assert phases["gen"]["answers"] > 0 and list((out / "answers").glob("*.jsonl.xz"))
    assert (out / "drafter" / "model.safetensors").is_file()
    assert json.loads((out / "drafter" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    compared = {k: v for k, v in phases["eval"].items() if k in ("shipped", "new")}
    assert len(compared) == 2 and all(m["mismatches"] == 0 and m["tau"] >= 1.0 for m in compared.values())
    assert (out / "log.txt").read_text().count("== ") == len(phases)


@pytest.mark.slow
def test_tiny_drafter_plan_trains_one_drafter_per_depth_and_compares_them(tmp_path):
    """--plan drafter: a drafter per --layers entry on features the target computes for each batch
    (grown from the shipped one, distilled from the target's distribution), then every drafter scored
    offline and live against the shipped one."""
    store = tmp_path / "store"
    store.mkdir()
    shutil.copy(ROOT / "data" / "answers" / "20261201-063342-f8af9b02.jsonl.xz", store)  # 35 answers
    flags = ["--minutes", "1.5", "--format", "dflash", "--plan", "drafter", "--layers", "1,2", "--store", str(store)]
    flags += ["--distill", "0.5"]
    out, results = run_tiny(tmp_path, *flags)
    phases = results["phases"]
    order = ["train-L1", "pack-L1", "train-L2", "pack-L2", "estimate", "eval", "best"]
    assert results["plan"] == "drafter" and list(phases) == order
    assert all(p["ok"] for p in phases.values()), {k: p.get("error") for k, p in phases.items()}
    # No run fills or stores features: each batch's come from the target's forward, the teacher's
    # rows (the tiny target's last layer, of 4) beside the drafter's taps (1, 2).
    for name in ("L1", "L2"):
        log = (tmp_path / "cache" / "train" / name / "train.log").read_text()
        assert "features: live" in log and "by prefill" not in log
    (wide,) = (tmp_path / "cache" / "features").glob("*-taps1-2-3*")
    assert not (wide / "index.jsonl").read_text()
    assert phases["pack-L1"]["drafters"] == ["L1"]
    for layers in (1, 2):
        config = json.loads((tmp_path / "cache" / "drafters" / f"drafter-L{layers}" / "config.json").read_text())
        assert config["num_hidden_layers"] == layers and config["architectures"] == ["DFlashDraftModel"]
    table = "\n".join(phases["estimate"]["table"])
    assert all(f"drafter-L{n} |" in table for n in (1, 2))
    live = {k: v for k, v in phases["eval"].items() if k in ("shipped", "L1", "L2")}
    assert len(live) == 3 and all(m["mismatches"] == 0 for m in live.values())
    # Every new drafter comes back in parts the device machine returns (under 16 MiB each), whole when joined.
    assert phases["best"]["beats_shipped"] == (live[phases["best"]["drafter"]]["tau"] > live["shipped"]["tau"])
    packed, parts = phases["pack-L2"]["drafters"], phases["pack-L2"]["parts"]
    assert sorted(packed) == ["L1", "L2"] and parts and all((out / p).stat().st_size <= 16 * 2**20 for p in parts)
    with tarfile.open(fileobj=io.BytesIO(b"".join((out / p).read_bytes() for p in parts))) as tar:
        tar.extractall(tmp_path / "back", filter="data")
    for name in packed:
        weights = Path(f"drafter-{name}") / "model.safetensors"
        trained = tmp_path / "cache" / "drafters" / weights
        assert (tmp_path / "back" / weights).read_bytes() == trained.read_bytes()


def test_pack_back_leaves_out_what_does_not_fit(tmp_path, monkeypatch):
    """Drafters beyond what the device machine returns stay behind, named, the deepest packed first."""
    for name, size in (("drafter-L1", 3000), ("drafter-L4", 9000), ("drafter-L2", 5000)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(os.urandom(size))  # as incompressible as it gets
    monkeypatch.setattr(gpu_run, "PACK_BYTES", 13500)  # L4, then L1 fit; L4 and L2 would not
    monkeypatch.setattr(gpu_run, "PART_BYTES", 10000)
    out = tmp_path / "out"
    out.mkdir()
    packed = gpu_run.pack_back({n: tmp_path / f"drafter-{n}" for n in ("L1", "L2", "L4")}, out)
    assert packed["drafters"] == ["L4", "L1"] and packed["left_out"] == ["L2"]
    assert packed["parts"] == [f"drafters.tgz.part{i:02d}" for i in range(len(packed["parts"]))]
    assert all((out / p).stat().st_size <= 10000 for p in packed["parts"])
    with tarfile.open(fileobj=io.BytesIO(b"".join((out / p).read_bytes() for p in packed["parts"]))) as tar:
        names = sorted(tar.getnames())
    assert names == ["drafter-L1", "drafter-L1/model.safetensors", "drafter-L4", "drafter-L4/model.safetensors"]


def test_drafters_of_one_two_and_four_layers_come_back_together(tmp_path):
    """Their bf16 weights (10.4, 17.5 and 31.6 MB: the shipped drafter's bytes, as long as each)
    are over what comes back as a plain tar; gzipped, all three fit, and come back whole."""
    weights = (ROOT / "drafters" / "smollm2" / "model.safetensors").read_bytes()
    folders = {}
    for name, size in (("L1", 10_401_912), ("L2", 17_480_960), ("L4", 31_641_856)):
        folders[name] = tmp_path / f"drafter-{name}"
        folders[name].mkdir()
        (folders[name] / "model.safetensors").write_bytes((weights * 4)[:size])
    assert sum(gpu_run._folder_bytes(f) for f in folders.values()) > gpu_run.PACK_BYTES
    out = tmp_path / "out"
    out.mkdir()
    packed = gpu_run.pack_back(folders, out)
    assert packed["drafters"] == ["L4", "L2", "L1"] and not packed["left_out"]
    with tarfile.open(fileobj=io.BytesIO(b"".join((out / p).read_bytes() for p in packed["parts"]))) as tar:
        tar.extractall(tmp_path / "back", filter="data")
    for folder in folders.values():
        back = tmp_path / "back" / folder.name / "model.safetensors"
        assert back.read_bytes() == (folder / "model.safetensors").read_bytes()


def test_the_draft_daemon_goes_to_another_gpu_where_one_is_visible():
    assert gpu_run.second_device("cuda", 2) == "cuda:1" and gpu_run.second_device("cuda:1", 2) == "cuda:0"
    assert gpu_run.second_device("cuda:2", 4) == "cuda:3"
    assert gpu_run.second_device("cuda", 1) is None and gpu_run.second_device("cpu", 0) is None


def test_a_phase_that_exits_is_recorded_and_the_next_one_runs(tmp_path):
    """A daemon that never became ready (or evaluate, or bench_draft_batch) ends in SystemExit:
    it ended the whole GPU run, its results unwritten (an audit)."""

    def exits() -> dict:
        raise SystemExit("draft daemon did not become ready")

    run = gpu_run.Run(tmp_path, 1.0)
    run.phase("split", exits)
    run.phase("batching", lambda: {"rounds": {}})
    phases = json.loads((tmp_path / "results.json").read_text())["phases"]
    assert phases["split"]["ok"] is False and "did not become ready" in phases["split"]["error"]
    assert phases["batching"]["ok"] is True


@pytest.fixture
def auto_declined(monkeypatch):
    """The engine declines "auto" ops on the CPU, as it does on CUDA until a GPU run verifies it."""
    from target_node.engine import engine
    from target_node.engine.weights import EngineUnsupported

    ops_for = engine.ops_for

    def as_on_a_gpu(device, ops):
        if ops == "auto":
            raise EngineUnsupported("declined as on CUDA")
        return ops_for(device, ops)

    monkeypatch.setattr(engine, "ops_for", as_on_a_gpu)
    return engine


def test_the_batching_phase_has_its_slots_where_the_engine_declines_auto(chat_model_dir, tmp_path, auto_declined):
    """On a GPU the engine declines "auto" ops (not yet verified there), and the batching phase's
    target got the transformers path's one slot: the phase failed at its second request (an
    audit). Emulated here by declining "auto" on the CPU as on CUDA."""
    from draft_node.checkpoint import config_for_target, random_drafter, save_drafter
    from target_node.model.target import TargetModel

    assert TargetModel.load(chat_model_dir).engine is None  # the emulation holds
    cfg = config_for_target(TargetModel.load(chat_model_dir).config, block_size=4, taps=2)
    drafter = save_drafter(random_drafter(cfg, seed=1), tmp_path / "drafter")
    result = gpu_run.batching(chat_model_dir, drafter, "cpu", 2, 6, 3)
    assert set(result["rounds"]) == {f"{k} x{b}" for k in ("plain", "dflash") for b in (1, 3)}
    assert all(r["differs"] == 0 for r in result["rounds"].values())


def test_the_drafter_plans_runs_leave_time_for_their_starts_and_the_scoring():
    """Split once before the first run, the budget had no room for each run's start (torchrun, the
    device, the answer store) nor for `estimate`: the scoring ran past the call's limit (an audit).
    Each run's minutes come from the clock as it stands, its start and the scoring set aside."""
    sizes = {"eval_minutes": 1.0, "estimate_minutes": 0.5, "train_start_minutes": 0.6}
    for left, runs, start_late in ((9.0, 3, 0.0), (9.0, 3, 0.4), (6.0, 2, 0.2)):
        for i in range(runs):
            minutes = gpu_run.train_minutes(left, sizes, 0.0, runs - i)
            assert minutes > 0.2
            left -= minutes + sizes["train_start_minutes"] + (start_late if i == 0 else 0.0)
        assert left >= sizes["eval_minutes"] + sizes["estimate_minutes"] - 1e-9  # a late start: later runs shorter


def test_where_auto_declines_the_device_a_family_the_engine_does_not_serve_still_loads(auto_declined):
    """Many-slot work asks for the engine where "auto" declines the device; a family it does not
    serve (gemma2, MoE, hybrids) then ran into EngineUnsupported at load instead of the
    transformers path (a review). Emulated on the CPU, as the batching test above does."""
    from target_node.model.tiny import tiny_target

    choice = auto_declined.batch_engine("cpu")
    assert choice == auto_declined.PREFER_DEVICE
    assert tiny_target("gemma2", engine=choice).engine is None  # the transformers path serves it
    assert tiny_target("llama", engine=choice, slots=3).slots == 3  # the engine, with its slots


def test_auto_picks_bf16_only_on_a_gpu_with_bf16_units(monkeypatch):
    """Before Ampere a GPU emulates bf16, slower than fp32: "auto" took bf16 on any GPU."""
    import torch

    from launch.common import named_dtype
    from target_node.model.target import prefer_bf16
    from training.stages import autocast

    for capability, want in (((7, 0), torch.float32), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert named_dtype("auto", "cuda:1") == want
        assert prefer_bf16("cuda") == (want == torch.bfloat16)
        assert autocast("auto", "cuda:1") == (want == torch.bfloat16)  # training's bf16 autocast took any GPU


@pytest.mark.parametrize("tiny", [False, True])
def test_every_size_a_plan_reads_is_set(tiny):
    """A full run's sizes lacked the answer length, which only the tiny mode set: `--plan all` on a
    GPU ended in a KeyError before its generation, every later phase unrun (an audit)."""
    import inspect
    import re

    read = set(re.findall(r'sizes\["(\w+)"\]', inspect.getsource(gpu_run)))
    given = set(gpu_run.plan_sizes(tiny, "cuda:0", 7.0)) | {"store", "drafters"}  # main adds those two
    assert read and read <= given, read - given


def test_generation_writes_answers_of_the_length_it_is_given(tmp_path, monkeypatch):
    """The tiny plan asks for 24-token answers; the length was not passed on, so they ran to 192."""
    from launch import train

    seen = []
    monkeypatch.setattr(train, "main", seen.append)
    (tmp_path / "answers").mkdir()
    gpu_run.generate_answers(["--device", "cpu"], tmp_path, 0.1, 8, "float32", 24)
    argv = seen[0]
    assert argv[argv.index("--max-new") + 1] == "24"
