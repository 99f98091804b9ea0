"""benchmarks.evaluate end to end on a tiny chat target: two drafters side by side, one reference."""

import json

import pytest

from benchmarks import evaluate
from draft_node.checkpoint import config_for_target, random_drafter, save_drafter
from target_node.model.target import TargetModel


def drafter_and_prompts(chat_model_dir, tmp_path):
    """A random drafter for the tiny chat target, saved, and a file of two prompts."""
    cfg = config_for_target(TargetModel.load(chat_model_dir).config, block_size=4, taps=2)
    drafter = save_drafter(random_drafter(cfg, seed=1), tmp_path / "new")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Say hi.", "Count to three.")))
    return cfg, drafter, prompts


def test_a_drafter_and_a_baseline_run_every_mode_against_one_reference(chat_model_dir, tmp_path):
    cfg, drafter, prompts = drafter_and_prompts(chat_model_dir, tmp_path)
    baseline = save_drafter(random_drafter(cfg, seed=2), tmp_path / "old")
    out = tmp_path / "eval.json"
    argv = ["--model", str(chat_model_dir), "--drafter", str(drafter), "--baseline", str(baseline)]
    argv += ["--prompts", str(prompts), "--modes", "chain,tree:4", "--max-new-tokens", "12", "--json", str(out)]
    assert evaluate.main(argv) == 0
    result = json.loads(out.read_text())
    assert list(result["modes"]) == ["plain", "chain", "tree:4", "chain@baseline", "tree:4@baseline"]
    assert result["baseline"] == str(baseline) and result["mismatches"] == 0
    for row in result["per_prompt"]:
        assert all(row[mode]["same"] for mode in result["modes"] if mode != "plain")
    assert all(result["modes"][mode]["nodes_per_step"] > 0 for mode in ("chain", "chain@baseline"))


def test_results_go_under_the_cache_never_into_the_checkpoint_folder(tmp_path):
    drafter = tmp_path / "drafters" / "smollm2"
    path = evaluate.default_results_path(str(drafter))
    assert path.name == "smollm2.json" and drafter not in path.parents
    assert evaluate.default_results_path(None).name == "remote.json"


@pytest.mark.parametrize("compare", ["head", "screen-path"])
def test_the_ab_benchmark_runs_both_sides_in_turns_against_plain(chat_model_dir, tmp_path, compare):
    import dflash_kernels
    from benchmarks import bench_ab

    if compare == "screen-path" and "amx" not in dflash_kernels.screen_paths():
        pytest.skip("no AMX int8 tiles here: the screen has one path")
    _, drafter, prompts = drafter_and_prompts(chat_model_dir, tmp_path)
    out = tmp_path / "ab.json"
    argv = ["--compare", compare, "--model", str(chat_model_dir), "--drafter", str(drafter), "--prompts", str(prompts)]
    argv += ["--modes", "chain,adaptive", "--max-new-tokens", "10", "--datastore", "none", "--out", str(out)]
    assert bench_ab.main(argv) == 0
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"new", "old"} and result["mismatches"] == 0
    assert set(result["new_vs_old"]) == {"plain", "chain", "adaptive"}


def test_the_ab_benchmark_sees_a_setting_that_changes_the_plain_output(chat_model_dir, tmp_path, monkeypatch):
    """Each side was checked against its own plain run only: a setting that broke the greedy head
    broke both of its side's runs alike and reported 0 mismatches (an audit). The sides' plain
    outputs are compared with each other now."""
    from benchmarks import bench_ab

    class OneOff:
        def __init__(self, target) -> None:
            self.target, self.greedy = target, target.greedy

        def apply(self, side: str) -> None:
            wrong = lambda rows: [(t + 1) % self.target.vocab_size for t in self.greedy(rows)]  # noqa: E731
            self.target.greedy = wrong if side == "new" else self.greedy

    monkeypatch.setitem(bench_ab.SETTINGS, "one-off", OneOff)
    _, drafter, prompts = drafter_and_prompts(chat_model_dir, tmp_path)
    argv = ["--compare", "one-off", "--model", str(chat_model_dir), "--drafter", str(drafter)]
    argv += ["--prompts", str(prompts), "--modes", "chain", "--max-new-tokens", "6"]
    argv += ["--datastore", "none", "--limit", "2"]
    result = bench_ab.bench(argv)
    assert result["sides_differing"] == 2 and result["mismatches"] >= 2


@pytest.mark.parametrize("modes", ["chian", "chain,tree:x", "tree:0", "tree:-3", "adaptive+store"])
def test_a_mode_no_run_knows_is_refused_as_the_arguments_are_parsed(modes, capsys):
    """`--modes chian` ended the run with `unknown mode` after both models loaded (an audit)."""
    from benchmarks.evaluate import parse_args

    with pytest.raises(SystemExit) as ended:
        parse_args(["--drafter", "d", "--modes", modes])
    assert ended.value.code == 2 and "--modes" in capsys.readouterr().err
    assert parse_args(["--drafter", "d", "--modes", "chain,tree:8+lookup,adaptive"]).modes
