"""The benchmark runs end to end in quick mode and writes well-formed results (no timing asserted)."""

import json
import math
from pathlib import Path

import pytest

from benchmarks import bench


def test_quick_benchmark_produces_well_formed_results(tmp_path):
    args = bench.argparse.Namespace(
        quick=True,
        model=None,
        drafter=None,
        max_new_tokens=12,
        repeats=3,
        threads=1,
        out=str(tmp_path),
        skip_engines=False,
        prompts=None,
        prompt_limit=3,
    )
    report = bench.run(args)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved == json.loads(json.dumps(report))
    tiny = saved["models"]["tiny"]
    modes = [row["mode"] for row in tiny["generation"]]
    assert modes[:2] == ["plain", "ngram"] and any("remote" in m for m in modes) and any("local" in m for m in modes)
    for row in tiny["generation"]:
        assert row["tok_s"] > 0 and row["tau"] >= 1.0 and math.isfinite(row["verify_ms"])
    remote = next(r for r in tiny["generation"] if r["mode"] == "dflash-remote (every step)")
    assert remote["bytes_per_step"] > 0 and math.isfinite(remote["wire_ms"])
    protocol = tiny["protocol"]
    assert protocol["protocol_rtt_ms"] > 0 and protocol["raw_rtt_ms"] > 0
    assert protocol["minimum_bytes_per_step"] == protocol["request_tensor_bytes"] + protocol["reply_tensor_bytes"]
    assert [r["context"] for r in tiny["context"]] == [128, 256]
    assert all(r["cached_ms"] > 0 and r["recompute_ms"] > 0 for r in tiny["context"])
    assert [r["width"] for r in tiny["verify"]] == list(range(1, 17))  # up to two blocks: tree widths
    assert tiny["verify"][0]["break_even_tau"] == 1.0 and all(r["verify_ms"] > 0 for r in tiny["verify"])
    engines = tiny["engines"]
    targets = {row["target"] for row in engines["rows"] if row["mode"] != "peer"}
    assert targets == {f"{d} {p}" for d in ("float32", "bfloat16") for p in ("engine", "transformers path")}
    for row in engines["rows"]:
        assert row["tok_s"] > 0 and math.isfinite(row["vs_transformers_generate"])
        if "engine" in row["target"]:  # bit-exact by construction, in both dtypes
            assert row["differs_from_plain"] == 0
    assert set(engines["width_ms"]) == targets and all(len(ms) == 17 for ms in engines["width_ms"].values())
    flags = Path("/proc/cpuinfo").read_text().split()
    for dtype in ("float32", "bfloat16"):
        rows = tiny["invariance_cost"][dtype]
        if dtype == "bfloat16" and "avx512bw" not in flags and "avx_ne_convert" not in flags:
            assert "oneDNN cannot pack" in rows["skipped"]  # nothing of torch's to compare with here
            continue
        assert [r["width"] for r in rows] == [1, 2, 5, 9, 17] and all(r["cost"] > 0 for r in rows)


def test_modes_sharing_a_drafter_report_their_own_drafting():
    """Modes may share one backend, as every-step and adaptive do in the benchmark: each row's
    drafting figures are what its own runs cost. A snapshot after the warm-up gave each row the
    pooled figures (an audit: the shipped JSON's two remote rows agreed to every digit). Two
    every-step modes (deterministic) on one backend each report what one alone on its own does."""
    from draft_node.checkpoint import config_for_target, random_drafter
    from target_node.drafting.local_backend import LocalDraftBackend
    from target_node.model.tiny import tiny_target

    target = tiny_target("llama", seed=0)
    drafter = random_drafter(config_for_target(target.config, block_size=4, taps=2))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]

    def proposer(backend=None):
        return bench.DFlashProposer(backend or LocalDraftBackend(drafter, 512))

    shared = LocalDraftBackend(drafter, 512)
    modes = [("plain", bench.NoProposer(), False), ("a", proposer(shared), False), ("b", proposer(shared), False)]
    rows = {r["mode"]: r for r in bench.run_modes(target, prompts, modes, 12)}
    alone = bench.run_modes(target, prompts, [("alone", proposer(), False)], 12)[0]
    assert "proposals" not in rows["plain"] and alone["proposals"] > 0
    assert rows["a"]["proposals"] == rows["b"]["proposals"] == alone["proposals"]


def test_the_benchmarks_exit_1_when_a_drafted_output_is_not_plain_decodings(monkeypatch, tmp_path):
    """dflash-bench and dflash-bench-serving showed a differing output as a table entry and exited
    0 (an audit): a script reading their exit code saw success."""
    from benchmarks import bench_serving

    rows = [
        {"target": "engine bf16", "differs_from_plain": 0},
        {"target": "bfloat16 transformers path", "differs_from_plain": 7},  # inexact, as documented
        {"target": "engine fp32", "differs_from_plain": 2},
    ]
    monkeypatch.setattr(bench, "run", lambda args: {"models": {"tiny": {"engines": {"rows": rows}}}})
    with pytest.raises(SystemExit) as ended:
        bench.main(["--quick"])
    assert ended.value.code == 1
    rows[2]["differs_from_plain"] = 0
    bench.main(["--quick"])  # all equal: no exit

    monkeypatch.setattr(bench_serving, "resolve_model", lambda folder: tmp_path)
    monkeypatch.setattr(bench_serving, "chat_asks", lambda args, count: [{}] * count)
    monkeypatch.setattr(bench_serving, "start_daemons", lambda *args: {"serial plain": "", "batched": ""})
    monkeypatch.setattr(bench_serving, "alone_outputs", lambda address, asks: [])
    monkeypatch.setattr(bench_serving, "print_table", lambda report: None)
    for same, code in ((3, None), (2, 1)):
        round_ = {"daemon": "batched", "clients": 1, "tok_s": 1.0, "requests": 3, "identical_to_alone": same}
        monkeypatch.setattr(bench_serving, "rounds_of", lambda *args, r=round_: [r])
        argv = ["--drafter", "d", "--clients", "1", "--long-prompt", "0", "--json", str(tmp_path / "out.json")]
        if code is None:
            bench_serving.main(argv)
        else:
            with pytest.raises(SystemExit) as ended:
                bench_serving.main(argv)
            assert ended.value.code == code


def test_a_client_that_fails_in_a_serving_round_ends_the_round_with_its_own_error(monkeypatch):
    """A client thread whose request raised left its figures unset, and the round ended in a
    KeyError ('latency_s') that named nothing of the cause (an audit)."""
    from benchmarks import bench_serving

    class Unreachable:
        def __init__(self, address, timeout_s):
            pass

        def stream(self, **ask):
            raise TimeoutError("the daemon did not answer")

        def close(self):
            pass

    monkeypatch.setattr(bench_serving, "TargetClient", Unreachable)
    with pytest.raises(TimeoutError, match="did not answer"):
        bench_serving.round_of("ipc:///nowhere", [[{}], [{}]])


def test_the_start_benchmark_times_a_load_and_a_service_that_measured_its_costs(chat_model_dir, capsys):
    from benchmarks import bench_start

    result = bench_start.main(["--model", str(chat_model_dir), "--slots", "2", "--tree-nodes", "4", "--repeats", "1"])
    assert result["load_s"] > 0 and result["service_s"] > 0
    # Widths 1..5 (a tree of 4) and the two slots' widest, 10: each measured once.
    assert result["widths_measured"] == 6
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
