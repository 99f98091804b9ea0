"""Losslessness on the real SmolLM2-135M-Instruct, with the shipped drafter, a random one and n-gram
lookup: on the engine bit for bit in fp32 and bf16, loaded as the daemons load it (dtype auto)."""

import pytest
import torch
from helpers import assert_lossless, greedy

import dflash_kernels
from draft_node.checkpoint import config_for_target, random_drafter
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposers import DFlashProposer, NGramProposer
from target_node.model.default_model import ensure_default_model
from target_node.model.target import TargetModel

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Write a Python function that checks whether a number is prime.",
    "List three facts about the moon.",
    "Explain what a hash map is in two sentences.",
]
MAX_NEW = 64


@pytest.fixture(scope="module")
def smollm():
    return TargetModel.load(ensure_default_model())


@pytest.fixture(scope="module")
def prompts(smollm):
    return [smollm.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def references(smollm, prompts):
    return [greedy(smollm, p, MAX_NEW) for p in prompts]


def test_answers_are_coherent(smollm, prompts, references):
    text = smollm.tokenizer.decode(references[0], skip_special_tokens=True)
    assert "def " in text and "prime" in text.lower()


@pytest.mark.parametrize("kind", ["random-dflash", "random-dflash2", "ngram"])
def test_speculative_equals_greedy(smollm, prompts, references, kind):
    if kind == "ngram":
        proposer = NGramProposer()
    else:  # dflash2: a random drafter in the DFlash2 format, its selector's chains drafted as a tree
        cfg = config_for_target(smollm.config, block_size=8, mask_token_id=0, dflash2=kind.endswith("2"))
        proposer = DFlashProposer(LocalDraftBackend(random_drafter(cfg)))
    trees = {"random-dflash2": 16}.get(kind, 0)
    for prompt, want in zip(prompts, references, strict=True):
        result = generate(smollm, prompt, proposer, DecodeOptions(MAX_NEW, adaptive=not trees, tree_nodes=trees))
        assert_lossless(smollm, prompt, result.tokens, want)
        assert result.stats.proposed > 0


def test_tree_speculation_with_the_shipped_drafter_equals_greedy(smollm, prompts, references):
    """Trees of 16 nodes from the trained drafter, drafting every step: branches other than the
    first child are accepted on real text, and the output is still plain greedy."""
    from draft_node.checkpoint import load_drafter
    from target_node.model.default_model import SHIPPED_DRAFTER

    proposer = DFlashProposer(LocalDraftBackend(load_drafter(SHIPPED_DRAFTER)))
    for prompt, want in zip(prompts, references, strict=True):
        result = generate(smollm, prompt, proposer, DecodeOptions(MAX_NEW, adaptive=False, tree_nodes=16))
        assert_lossless(smollm, prompt, result.tokens, want)
        assert result.stats.proposed >= 16 * (result.stats.steps - result.stats.plain_steps) * 0.9
        assert result.stats.tau > 1.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_shipped_drafter_gives_plain_output_bit_for_bit_in_every_mode(smollm, prompts, references, dtype):
    """The engine's promise on the real model: chain, tree and the governor's default all give
    exactly the plain greedy output, in fp32 and in bf16, where today's transformers path did not.
    The dtype the daemons pick here is the module's model, its greedy answers already known."""
    from draft_node.checkpoint import load_drafter
    from target_node.engine.torch_ops import TorchOps
    from target_node.model.default_model import SHIPPED_DRAFTER

    shared = smollm.model.dtype == getattr(torch, dtype)
    target = smollm if shared else TargetModel.load(ensure_default_model(), dtype=dtype)
    assert target.engine is not None and target.model.dtype == getattr(torch, dtype)
    # The screen's check below runs wherever the CPU kernels screen, not only where someone looked.
    if not isinstance(target.engine.ops, TorchOps):
        assert (target.engine.screened is not None) == dflash_kernels.screen_available()
    proposer = DFlashProposer(LocalDraftBackend(load_drafter(SHIPPED_DRAFTER, dtype=torch.bfloat16)))
    modes = {"chain": dict(adaptive=False), "tree": dict(adaptive=False, tree_nodes=12), "default": dict(tree_nodes=16)}
    for prompt, reference in zip(prompts, references, strict=True):
        want = reference if shared else greedy(target, prompt, MAX_NEW)
        for mode, options in modes.items():
            result = generate(target, prompt, proposer, DecodeOptions(MAX_NEW, **options))
            assert result.tokens == want, (dtype, mode)
        engine = target.engine
        # The int8 screen at every width, against the whole head, on one answer's rows (each
        # answer's ~33 row windows a width cost 40 s a prompt on an AVX512 EPYC).
        if engine.screened is not None and prompt is prompts[0]:
            target.reset()
            hidden, _ = target.forward(prompt + want)
            measured = engine.screen_rows, engine.screen_path
            engine.screen_rows = 17
            try:  # the module's model: its measured screen comes back whatever happens here
                for engine.screen_path in dflash_kernels.screen_paths():  # VNNI, and AMX's int8 tiles where here
                    for width in range(1, 18):
                        for start in range(0, len(hidden) - width, 3):
                            x = hidden[start : start + width]
                            whole = dflash_kernels.argmax(engine.head(x)).tolist()
                            assert engine.greedy(x) == whole, (dtype, engine.screen_path, width)
            finally:
                engine.screen_rows, engine.screen_path = measured


def test_remote_drafter_equals_local_and_greedy(smollm, prompts, references, tmp_path):
    from helpers import draft_daemon

    from draft_node.checkpoint import save_drafter
    from target_node.drafting.remote import RemoteDraftBackend

    cfg = config_for_target(smollm.config, block_size=8, mask_token_id=0)
    folder = save_drafter(random_drafter(cfg, seed=3), tmp_path / "drafter")
    local = DFlashProposer(LocalDraftBackend(random_drafter(cfg, seed=3)))
    address = f"ipc://{tmp_path}/draft.sock"
    with draft_daemon(address, folder):
        backend = RemoteDraftBackend(address, smollm)
        remote = DFlashProposer(backend)
        for prompt, want in list(zip(prompts, references, strict=True))[:2]:
            half = DecodeOptions(MAX_NEW // 2, adaptive=False)  # a greedy answer's start is the longer one's
            remote_result = generate(smollm, prompt, remote, half)
            local_result = generate(smollm, prompt, local, half)
            assert remote_result.tokens == local_result.tokens
            assert remote_result.stats.histogram == local_result.stats.histogram
            assert_lossless(smollm, prompt, remote_result.tokens, want[: MAX_NEW // 2])
        assert backend.counters["timeouts"] == 0
        backend.close()


def test_all_in_one_launcher_through_the_client(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "answers.json"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is the capital of France?"}\n{"prompt": "Name a primary color."}\n')
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.local",
            "--prompts-file",
            str(prompts),
            "--max-new-tokens",
            "24",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "draft daemon ready" in run.stdout and "target daemon ready" in run.stdout
    answers = json.loads(out.read_text())
    assert len(answers) == 2 and "Paris" in answers[0]["text"]
    for answer in answers:
        assert answer["stats"]["proposer"] == "dflash" and answer["stats"]["steps"] > 0
        assert answer["text"] in run.stdout
    assert "tau" in run.stdout and "tok/s" in run.stdout
