"""benchmarks.bench_overlap: both schedules decode a batch exactly as each request alone, with
drafts accepted (an oracle drafter in process), and the benchmark runs end to end against a real
draft daemon process."""

from helpers import OracleBackend, draft_daemon, free_tcp_address, greedy, tiny_target

from benchmarks import bench_overlap
from draft_node.checkpoint import config_for_target, random_drafter, save_drafter
from target_node.drafting.proposers import DFlashProposer
from target_node.model.target import TargetModel


def test_together_and_halves_decode_each_request_as_alone(one_thread):
    target = tiny_target(layers=4, slots=3)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21]]
    want = [greedy(target, p, 24) for p in prompts]
    for schedule in ("together", "halves"):
        proposers = [DFlashProposer(OracleBackend(target, p + w, 4)) for p, w in zip(prompts, want, strict=True)]
        sequences = bench_overlap.start(target, prompts, proposers, 24)
        assert not any(seq.prefilling for seq in sequences)
        assert bench_overlap.decode(target, sequences, schedule) > 0
        assert [seq.result().tokens for seq in sequences] == want, schedule
        assert all(seq.stats.accepted > 0 for seq in sequences), schedule  # the drafts were used


def test_the_benchmark_runs_every_schedule_against_a_real_daemon(chat_model_dir, tmp_path):
    cfg = config_for_target(TargetModel.load(chat_model_dir).config, block_size=4, taps=2)
    drafter = save_drafter(random_drafter(cfg, seed=1), tmp_path / "drafter")
    address = free_tcp_address()
    argv = ["--drafter-address", address, "--model", str(chat_model_dir), "--dtype", "float32", "--threads", "0"]
    with draft_daemon(address, drafter):
        result = bench_overlap.main([*argv, "--batches", "1,3", "--rounds", "1", "--max-new-tokens", "8"])
    assert result["mismatches"] == 0
    assert [row["batch"] for row in result["rows"]] == [1, 3]
    assert all(row[f"{s}_tok_s"] > 0 for row in result["rows"] for s in ("plain", "together", "halves"))
