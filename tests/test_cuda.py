"""The GPU path: the same losslessness checks with models on a CUDA device. Skipped without one.

`benchmarks/gpu_run.py` runs this file first when a GPU is lent; elsewhere it only proves it collects.
"""

import copy

import pytest
import torch
from helpers import OracleBackend, assert_lossless, greedy, tiny_target

from draft_node.checkpoint import config_for_target, random_drafter, save_drafter
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposers import DFlashProposer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPT = [5, 17, 42, 99, 3, 7]
MAX_NEW = 40


@pytest.fixture(scope="module")
def target():
    gpu = tiny_target("qwen3", seed=4)
    gpu.model.to("cuda")
    return type(gpu)(gpu.model)  # rebuilt on the device: its head choice is made there


def test_the_target_runs_on_the_gpu_and_decodes_like_cpu(target):
    assert target.device.type == "cuda" and target.greedy_head is None
    cpu = tiny_target("qwen3", seed=4)
    # Two devices' plain answers: no promise makes them equal bit for bit, so a near-tie may part them.
    assert_lossless(cpu, PROMPT, greedy(target, PROMPT, MAX_NEW), greedy(cpu, PROMPT, MAX_NEW), tie=1e-4)


@pytest.mark.parametrize("tree_nodes, dflash2", [(0, False), (12, False), (12, True)])
def test_speculation_on_the_gpu_is_lossless(target, tree_nodes, dflash2):
    """dflash2: a DFlash2 drafter on the GPU, its convolution and its selector's walk there too."""
    cfg = config_for_target(target.config, block_size=8, taps=3, dflash2=dflash2)
    drafter = random_drafter(cfg).to("cuda")
    result = generate(
        target, PROMPT, DFlashProposer(LocalDraftBackend(drafter)), DecodeOptions(MAX_NEW, tree_nodes=tree_nodes)
    )
    assert_lossless(target, PROMPT, result.tokens, greedy(target, PROMPT, MAX_NEW))
    want = greedy(target, PROMPT, MAX_NEW, stop_on_eos=False)
    oracle = DFlashProposer(OracleBackend(target, PROMPT + want, 8, target_layer_ids=(0, 2)))
    result = generate(
        target, PROMPT, oracle, DecodeOptions(MAX_NEW, stop_on_eos=False, adaptive=False, tree_nodes=tree_nodes)
    )
    assert result.tokens == want and result.stats.accepted == result.stats.proposed


def test_a_gpu_draft_daemon_serves_a_gpu_target(target, tmp_path):
    from launch.local import daemon
    from target_node.drafting.remote import RemoteDraftBackend

    cfg = config_for_target(target.config, block_size=8, taps=3)
    checkpoint = save_drafter(random_drafter(cfg, seed=2), tmp_path / "drafter")
    address = f"ipc://{tmp_path}/draft.sock"
    args = ["--checkpoint", str(checkpoint), "--device", "cuda"]
    with daemon("draft daemon", "launch.draft_daemon", address, args, 120):
        backend = RemoteDraftBackend(address, target)
        result = generate(target, PROMPT, DFlashProposer(backend), DecodeOptions(MAX_NEW, adaptive=False))
        backend.close()
    assert_lossless(target, PROMPT, result.tokens, greedy(target, PROMPT, MAX_NEW))
    assert result.stats.sources == {"dflash": result.stats.steps - result.stats.plain_steps}


def test_training_forward_equals_inference_on_the_gpu():
    cfg = config_for_target(tiny_target("llama").config, block_size=4, taps=2)
    drafter = random_drafter(cfg, seed=1, std=0.2).to("cuda")
    features = torch.randn(2, 12, cfg.feature_width, device="cuda")
    anchors = torch.tensor([[3, 7], [5, 9]], device="cuda")
    noise = torch.randn(2, 2, cfg.block_size, cfg.hidden_size, device="cuda")
    with torch.no_grad():
        rows = drafter.forward_anchors(features, anchors, noise)
    for s in range(2):
        for n in range(2):
            a = int(anchors[s, n])
            want = drafter(features[s, :a], torch.arange(a, device="cuda"), noise[s, n], a)
            torch.testing.assert_close(rows[s, n], want, atol=1e-4, rtol=1e-4)


def test_sessions_drafted_in_one_pass_on_the_gpu_get_each_its_bits_alone():
    """On the GPU the pass runs torch's row-wise kernels on fixed blocks of rows, so each
    session's drafts are its bits alone, and the daemon's load check says so."""
    from draft_node.kv_cache import DraftKVCache, DraftStep, drafts_alone_in_one_pass, propose

    cfg = config_for_target(tiny_target("qwen3").config, block_size=8, taps=3, dflash2=True)
    drafter = random_drafter(cfg, seed=3, std=0.2).to("cuda")
    assert drafts_alone_in_one_pass(drafter)
    g = torch.Generator().manual_seed(0)
    steps = []
    for n in (0, 5, 30, 100):
        cache = DraftKVCache(drafter, 64)
        cache.append(0, torch.randn(n, cfg.feature_width, generator=g).cuda())
        steps.append((cache, torch.randn(2, cfg.feature_width, generator=g).cuda()))
    noise = torch.randn(cfg.block_size, cfg.hidden_size, generator=g).cuda()
    alone = [propose([DraftStep(copy.deepcopy(c), c.length, f, noise, 5)])[0] for c, f in steps]
    together = propose([DraftStep(c, c.length, f, noise, 5) for c, f in steps])
    for (h_alone, g_alone), (h_together, g_together) in zip(alone, together, strict=True):
        assert torch.equal(h_together, h_alone) and torch.equal(g_together, g_alone)
