"""DFlash2 checkpoints: the public layout loads unchanged, the block forward and the selector walk
equal a reference port, and a real draft daemon serving one keeps the output exactly greedy.

The reference below is written from the published math (vLLM's `qwen3_dflash2.py` and NeMo's
plain-PyTorch DFlash2, read for the facts, not copied) straight over the checkpoint's tensors:
explicit loops for the convolution, explicit softmax attention, the selector's whole lattice
of scores before its walk. It shares no code with draft_node or the target's selector.
"""

import json
import math

import pytest
import torch
from helpers import draft_daemon, greedy, tiny_target
from safetensors.torch import load_file, save_file

from draft_node.checkpoint import config_for_target, load_drafter, random_drafter, save_drafter
from draft_node.config import CheckpointError
from protocol import ErrorCode
from protocol.transport import request
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.drafting import remote
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposers import DFlashProposer
from target_node.drafting.remote import RemoteDraftBackend
from target_node.drafting.selector import Lattice, Selector, SelectorSpec, rerank

H, HEADS, KV, HD, INNER, LAYERS, VOCAB = 64, 4, 2, 16, 96, 2, 200
BLOCK, TAPS, GROUP, RANK, TOP_K, WINDOW = 8, 2, 16, 12, 5, 6
TARGET_LAYERS, TAPPED = 4, [0, 2]


def public_checkpoint(folder, seed=0, **config_changes):
    """A random drafter written as the published DFlash2 checkpoints are: config keys and tensor
    names by hand (not through draft_node), bare `base_kernel` and codebook tensors, no prefix."""
    g = torch.Generator().manual_seed(seed)
    config = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "intermediate_size": INNER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HD,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "is_causal": False,
        "layer_types": ["sliding_attention"] * LAYERS,
        "sliding_window": WINDOW,
        "num_target_layers": TARGET_LAYERS,
        "dflash_config": {
            "block_size": BLOCK,
            "mask_token_id": VOCAB - 1,
            "target_layer_ids": TAPPED,
            "conv_kernel_size": TAPS,
            "conv_group_size": GROUP,
            "selector_rank": RANK,
            "selector_top_k": TOP_K,
        },
    }
    config.update(config_changes)

    def rand(*shape, std=0.15):
        return torch.randn(*shape, generator=g) * std

    w = {
        "fc.weight": rand(H, H * len(TAPPED)),
        "hidden_norm.weight": 1 + rand(H, std=0.1),
        "norm.weight": 1 + rand(H, std=0.1),
        "candidate_selector.hidden_projection.weight": rand(RANK, H),
        "candidate_selector.predecessor_codebook": rand(VOCAB, RANK, std=0.5),
        "candidate_selector.successor_codebook": rand(VOCAB, RANK, std=0.5),
    }
    for i in range(LAYERS):
        p = f"layers.{i}."
        w |= {
            p + "input_layernorm.weight": 1 + rand(H, std=0.1),
            p + "post_attention_layernorm.weight": 1 + rand(H, std=0.1),
            p + "self_attn.q_proj.weight": rand(HEADS * HD, H),
            p + "self_attn.k_proj.weight": rand(KV * HD, H),
            p + "self_attn.v_proj.weight": rand(KV * HD, H),
            p + "self_attn.o_proj.weight": rand(H, HEADS * HD),
            p + "self_attn.q_norm.weight": 1 + rand(HD, std=0.1),
            p + "self_attn.k_norm.weight": 1 + rand(HD, std=0.1),
            p + "mlp.gate_proj.weight": rand(INNER, H),
            p + "mlp.up_proj.weight": rand(INNER, H),
            p + "mlp.down_proj.weight": rand(H, INNER),
        }
        for conv in ("attention_conv", "mlp_conv"):
            w[p + conv + ".base_kernel"] = rand(2, TAPS, H, std=0.5)
            w[p + conv + ".kernel_projection.weight"] = rand(2 * TAPS * (H // GROUP), H)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(w, str(folder / "model.safetensors"))
    return folder


# --- the reference port -----------------------------------------------------------------------


def ref_norm(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_rope(x, positions, theta=10000.0):
    """x [rows, heads, d], NeoX halves."""
    half = x.shape[-1] // 2
    inv = 1.0 / theta ** (torch.arange(half, dtype=torch.float32) / half)
    angle = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def ref_conv(x, base, deltas):
    """out[t, c] = sum_{j <= t} (base[j, c] + deltas[t, j, c // GROUP]) * x[t - j, c], one block."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(min(TAPS, t + 1)):
            for c in range(x.shape[1]):
                out[t, c] += (base[j, c] + deltas[t, j, c // GROUP]) * x[t - j, c]
    return out


def ref_sublayer(run, u, w, prefix):
    deltas = (u @ w[prefix + "kernel_projection.weight"].T).view(u.shape[0], 2, TAPS, H // GROUP)
    base = w[prefix + "base_kernel"]
    return ref_conv(run(ref_conv(u, base[0], deltas[:, 0])), base[1], deltas[:, 1])


def ref_block(w, features, noise, position):
    """The drafter's final-normed block rows [BLOCK, H]: context rows 0..position-1, noise [BLOCK, H]."""
    ctx = ref_norm(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    ctx_pos, rows = torch.arange(features.shape[0]), position + torch.arange(BLOCK)
    h = noise.clone()
    for i in range(LAYERS):
        p = f"layers.{i}."

        def attend(u, p=p):
            q = ref_rope(
                ref_norm(
                    (u @ w[p + "self_attn.q_proj.weight"].T).view(-1, HEADS, HD), w[p + "self_attn.q_norm.weight"]
                ),
                rows,
            )

            def keys(x, where):
                k = ref_norm(
                    (x @ w[p + "self_attn.k_proj.weight"].T).view(-1, KV, HD), w[p + "self_attn.k_norm.weight"]
                )
                return ref_rope(k, where), (x @ w[p + "self_attn.v_proj.weight"].T).view(-1, KV, HD)

            (kc, vc), (kb, vb) = keys(ctx, ctx_pos), keys(u, rows)
            k, v = torch.cat([kc, kb]), torch.cat([vc, vb])
            # Not causal inside the block (is_causal false); sliding: context within the window.
            seen = torch.cat(
                [
                    (ctx_pos[None] < position) & (rows[:, None] - ctx_pos[None] < WINDOW),
                    torch.ones(BLOCK, BLOCK, dtype=torch.bool),
                ],
                1,
            )
            out = torch.empty(BLOCK, HEADS, HD, dtype=u.dtype)
            for head in range(HEADS):
                kv = head // (HEADS // KV)
                scores = (q[:, head] @ k[:, kv].T) / math.sqrt(HD)
                out[:, head] = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ v[:, kv]
            return out.reshape(BLOCK, -1) @ w[p + "self_attn.o_proj.weight"].T

        def mlp(u, p=p):
            gate, up = u @ w[p + "mlp.gate_proj.weight"].T, u @ w[p + "mlp.up_proj.weight"].T
            return (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

        h = h + ref_sublayer(attend, ref_norm(h, w[p + "input_layernorm.weight"]), w, p + "attention_conv.")
        h = h + ref_sublayer(mlp, ref_norm(h, w[p + "post_attention_layernorm.weight"]), w, p + "mlp_conv.")
    return ref_norm(h, w["norm.weight"])


def ref_walk(w, logits, hidden, anchor, multiplier=1.0, cap=0.0):
    """vLLM's shape of it: the whole lattice scores[s, prev candidate, candidate], then the walk."""
    order = torch.sort(logits, dim=-1, descending=True, stable=True)
    cand, unary = order.indices[:, :TOP_K], order.values[:, :TOP_K] * multiplier
    if cap:
        unary = torch.tanh(unary / cap) * cap
    gate = hidden @ w["candidate_selector.hidden_projection.weight"].T
    pred, succ = w["candidate_selector.predecessor_codebook"], w["candidate_selector.successor_codebook"]
    n = logits.shape[0]
    scores = torch.empty(n, TOP_K, TOP_K)
    for s in range(n):
        for a in range(TOP_K):
            before = anchor if s == 0 else int(cand[s - 1, a])
            for b in range(TOP_K):
                scores[s, a, b] = unary[s, b] + torch.dot(pred[before] * gate[s], succ[cand[s, b]])
    chain, prev = [], 0
    for s in range(n):
        prev = int(torch.argmax(scores[s, prev]))
        chain.append(int(cand[s, prev]))
    return chain


# --- conformance --------------------------------------------------------------------------------


def test_the_public_layout_loads_unchanged_and_round_trips(tmp_path):
    folder = public_checkpoint(tmp_path / "public")
    drafter = load_drafter(folder)
    cfg = drafter.config
    assert cfg.dflash2 and cfg.is_causal is False and not any(cfg.causal(t) for t in cfg.layer_types)
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (
        TAPS,
        GROUP,
        RANK,
        TOP_K,
    )
    written = load_file(str(folder / "model.safetensors"))
    assert {k: v.shape for k, v in drafter.state_dict().items()} == {k: v.shape for k, v in written.items()}
    again = load_drafter(save_drafter(drafter, tmp_path / "again"))
    assert again.config == cfg and all(
        torch.equal(a, b) for a, b in zip(again.state_dict().values(), drafter.state_dict().values(), strict=True)
    )


def test_block_forward_equals_the_reference(tmp_path):
    """Against the reference computed in float64, the drafter's fp32 block is as close as the
    same reference computed in fp32 (a few 1e-6 on values of order 1, through two layers): what
    is left is fp32 rounding in other summation orders (explicit softmax, torch's matmul, a
    loop per tap, vs SDPA and the CPU kernels' linear), not a difference in the math."""
    folder = public_checkpoint(tmp_path / "public", seed=3)
    drafter, w = load_drafter(folder), load_file(str(folder / "model.safetensors"))
    w64 = {k: v.double() for k, v in w.items()}
    g = torch.Generator().manual_seed(1)
    for context in (3, 11):  # inside and past the window
        features, noise = torch.randn(context, H * len(TAPPED), generator=g), torch.randn(BLOCK, H, generator=g)
        ours = drafter(features, torch.arange(context), noise, context).double()
        exact = ref_block(w64, features.double(), noise.double(), context)
        rounding = (ref_block(w, features, noise, context).double() - exact).abs().max()
        assert exact.abs().max() > 0.5 and 0 < rounding < 1e-5
        assert (ours - exact).abs().max() <= max(4 * rounding, 1e-6), ((ours - exact).abs().max(), rounding)


@pytest.mark.parametrize("multiplier, cap", [(1.0, 0.0), (0.3, 2.0)])
def test_selector_walk_equals_the_reference(tmp_path, multiplier, cap):
    folder = public_checkpoint(tmp_path / "public", seed=4)
    w = load_file(str(folder / "model.safetensors"))
    drafter = load_drafter(folder)
    spec = SelectorSpec(RANK, TOP_K, VOCAB, multiplier, cap)
    selector = Selector(spec, *drafter.codebooks())
    g = torch.Generator().manual_seed(2)
    differs = 0
    for trial in range(20):
        hidden, logits = torch.randn(BLOCK - 1, H, generator=g), torch.randn(BLOCK - 1, VOCAB, generator=g) * 2
        logits[0, :3] = logits[0].max()  # ties: the lower id goes first
        anchor = trial * 7 % VOCAB
        chain = selector.lattice(logits, drafter.gate(hidden), anchor).greedy()
        assert chain == ref_walk(w, logits, hidden, anchor, multiplier, cap)
        differs += chain != logits.argmax(-1).tolist()
        reranked = rerank(logits, chain)
        lattice = selector.lattice(logits, drafter.gate(hidden), anchor)
        assert torch.equal(rerank(logits, chain, lattice.ids[:, 0]), reranked)  # the candidates name the argmax
        assert reranked.argmax(-1).tolist() == chain  # and the values are the same, the top one an ulp up
        torch.testing.assert_close(reranked.sort(-1).values, logits.sort(-1).values, rtol=1e-6, atol=0)
    assert differs > 0, "the pair term never changed a choice: the walk was not exercised"


def test_many_blocks_walked_at_once_take_each_blocks_own_walk(tmp_path):
    """The offline estimate walks thousands of blocks in one pass per row (`block_scores`,
    `greedy_walk`): each block's chain is the one its own lattice walks, ties included."""
    from target_node.drafting.selector import greedy_walk

    drafter = load_drafter(public_checkpoint(tmp_path / "public", seed=4))
    selector = Selector(SelectorSpec(RANK, TOP_K, VOCAB), *drafter.codebooks())
    g = torch.Generator().manual_seed(6)
    blocks = 12
    hidden, logits = torch.randn(blocks, BLOCK - 1, H, generator=g), torch.randn(blocks, BLOCK - 1, VOCAB, generator=g)
    logits[0, 0, :3] = logits[0, 0].max()  # a tie at the top
    anchors = torch.randint(VOCAB, (blocks,), generator=g)
    unary, ids = selector.candidates(logits)
    walks = greedy_walk(selector.block_scores(unary, ids, drafter.gate(hidden), anchors), ids)
    alone = [selector.lattice(logits[b], drafter.gate(hidden[b]), int(anchors[b])).greedy() for b in range(blocks)]
    assert walks.tolist() == alone
    assert walks.tolist() != ids[..., 0].tolist(), "the pair term never changed a choice"


def test_candidates_searched_among_a_draft_vocabulary_are_those_of_the_whole_one():
    """A drafter with a draft vocabulary has finite logits only there: searching those ids alone
    finds the same candidates in the same order, ties at the top (in id order) included."""
    g = torch.Generator().manual_seed(8)
    among = torch.randperm(VOCAB, generator=g)[: VOCAB // 3]
    selector = Selector(SelectorSpec(RANK, TOP_K, VOCAB), torch.randn(VOCAB, RANK), torch.randn(VOCAB, RANK))
    for _ in range(10):
        logits = torch.full((BLOCK - 1, VOCAB), float("-inf"))
        logits[:, among] = torch.randn(BLOCK - 1, len(among), generator=g)
        logits[:, among[:3]] = logits.max(-1, keepdim=True).values  # three ids tie for first place
        whole, searched = selector.candidates(logits), selector.candidates(logits, among)
        assert torch.equal(whole[0], searched[0]) and torch.equal(whole[1], searched[1])


def test_a_sampled_walk_draws_each_draft_from_the_q_it_reports():
    """At T > 0 the walk draws row by row, each row's candidate from softmax(scores / T) after the
    candidate drawn before it: the pairs' frequencies follow that chained law (not the rows'
    marginals), and each q row is the distribution its draft came from, zero off the candidates."""
    from protocol.sampling import SamplingParams
    from target_node.decoding.sampling import Sampler, probabilities

    g = torch.Generator().manual_seed(5)
    k, vocab, temperature = 3, 11, 0.7
    ids = torch.tensor([[4, 9, 1], [2, 7, 5]])
    scores = torch.randn(2, k, k, generator=g) * 2
    scores[0] = scores[0, 0]  # row 0 follows the anchor: the same for every predecessor
    lattice = Lattice(ids, scores, vocab)
    sampler = Sampler(SamplingParams(temperature=temperature, seed=3))
    first = torch.softmax(scores[0, 0] / temperature, -1)
    law = {(int(ids[0, i]), int(ids[1, j])): float(first[i] * torch.softmax(scores[1, i] / temperature, -1)[j])
           for i in range(k) for j in range(k)}  # fmt: skip
    runs, counts, qs, firsts = 20000, {}, [], []
    for _ in range(runs):
        drafts, q = sampler.draft([0, 0], None, lattice)
        counts[tuple(drafts)] = counts.get(tuple(drafts), 0) + 1
        qs.append(q)
        firsts.append(ids[0].tolist().index(drafts[0]))
    q = torch.stack(qs)  # every run's q, checked at once (one check a run took 7 of its 17 s)
    torch.testing.assert_close(q[:, 0, ids[0]], first.expand(runs, k))
    seconds = torch.stack([probabilities(scores[1, i], sampler.params) for i in range(k)])
    torch.testing.assert_close(q[:, 1, ids[1]], seconds[torch.tensor(firsts)])
    assert float(q.sum(-1).sub(1).abs().max()) < 1e-6 and int((q > 0).sum((1, 2)).max()) <= 2 * k
    for pair, p in law.items():  # 4 sigma of a binomial count
        assert abs(counts.get(pair, 0) / runs - p) <= 4 * math.sqrt(p * (1 - p) / runs) + 1e-3, (pair, p)
    greedy_params = Sampler(SamplingParams(temperature=1.0, top_k=1, seed=3))
    assert greedy_params.draft([0, 0], None, lattice)[0] == lattice.greedy()


def test_a_config_missing_a_dflash2_key_is_refused_by_name(tmp_path):
    folder = public_checkpoint(tmp_path / "public")
    config = json.loads((folder / "config.json").read_text())
    del config["dflash_config"]["selector_rank"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="selector_rank"):
        load_drafter(folder)


# --- in the split -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=3)


@pytest.fixture(scope="module")
def checkpoint(target, tmp_path_factory):
    """A random DFlash2 drafter shaped for the tiny target, in the public layout."""
    cfg = config_for_target(target.config, num_layers=1, block_size=6, dflash2=True)
    return save_drafter(random_drafter(cfg, seed=2, std=0.2), tmp_path_factory.mktemp("d2") / "drafter")


PROMPTS = [[5, 17, 42, 99, 3, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [200, 100, 50, 25]]


def test_a_real_draft_daemon_serves_it_and_output_stays_greedy(target, checkpoint, tmp_path, monkeypatch):
    """Through `dflash-draft-daemon --checkpoint` unchanged: the handshake says dflash2, the
    codebooks arrive in pieces (a small piece size here), and greedy output, chain or tree, is
    the target's own; the selector's chains are what the remote proposes, as in process."""
    monkeypatch.setattr(remote, "MAX_CODEBOOK_ROWS", 64)
    address = f"ipc://{tmp_path}/d2.sock"
    local = DFlashProposer(LocalDraftBackend(load_drafter(checkpoint)))
    with draft_daemon(address, checkpoint):
        backend = RemoteDraftBackend(address, target)
        try:
            assert backend.info["format"] == "dflash2" and backend.info["selector"]["rank"] == min(
                256, target.hidden_size
            )
            before = backend.counters["round_trips"]
            proposer = DFlashProposer(backend)
            for prompt in PROMPTS:
                want = greedy(target, prompt, 24)
                for tree in (0, 8):
                    got = generate(target, prompt, proposer, DecodeOptions(24, adaptive=False, tree_nodes=tree))
                    assert got.tokens == want and got.stats.proposed > 0
                    alone = generate(target, prompt, local, DecodeOptions(24, adaptive=False, tree_nodes=tree))
                    assert got.stats.accepted == alone.stats.accepted  # the same drafts, wherever they ran
            assert proposer.drafting.selector is not None  # the walk ran, over codebooks from the wire
            pieces = -(-target.vocab_size // 64)
            assert backend.counters["round_trips"] - before >= pieces  # fetched once, in pieces
        finally:
            backend.close()


def test_a_target_that_drives_dflash_only_is_refused_with_the_reason(target, checkpoint, tmp_path):
    address = f"ipc://{tmp_path}/d2.sock"
    with draft_daemon(address, checkpoint):
        hello = {"wire_dtypes": ["float32"], "target": target.info, "formats": ["dflash"]}
        reply = request(address, "hello", hello, timeout_s=30)
        assert reply.type == "error" and reply["code"] == ErrorCode.CONFIG_MISMATCH.value
        assert "dflash2" in reply["message"] and "drives dflash drafters only" in reply["message"]
        codebook = request(address, "codebook", {"start": target.vocab_size, "rows": 1}, timeout_s=30)
        assert codebook.type == "error" and "pass the codebooks" in codebook["message"]


def test_the_selector_benchmark_times_both_paths_on_a_saved_drafter(target, checkpoint, tmp_path):
    from benchmarks.bench_selector import main

    target.model.save_pretrained(tmp_path / "model")
    result = main(["--drafter", str(checkpoint), "--model", str(tmp_path / "model"), "--rounds", "1", "--calls", "3"])
    assert result["dflash_ms"] > 0 and result["dflash2_ms"] > 0
    with pytest.raises(SystemExit, match="not a DFlash2 drafter"):
        dflash = save_drafter(random_drafter(config_for_target(target.config, num_layers=1)), tmp_path / "v1")
        main(["--drafter", str(dflash), "--model", str(tmp_path / "model")])


def test_codebooks_whose_scores_overflow_draft_without_the_selector_and_the_batch_goes_on(target, checkpoint):
    """Finite codebooks of 1e20 (or 1e14 with gates of 1e14, inside the gates' bound) overflow in
    the pair scores: a sampled step's softmax turned NaN and `multinomial` failed every request in
    the batch, greedy ones too (an audit). Such a block now drafts by the head's argmaxes: the
    sampled request runs to its end, the greedy one stays the target's own."""
    from protocol.sampling import SamplingParams

    drafter = load_drafter(checkpoint)
    with torch.no_grad():
        selector = drafter.candidate_selector
        selector.predecessor_codebook.copy_(selector.predecessor_codebook.sign() * 1e20)
        selector.successor_codebook.copy_(-selector.successor_codebook.sign() * 1e20)
    proposer = DFlashProposer(LocalDraftBackend(drafter))
    for sampling in (SamplingParams(temperature=0.8, seed=3), SamplingParams()):
        options = DecodeOptions(24, sampling=sampling, adaptive=False, stop_on_eos=False)
        result = generate(target, PROMPTS[0], proposer, options)
        assert len(result.tokens) == 24 and result.stats.proposed > 0
    assert result.tokens == greedy(target, PROMPTS[0], 24, stop_on_eos=False)


def test_a_daemons_codebooks_past_their_bound_are_refused_and_output_stays_greedy(
    target, checkpoint, tmp_path, monkeypatch
):
    """Codebooks of 1e14 passed the finiteness check; past MAX_CODEBOOK they are now refused as
    the drafter's fault, and the target decodes on without them."""
    import weakref

    from target_node.drafting import bridge

    monkeypatch.setattr(bridge, "_SELECTORS", weakref.WeakKeyDictionary())  # fetched, not remembered
    from helpers import serving_in_thread

    from draft_node.daemon import DraftService, serve
    from draft_node.settings import DraftSettings
    from protocol import encode

    class Loud(DraftService):
        def on_codebook(self, msg):
            start, rows = msg["start"], msg["rows"]
            p, s = (b[start : start + rows].float() * 1e14 for b in self.drafter.codebooks())
            return encode("codebook_ok", msg.id, {}, {"predecessor": p, "successor": s}, wire_dtype="float32")

    address = f"ipc://{tmp_path}/loud.sock"
    service = Loud(load_drafter(checkpoint), DraftSettings(ring_capacity=512))
    with serving_in_thread(lambda wire, stop: serve(service, wire, stop), address):
        backend = RemoteDraftBackend(address, target, timing=remote.LinkTiming(timeout_s=5.0, retry_s=0.0))
        proposer = DFlashProposer(backend)
        try:
            result = generate(target, PROMPTS[0], proposer, DecodeOptions(24, adaptive=False))
        finally:
            backend.close()
    assert result.tokens == greedy(target, PROMPTS[0], 24)
    assert proposer.drafting is None and "dflash" not in result.stats.sources  # the fallback drafted
