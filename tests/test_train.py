"""Drafter training: it learns, it round-trips, it resumes exactly, and it trains what inference runs."""

import inspect
from pathlib import Path

import pytest
import torch
from helpers import greedy, tiny_target

from draft_node.checkpoint import config_for_target, load_drafter, random_drafter
from draft_node.config import FULL, SLIDING
from draft_node.prompts import EVAL_PROMPTS, build_prompts, read_prompts
from draft_node.train import Trainer, TrainOptions, export_drafter, make_batch, train, train_forward
from draft_node.train_data import AnswerStore, generate_answers
from target_node.proposers import DFlashProposer, LocalDraftBackend
from target_node.speculative import generate

STARTER = Path("/work/shared/prompts/train.jsonl")


class _TokenTarget:
    """Prompts are token-id strings, so the tiny tokenizer-less target can 'chat'."""

    def __init__(self, target):
        self.model, self.eos_ids = target.model, target.eos_ids

    def encode_chat(self, messages):
        return [int(t) for t in messages[0]["content"].split()]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(one_thread, tmp_path_factory):
    target = tiny_target(layers=4)
    cfg = config_for_target(target.config, num_layers=1, block_size=4, mask_token_id=0)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 12, (48,), generator=gen).tolist()
    prompts = [" ".join(map(str, torch.randint(3, 300, (n,), generator=gen).tolist())) for n in lengths]
    store = AnswerStore(tmp_path_factory.mktemp("data"), cfg.feature_width)
    quiet = dict(batch=8, max_new=48, log=lambda m: None)
    generate_answers(_TokenTarget(target), prompts, store, cfg.target_layer_ids, **quiet)
    return target, cfg, store


def opts(**kw):
    base = dict(lr=5e-3, warmup=10, steps=400, batch=8, anchors=8, val_answers=8, eval_every=0, save_every=0)
    base.update(kw)
    return TrainOptions(**base)


def test_generation_is_resumable(setup, tmp_path):
    target, cfg, store = setup
    assert len(store.records) == 48
    again = AnswerStore(store.folder, cfg.feature_width)  # reopening keeps every answer and row
    assert len(again.records) == 48 and again.rows == store.rows
    assert all(len(r.tokens) > r.prompt_len for r in store.records)


def test_training_lowers_loss_and_beats_a_random_drafter(setup, tmp_path):
    target, cfg, store = setup
    trainer = train(target, cfg, store, opts(), tmp_path / "state.pt", tmp_path / "out", log=lambda m: None)
    first, last = sum(trainer.history[:20]) / 20, sum(trainer.history[-20:]) / 20
    assert last < first * 0.7, (first, last)
    trained = trainer.evaluate(trainer.train_records, anchors=8)
    trainer.drafter.load_state_dict(random_drafter(cfg, seed=3).state_dict())
    trainer.scale = torch.ones_like(trainer.scale)
    baseline = trainer.evaluate(trainer.train_records, anchors=8)
    assert trained["tau"] > baseline["tau"] + 0.3, (trained, baseline)

    # The exported checkpoint loads, and speculative output stays the target's own greedy output.
    drafter = load_drafter(tmp_path / "out")
    # Always draft (no governor), so acceptance measures the drafter.
    extra = {"adaptive": False} if "adaptive" in inspect.signature(generate).parameters else {}
    accepted = 0
    for r in store.records[:4]:
        prompt = r.tokens[: r.prompt_len]
        result = generate(target, prompt, DFlashProposer(LocalDraftBackend(drafter)), 40, **extra)
        assert result.tokens == greedy(target, prompt, 40)
        accepted += result.stats.accepted
    assert accepted > 0


def test_resume_replays_the_same_run(setup, tmp_path):
    target, cfg, store = setup
    o = opts(steps=12, warmup=4)
    straight = Trainer(target, cfg, store, o)
    for _ in range(12):
        straight.train_step()
    first = Trainer(target, cfg, store, o)
    for _ in range(6):
        first.train_step()
    first.save(tmp_path / "state.pt", None)
    resumed = train(target, cfg, store, o, tmp_path / "state.pt", None, resume=True, log=lambda m: None)
    assert resumed.step == 12
    assert resumed.history == pytest.approx(straight.history, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("layer_types", [(FULL,), (FULL, SLIDING)])
def test_train_forward_equals_inference_forward(setup, layer_types):
    target, cfg0, store = setup
    cfg = config_for_target(
        target.config,
        num_layers=len(layer_types),
        block_size=4,
        mask_token_id=0,
        layer_types=list(layer_types),
        sliding_window=5 if SLIDING in layer_types else None,
    )
    drafter = random_drafter(cfg, seed=1, std=0.2)
    scale = torch.rand(cfg.feature_width) + 0.5
    records = store.records[:3]
    batch = make_batch(records, store.features(), cfg, 5, 320, torch.Generator().manual_seed(0))
    noise = torch.randn(*batch.block_tokens.shape, cfg.hidden_size)
    with torch.no_grad():
        rows = train_forward(drafter, scale, batch, noise)
    plain = export_drafter(drafter, scale)
    checked = 0
    for i in range(len(records)):
        for j, a in enumerate(batch.anchors[i].tolist()):
            if (batch.labels[i, j] < 0).all():
                continue  # padding anchor
            feats = batch.features[i, :a]
            want = plain(feats, torch.arange(a), noise[i, j], a)
            torch.testing.assert_close(rows[i, j], want, atol=1e-5, rtol=1e-5)
            checked += 1
    assert checked >= 6


def test_eval_prompts_are_never_trained_on():
    held_out = read_prompts(EVAL_PROMPTS)
    assert len(held_out) >= 30 and len(set(held_out)) == len(held_out)
    training = set(build_prompts(20000, seed=0, starter=STARTER))
    if STARTER.is_file():
        training |= set(read_prompts(STARTER))
    assert not training & set(held_out)
    lowered = {p.lower().strip(" .?") for p in training}
    assert not lowered & {p.lower().strip(" .?") for p in held_out}


def test_draft_vocabulary_is_the_most_frequent_answer_tokens():
    from draft_node.train_data import Record, draft_vocabulary

    records = [Record("p", [9, 9, 5, 5, 5, 7], 2, 0), Record("q", [9, 1, 5, 7, 7, 7, 7], 1, 5)]
    # Prompt tokens (9) do not count: answers hold 5 x4, 7 x5, 1 x1.
    assert draft_vocabulary(records, 2) == [7, 5]
    assert draft_vocabulary(records, 10) == [7, 5, 1]


def test_loss_is_over_the_draft_vocabulary_the_drafter_proposes_from(setup, tmp_path):
    from draft_node.checkpoint import load_draft_vocab
    from draft_node.train_data import draft_vocabulary

    target, cfg, store = setup
    trainer = Trainer(target, cfg, store, opts(draft_vocab=16))
    assert trainer.vocab.tolist() == draft_vocabulary(trainer.train_records, 16)
    batch = trainer.batch(0)
    logits, slots, labelled = trainer.logits(batch)
    assert logits.shape == (int(labelled.sum()), 16)
    labels = batch.labels[labelled]
    inside = torch.isin(labels, trainer.vocab)
    assert (~inside).any() and inside.any()  # the tiny answers use more than 16 tokens
    assert (slots[~inside] == -100).all()
    assert (trainer.vocab[slots[inside]] == labels[inside]).all()
    # Logits are the LM-head rows of exactly those tokens.
    noise = torch.nn.functional.embedding(batch.block_tokens, trainer.embed)
    hidden = train_forward(trainer.drafter, trainer.scale, batch, noise)[labelled].to(trainer.head.dtype)
    full_head = target.model.get_output_embeddings().weight.to(trainer.head.dtype)
    torch.testing.assert_close(logits, (hidden @ full_head.T).float()[:, trainer.vocab])
    assert torch.isfinite(trainer.loss(batch))
    trainer.save(tmp_path / "state.pt", tmp_path / "out")
    assert load_draft_vocab(tmp_path / "out") == trainer.vocab.tolist()


def test_held_out_answers_stay_held_out_as_the_store_grows():
    from draft_node.train import split_held_out
    from draft_node.train_data import Record

    records = [Record(f"prompt {i}", [1, 2, 3], 1, 2 * i) for i in range(400)]
    train_a, held_a = split_held_out(records[:200], 10)
    train_b, held_b = split_held_out(records, 10)
    assert [r.prompt for r in held_a] == [r.prompt for r in held_b] and len(held_a) == 10
    assert not {r.prompt for r in train_b} & {r.prompt for r in held_b}
    assert len(train_b) + len(held_b) == 400
