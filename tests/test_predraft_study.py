"""benchmarks.predraft_study on a tiny chat target: the walk covers every answer token once, and
naming more outcomes never finds fewer."""

import json

import torch
from helpers import columns_logits

from benchmarks import predraft_study
from draft_node.checkpoint import config_for_target, random_drafter, save_drafter
from target_node.drafting.outcomes import likeliest_outcomes
from target_node.model.target import TargetModel


def test_the_study_walks_each_answer_once_and_hit_rates_grow_with_the_outcomes_named(chat_model_dir, tmp_path):
    cfg = config_for_target(TargetModel.load(chat_model_dir).config, block_size=4, taps=2)
    drafter = save_drafter(random_drafter(cfg, seed=1), tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Say hi.", "Count to three.")))
    out = tmp_path / "study.json"
    predraft_study.main(
        ["--model", str(chat_model_dir), "--drafter", str(drafter), "--prompts", str(prompts)]
        + ["--max-new-tokens", "16", "--json", str(out)]
    )
    result = json.loads(out.read_text())
    lengths = {int(j): n for j, n in result["accepted_length"].items()}
    assert sum(lengths.values()) == result["steps"] > 0
    assert sum((j + 1) * n for j, n in lengths.items()) == result["answer_positions"]  # each token once
    assert all(0 <= j <= cfg.block_size - 1 for j in lengths)
    rates = [result["hit_rate"][str(a)] for a in predraft_study.ALTERNATIVES]
    assert rates == sorted(rates) and 0 <= rates[0] and rates[-1] <= 1


def test_outcomes_rank_by_length_seen_times_the_bonus_tokens_probability_without_the_rejected_draft():
    logits = torch.full((2, 5), -10.0)
    logits[0, 1], logits[0, 2] = 5.0, 4.0  # slot 1: draft 1, runner-up 2
    logits[1, 3], logits[1, 4] = 5.0, 1.0  # slot 2: draft 3, runner-up 4
    ranked = likeliest_outcomes(logits, [1, 3], {0: 8, 1: 1}, 2)
    assert ranked == [(0, 2), (1, 4)]  # never a rejected draft as its own bonus


def test_outcomes_from_a_drafters_own_columns_equal_those_from_the_whole_vocabulary():
    proposal = columns_logits(4, 500, 60, seed=3)
    compact, columns, full = proposal.logits, proposal.columns, proposal.full_logits(500)
    assert torch.isinf(full).sum() == 4 * (500 - 60) and torch.equal(full[:, columns], compact)
    drafts = columns[compact.argmax(-1)].tolist()
    lengths = {0: 5, 1: 3, 2: 1}
    want = likeliest_outcomes(full, drafts, lengths, 8)
    assert likeliest_outcomes(compact, drafts, lengths, 8, columns=columns) == want
    assert len(want) == 8 and all(b in columns.tolist() and b != drafts[j] for j, b in want)
