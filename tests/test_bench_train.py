"""benchmarks.bench_train on a tiny chat target: every setting takes its turn each round, and the
features it fills are the cache's (a second run fills none)."""

import json

import torch

from answers.store import Answer, AnswerStore
from benchmarks import bench_train


def test_every_setting_is_timed_each_round_and_features_are_filled_once(chat_model_dir, tmp_path, capsys):
    store = AnswerStore(tmp_path / "answers")
    gen = torch.Generator().manual_seed(0)
    for i in range(12):
        tokens = torch.randint(3, 49000, (40,), generator=gen).tolist()
        store.add(Answer(f"key-{i}", f"job-{i}", "answer", [["user", "hi"]], tokens, 8))
    store.flush()
    out = tmp_path / "bench.json"
    argv = ["--model", str(chat_model_dir), "--store", str(store.folder), "--cache", str(tmp_path / "cache")]
    argv += ["--layers", "1,2", "--autocast", "off,on", "--batch", "2", "--anchors", "4", "--rounds", "2"]
    bench_train.main([*argv, "--steps", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    settings = [(s["layers"], s["autocast"]) for s in result["settings"]]
    assert settings == [(1, False), (1, True), (2, False), (2, True)]
    assert all(len(s["rounds"]) == 2 and min(s["rounds"]) > 0 for s in result["settings"])
    assert result["settings"][0]["vs_first"] == 1.0
    trained = sum(not a.held_out for a in store.answers)
    assert f"{trained} answers ({trained} filled now)" in capsys.readouterr().out
    bench_train.main([*argv, "--rounds", "1", "--steps", "1"])
    assert f"{trained} answers (0 filled now)" in capsys.readouterr().out
    loader = tmp_path / "loader.json"
    bench_train.main([*argv, "--rounds", "2", "--steps", "3", "--loader-threads", "0,2", "--json", str(loader)])
    rows = json.loads(loader.read_text())["loader"]
    assert [r["threads"] for r in rows[:2]] == [0, 2] and all(len(r["rounds"]) == 2 for r in rows[:2])
    assert rows[2]["feature_mb_per_batch"] > 0
