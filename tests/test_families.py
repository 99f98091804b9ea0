"""Every target family the adapter serves decodes losslessly, with contexts past its sliding windows.

One tiny random model per family (target_node/model/tiny.py), each rolled back by the policy its
own cache calls for; recurrent families once per recurrent rollback (replay, capture). The
families the engine serves run twice: on the engine, and on the transformers path that serves
every decoder.
"""

import pytest
import torch
from helpers import OracleBackend, assert_lossless, greedy

from draft_node.checkpoint import config_for_target, random_drafter
from protocol.sampling import SamplingParams
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposers import DFlashProposer, NGramProposer
from target_node.model.policies import RECURRENT_POLICIES
from target_node.model.tiny import ENGINE_FAMILIES, FAMILIES, WINDOW, tiny_target

PROMPT = [5, 17, 42, 99, 3, 7, 11, 200, 13, 14, 15, 16]
MAX_NEW = 32
BLOCK = 16  # longer than the sliding windows: a rejected block rolls back across one
RECURRENT = ("qwen3_next", "mamba2", "falcon_h1", "nemotron_h")
POLICY = {
    "llama": "crop",
    "qwen2": "crop",
    "qwen3": "crop",
    "qwen3_sliding": "crop+window",
    "mistral": "window",
    "gemma2": "crop+window",
    "gpt_oss": "crop+window",
    "qwen3_moe": "crop",
    "qwen3_next": "crop+{}",
    "mamba2": "{}",
    "falcon_h1": "crop+{}",
    "nemotron_h": "crop+{}",
}
TRANSFORMERS = "transformers"  # an engine family on the transformers path
CASES = (
    [(f, None) for f in FAMILIES if f not in RECURRENT]
    + [(f, TRANSFORMERS) for f in ENGINE_FAMILIES]
    + [(f, p) for f in RECURRENT for p in RECURRENT_POLICIES]
)

assert len(PROMPT) > WINDOW and set(POLICY) == set(FAMILIES)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0] if c[1] is None else f"{c[0]}-{c[1]}")
def case(request, one_thread):
    family, policy = request.param
    if policy == TRANSFORMERS:
        target = tiny_target(family, seed=1, engine=False)
    else:
        target = tiny_target(family, seed=1, cache_policy=policy)
    return family, target, greedy(target, PROMPT, MAX_NEW, stop_on_eos=False)


def test_policy_follows_the_cache_layers(case):
    family, target, _ = case
    policy = target.policy.name
    if target.engine is not None:
        # The static cache keeps every position, so trees verify even on sliding windows.
        assert family in ENGINE_FAMILIES and policy == "static" and target.policy.tree
        return
    assert policy == POLICY[family].format(policy.split("+")[-1])
    assert target.policy.tree == (policy == "crop")


def test_plain_decoding_matches_transformers_generate(case):
    family, target, want = case
    with torch.inference_mode():
        out = target.model.generate(
            torch.tensor([PROMPT]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert_lossless(target, PROMPT, want, out[0, len(PROMPT) :].tolist())
    assert target.length == len(PROMPT) + MAX_NEW - 1
    # A model that is not degenerate: finite logits, and a greedy path that goes somewhere.
    assert torch.isfinite(target.model(torch.tensor([PROMPT + want])).logits).all()
    assert len(set(want)) >= 8


@pytest.mark.parametrize("keep", [1, 6, BLOCK - 1])
def test_rollback_leaves_the_cache_as_if_rejected_tokens_never_ran(case, keep):
    _, target, want = case
    block = [(t * 7 + 3) % 300 for t in want[:BLOCK]]
    target.reset()
    target.forward(PROMPT)
    target.forward(block)
    target.rollback(len(PROMPT) + keep)
    assert target.length == len(PROMPT) + keep
    after, _ = target.forward([9])
    with torch.inference_mode():
        ids = torch.tensor([PROMPT + block[:keep] + [9]])
        fresh = target.model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0, -1]
    # Token-by-token and chunked recurrent kernels differ by up to ~1e-3 of the largest entry here
    # (Nemotron-H); a state left unrolled, or rolled back to the wrong position, is off by ~1.
    assert float((after[-1] - fresh).abs().max()) < 1e-2 * float(fresh.abs().max())


def test_random_drafter_is_lossless(case):
    _, target, want = case
    drafter = random_drafter(config_for_target(target.config, block_size=BLOCK, taps=2), seed=3)
    result = generate(
        target,
        PROMPT,
        DFlashProposer(LocalDraftBackend(drafter)),
        DecodeOptions(MAX_NEW, stop_on_eos=False, adaptive=False),
    )
    assert_lossless(target, PROMPT, result.tokens, want)
    assert result.stats.proposed >= MAX_NEW - 1


def test_oracle_drafter_is_accepted_across_windows(case):
    _, target, want = case
    oracle = OracleBackend(target, PROMPT + want, BLOCK, target_layer_ids=(0, 2))
    result = generate(target, PROMPT, DFlashProposer(oracle), DecodeOptions(MAX_NEW, stop_on_eos=False, adaptive=False))
    assert result.tokens == want
    assert result.stats.accepted == result.stats.proposed
    assert result.stats.steps == -(-(MAX_NEW - 1) // BLOCK)


def test_ngram_proposer_is_lossless(case):
    _, target, want = case
    result = generate(target, PROMPT, NGramProposer(max_draft=8), DecodeOptions(MAX_NEW, stop_on_eos=False))
    assert_lossless(target, PROMPT, result.tokens, want)


def test_seeded_sampling_reproduces(case):
    _, target, _ = case
    drafter = random_drafter(config_for_target(target.config, block_size=8, taps=2), seed=4)
    runs = [
        generate(
            target,
            PROMPT,
            DFlashProposer(LocalDraftBackend(drafter)),
            DecodeOptions(20, stop_on_eos=False, sampling=SamplingParams(temperature=0.9, top_k=50, seed=11)),
        ).tokens
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and len(runs[0]) == 20


def test_taps_read_the_tapped_decoder_layers_outputs(case):
    _, target, _ = case
    layers = next(m for m in target.model.get_decoder().children() if isinstance(m, torch.nn.ModuleList))
    seen = {}
    hooks = [
        layers[i].register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i in (0, 2)
    ]
    try:
        with torch.inference_mode():
            target.model.get_decoder()(input_ids=torch.tensor([PROMPT]))
    finally:
        for hook in hooks:
            hook.remove()
    target.reset()
    _, features = target.forward(PROMPT, taps=(2, 0))
    want = torch.cat([seen[2][0], seen[0][0]], -1)
    # Equal up to rounding: the engine's kernels, and recurrent capture's token-by-token mixers,
    # compute the same layers in another order. A wrong layer is off by the activations' size.
    assert torch.allclose(features, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))


def test_logits_and_draft_projection_use_the_models_own_head(case):
    _, target, _ = case
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])
        theirs = target.model(input_ids=ids).logits[0]
        hidden = target.model.get_decoder()(input_ids=ids).last_hidden_state[0]
    assert torch.allclose(target.logits(hidden), theirs, atol=1e-4)
    proposer = DFlashProposer(LocalDraftBackend(random_drafter(config_for_target(target.config, taps=2))))
    proposer.begin(target)
    drafted = proposer.drafting.project(hidden)  # a bf16 head on CPU: close, not exact
    assert torch.allclose(drafted, theirs, atol=0.02 * float(theirs.abs().max()))


def test_auto_dtype_off_the_engine_serves_the_folders_own_fp32_weights(tmp_path, monkeypatch):
    """`--dtype auto` loads bf16 where the device computes it natively; for a model the engine does
    not serve it then fell back to fp32 as `model.float()`, which kept bf16's rounding of an fp32
    checkpoint: greedy output differed from the model's own at token 9 (an audit)."""
    from transformers import AutoModelForCausalLM

    import target_node.model.target as target_module
    from target_node.model.target import TargetModel

    folder = tmp_path / "gemma2"
    tiny_target("gemma2").model.save_pretrained(folder)  # fp32 weights, off the engine
    monkeypatch.setattr(target_module, "prefer_bf16", lambda device: True)
    served = TargetModel.load(folder, dtype="auto")
    assert served.engine is None and served.model.dtype == torch.float32
    own = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    for name, weight in served.model.state_dict().items():
        assert torch.equal(weight, own[name]), name


def test_a_dtype_that_would_not_be_exact_is_refused_for_serving(tmp_path):
    """`--dtype bfloat16` for a model the engine does not serve, or `float16` for any (the engine
    takes neither), served speculation whose output was not the plain output: 2 of 40 prompts
    differed in fp16, at exact logit ties, and the drafter's heads refused fp16 (an audit)."""
    import subprocess
    import sys

    from target_node.engine.engine import declines
    from target_node.model.target import TargetModel

    folder = tmp_path / "gemma2"
    tiny_target("gemma2").model.save_pretrained(folder)
    assert not TargetModel(tiny_target("gemma2", dtype=torch.bfloat16).model).exact
    assert (
        TargetModel(tiny_target("gemma2").model).exact
        and TargetModel(tiny_target("llama", dtype=torch.bfloat16).model).exact
    )
    assert declines("cpu") is None and "CPU only" in declines("cuda:0")  # bf16 refused there before a load
    daemon = [sys.executable, "-m", "launch.target_daemon", "--model", str(folder), "--proposer", "none"]
    for dtype, says, code in (
        ("bfloat16", "only float32 is exact: use --dtype float32 or auto", 1),
        ("float16", "invalid choice: 'float16'", 2),
    ):
        done = subprocess.run([*daemon, "--dtype", dtype], capture_output=True, text=True, timeout=120)
        assert done.returncode == code and says in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]


def test_a_dtype_that_names_none_is_refused_by_the_library_in_words(tmp_path):
    """`TargetModel.load(folder, dtype="nonsense")` raised "module 'torch' has no attribute" (an audit)."""
    from target_node.model.target import TargetModel

    folder = tmp_path / "llama"
    tiny_target("llama").model.save_pretrained(folder)
    with pytest.raises(
        ValueError, match="a target's dtype is auto or one of float32, float16, bfloat16, got 'nonsense'"
    ):
        TargetModel.load(folder, dtype="nonsense")
