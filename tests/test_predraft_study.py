"""benchmarks.predraft_study on a tiny chat target: the walk covers every answer token once, and
naming more outcomes never finds fewer."""

import json
import math

import torch
from helpers import columns_logits

from benchmarks import predraft_study
from draft_node.checkpoint import config_for_target, random_drafter, save_drafter
from target_node.drafting.outcomes import likeliest_outcomes
from target_node.drafting.tree import DraftTree
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
    for key in ("hit_rate", "tree_hit_rate"):
        rates = [result[key][str(a)] for a in predraft_study.ALTERNATIVES]
        assert rates == sorted(rates) and 0 <= rates[0] and rates[-1] <= 1


def chain_logits() -> torch.Tensor:
    logits = torch.full((3, 5), -10.0)
    logits[0, 1], logits[0, 2] = 5.0, 4.0  # slot 1: draft 1, runner-up 2
    logits[1, 3], logits[1, 4] = 5.0, 1.0  # slot 2: draft 3, runner-up 4
    logits[2, 0], logits[2, 2] = 5.0, 4.9  # slot 3: after both drafts
    return logits


def test_outcomes_rank_by_the_drafters_path_and_bonus_probabilities_and_never_name_a_child():
    logits = chain_logits()
    chain = DraftTree.chain([1, 3])
    # Both drafts accepted (p 0.73 x 0.98), then 0 or 2; none accepted, then 2 (0.27); one, then 4.
    assert likeliest_outcomes(logits, chain, 4, deepest=5) == [(2, 0), (2, 2), (0, 2), (1, 4)]
    assert likeliest_outcomes(logits, chain, 2, deepest=1) == [(0, 2), (1, 4)]  # not past `deepest`
    p = logits.log_softmax(-1)
    assert math.isclose(p[0, 1] + p[1, 3] + p[2, 0], math.log(0.731 * 0.982 * 0.525), abs_tol=0.01)


def test_a_trees_outcomes_exclude_every_child_of_their_node():
    logits = chain_logits()
    tree = DraftTree.best_first(logits.log_softmax(-1), 3, 2, branching=2)  # 1 then 3, and 2 under the root
    assert tree.parents == [0, 1, 0] and tree.tokens == [1, 3, 2]
    named = likeliest_outcomes(logits, tree, 30, deepest=5)
    assert all(b not in (1, 2) for node, b in named if node == 0)
    assert all(b != 3 for node, b in named if node == 1)
    assert named[:2] == [(2, 0), (2, 2)] and (3, 3) in named  # 2's child 3 is no child of node 3's
    assert tree.path(2) == [1, 3] and tree.path(3) == [2] and tree.path(0) == []


def test_outcomes_from_a_drafters_own_columns_equal_those_from_the_whole_vocabulary():
    proposal = columns_logits(4, 500, 60, seed=3)
    compact, columns, full = proposal.logits, proposal.columns, proposal.full_logits(500)
    assert torch.isinf(full).sum() == 4 * (500 - 60) and torch.equal(full[:, columns], compact)
    for branching in (1, 3):
        tree = DraftTree.best_first(compact.log_softmax(-1), 4, 4, branching, columns)
        want = likeliest_outcomes(full, tree, 8, deepest=5)
        assert likeliest_outcomes(compact, tree, 8, deepest=5, columns=columns) == want
        assert len(want) == 8 and all(b in columns.tolist() for _, b in want)


def test_a_chain_deeper_than_the_drafters_rows_names_outcomes_only_where_it_drafted():
    """A looked-up continuation grafted onto the drafted chain (or a pre-draft hit's shorter
    block) makes the verified chain deeper than the drafter's rows: naming its outcomes raised
    IndexError inside the step, failing every request in the batch (an audit)."""
    logits = chain_logits()[:2]  # two rows: slots 1 and 2
    grafted = DraftTree.chain([1, 3]).graft([1, 3, 0, 2, 4], [0.9, 0.8, 0.7, 0.6, 0.5])
    assert grafted.is_chain and max(grafted.depths) == 5
    named = likeliest_outcomes(logits, grafted, 4, deepest=5)
    assert named and all(node < 2 for node, _ in named)  # only where a row gives the bonus's chance
    assert named == likeliest_outcomes(logits, DraftTree.chain([1, 3]), 4, deepest=5)


def test_outcomes_are_computed_on_the_logits_device():
    """Tensors made without a device sat on the CPU beside a GPU target's logits: every pre-drafting
    step failed there (an audit). With the default device elsewhere ('meta', as CUDA would be for
    tensors made without one), outcomes over CPU logits still come out, columns or not."""
    proposal = columns_logits(4, 500, 60, seed=3)
    tree = DraftTree.best_first(proposal.logits.log_softmax(-1), 4, 4, 2, proposal.columns)
    want = likeliest_outcomes(proposal.logits, tree, 8, deepest=5, columns=proposal.columns)
    full = proposal.full_logits(500)
    want_full = likeliest_outcomes(full, tree, 8, deepest=5)
    with torch.device("meta"):
        assert likeliest_outcomes(proposal.logits, tree, 8, deepest=5, columns=proposal.columns) == want
        assert likeliest_outcomes(full, tree, 8, deepest=5) == want_full
