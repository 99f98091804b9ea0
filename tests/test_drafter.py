"""The DFlash drafter: checkpoint format, attention rules, cached vs recompute."""

import json

import pytest
import torch
from helpers import drafter_config
from safetensors.torch import load_file, save_file

from draft_node.checkpoint import load_drafter, random_drafter, save_drafter
from draft_node.config import FULL, SLIDING, CheckpointError, DFlashConfig, load_config
from draft_node.kv_cache import DraftKVCache, OutOfOrderError


def inputs(cfg, context=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(context, cfg.feature_width, generator=g)
    noise = torch.randn(cfg.block_size, cfg.hidden_size, generator=g)
    return features, torch.arange(context), noise, context


def test_checkpoint_round_trip_is_bit_identical(tmp_path):
    cfg = drafter_config(layer_types=(FULL, SLIDING), sliding_window=5)
    drafter = random_drafter(cfg, seed=1, std=0.3)
    folder = save_drafter(drafter, tmp_path / "ckpt")
    loaded = load_drafter(folder)
    assert loaded.config == cfg
    assert torch.equal(drafter(*inputs(cfg)), loaded(*inputs(cfg)))
    assert len(load_file(str(folder / "model.safetensors"))) == 3 + 11 * cfg.num_hidden_layers


def test_public_layout_with_five_layers_has_58_tensors(tmp_path):
    folder = save_drafter(random_drafter(drafter_config(num_hidden_layers=5)), tmp_path / "c")
    names = set(load_file(str(folder / "model.safetensors")))
    assert len(names) == 58
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.4.self_attn.q_norm.weight"} <= names
    assert not any(n.startswith("model.") for n in names)


def _rewrite(folder, change):
    weights = load_file(str(folder / "model.safetensors"))
    change(weights)
    save_file(weights, str(folder / "model.safetensors"))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda w: w.pop("layers.1.mlp.up_proj.weight"), "missing tensors.*layers.1.mlp.up_proj.weight"),
        (lambda w: w.__setitem__("lm_head.weight", torch.zeros(2, 2)), "unexpected tensors.*lm_head.weight"),
        (lambda w: w.__setitem__("fc.weight", torch.zeros(32, 96)), r"fc.weight is \(32, 96\), expected \(32, 64\)"),
    ],
)
def test_loader_names_what_is_wrong(tmp_path, change, message):
    folder = save_drafter(random_drafter(drafter_config()), tmp_path / "bad")
    _rewrite(folder, change)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(folder)


def test_loader_refuses_missing_files_and_fields(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_drafter(tmp_path)
    folder = save_drafter(random_drafter(drafter_config()), tmp_path / "c")
    raw = json.loads((folder / "config.json").read_text())
    del raw["dflash_config"]["block_size"]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="no 'block_size'"):
        load_drafter(folder)
    (folder / "model.safetensors").unlink()
    raw["block_size"] = 4
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_drafter(folder)


def test_dflash_config_wins_over_top_level_and_top_level_is_the_fallback(tmp_path):
    folder = save_drafter(random_drafter(drafter_config()), tmp_path / "c")
    raw = json.loads((folder / "config.json").read_text())
    dflash = raw.pop("dflash_config")
    raw.update(dflash)  # all three fields at the top level only
    (folder / "config.json").write_text(json.dumps(raw))
    assert load_config(folder) == drafter_config()
    raw["dflash_config"] = {"block_size": 16, "mask_token_id": 3}  # these win; target_layer_ids falls back
    raw["rope_parameters"] = {"rope_theta": 10000.0}
    del raw["rope_theta"]
    (folder / "config.json").write_text(json.dumps(raw))
    cfg = load_config(folder)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids, cfg.rope_theta) == (16, 3, (0, 2), 10000.0)


def test_config_validation_names_the_problem():
    with pytest.raises(CheckpointError, match="sliding_window"):
        drafter_config(layer_types=(FULL, SLIDING))
    with pytest.raises(CheckpointError, match=r"target_layer_ids \[9\]"):
        drafter_config(target_layer_ids=(0, 9))


def _dflash(raw: dict) -> dict:
    return raw["dflash_config"]


# Each was read as something else, or ended the daemon's start in a traceback, a hang or a read
# past a kernel's rows (an audit).
HOSTILE_CONFIGS = [
    (lambda r: r.__setitem__("hidden_size", "big"), "hidden_size must be an integer, got 'big'"),
    (lambda r: r.__setitem__("hidden_size", None), "hidden_size must be an integer"),
    (lambda r: r.__setitem__("num_attention_heads", 0), "num_attention_heads must be at least 1"),
    (lambda r: r.__setitem__("num_key_value_heads", 0), "num_key_value_heads must be at least 1"),
    (lambda r: (r.__setitem__("num_hidden_layers", 0), r.pop("layer_types")), "num_hidden_layers must be at least 1"),
    (lambda r: r.__setitem__("head_dim", 7), "head_dim must be even"),
    (lambda r: r.__setitem__("rms_norm_eps", "x"), "rms_norm_eps must be a number"),
    (lambda r: r.__setitem__("rope_theta", "abc"), "rope_theta must be a number"),
    (lambda r: r.__setitem__("rope_scaling", [1, 2]), "must be JSON objects"),
    (lambda r: r.__setitem__("rope_scaling", {"rope_type": "linear", "factor": "two"}), "rope factor must be a number"),
    (lambda r: r.__setitem__("sliding_window", "16"), "sliding_window must be an integer"),
    (lambda r: r.__setitem__("sliding_window", -4), "sliding_window must be positive"),
    (lambda r: r.__setitem__("is_causal", "false"), "is_causal must be true or false"),
    (lambda r: r.__setitem__("dflash_config", [1]), "dflash_config must be a JSON object"),
    (lambda r: _dflash(r).__setitem__("target_layer_ids", "02"), "target_layer_ids must be a list"),
    (lambda r: _dflash(r).__setitem__("target_layer_ids", [0, 0]), "name a layer twice"),
    (lambda r: _dflash(r).__setitem__("block_size", 8.9), "block_size must be an integer"),
    (lambda r: _dflash(r).__setitem__("block_size", True), "block_size must be an integer"),
    (lambda r: _dflash(r).__setitem__("block_size", 20000), r"block_size must be in 2..128"),
]


@pytest.mark.parametrize("change, message", HOSTILE_CONFIGS)
def test_a_config_field_of_the_wrong_type_or_size_is_refused_by_name(change, message):
    raw = json.loads(json.dumps(drafter_config().to_json()))
    change(raw)
    with pytest.raises(CheckpointError, match=message):
        DFlashConfig.from_json(raw)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("config.json", "{not json", "config.json is not JSON"),
        ("config.json", "[1, 2]", "must hold a JSON object"),
        ("model.safetensors", "", "model.safetensors cannot be read"),
        ("model.safetensors", "garbage" * 100, "model.safetensors cannot be read"),
        ("draft_vocab.json", "[1, 2", "draft_vocab.json is not JSON"),
        ("draft_vocab.json", "[true, 3]", "list of token ids"),  # loaded, then refused at every handshake
    ],
)
def test_a_file_that_does_not_read_is_refused_by_name(tmp_path, name, content, message):
    folder = save_drafter(random_drafter(drafter_config()), tmp_path / "c")
    (folder / name).write_text(content)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(folder)


def test_sliding_layer_ignores_context_outside_its_window():
    window = 4
    cfg = drafter_config(num_hidden_layers=1, layer_types=(SLIDING,), sliding_window=window)
    drafter = random_drafter(cfg, std=0.3)
    features, positions, noise, n = inputs(cfg)
    base = drafter(features, positions, noise, n)
    old = features.clone()
    old[: n - window] += 5.0  # rows no block row can see: (n + i) - window >= the row's position
    assert torch.allclose(drafter(old, positions, noise, n)[0], base[0])
    recent = features.clone()
    recent[n - 1] += 5.0
    assert not torch.allclose(drafter(recent, positions, noise, n), base)
    # Causal inside the block: a later noise row does not change an earlier one.
    later = noise.clone()
    later[-1] += 5.0
    out = drafter(features, positions, later, n)
    assert torch.allclose(out[:-1], base[:-1]) and not torch.allclose(out[-1], base[-1])


def test_full_layer_sees_all_context_and_the_whole_block():
    cfg = drafter_config(num_hidden_layers=1)
    drafter = random_drafter(cfg, std=0.3)
    features, positions, noise, n = inputs(cfg)
    base = drafter(features, positions, noise, n)
    old = features.clone()
    old[0] += 5.0
    assert not torch.allclose(drafter(old, positions, noise, n)[0], base[0])
    later = noise.clone()
    later[-1] += 5.0
    assert not torch.allclose(drafter(features, positions, later, n)[0], base[0])


@pytest.mark.parametrize("block_size", [4, 16])
def test_cached_drafter_equals_recompute(block_size):
    """Long run with rewinds and ring wrap-around, both layer types."""
    capacity = 24
    cfg = drafter_config(block_size=block_size, layer_types=(FULL, SLIDING), sliding_window=6)
    drafter = random_drafter(cfg, seed=2, std=0.3)
    g = torch.Generator().manual_seed(5)
    all_features = torch.randn(200, cfg.feature_width, generator=g)
    cache = DraftKVCache(drafter, capacity)
    synced, n, steps = 0, 10, 0
    while n < 190:
        noise = torch.randn(block_size, cfg.hidden_size, generator=g)
        cache.append(synced, all_features[synced:n])
        cached, _ = cache.draft_rows(noise, n, block_size - 1)
        # A rewind after the ring wrapped leaves fewer rows: the slots it freed held positions
        # already overwritten. The cache must hold exactly a contiguous run ending at n.
        held = sorted(cache.positions[cache.positions >= 0].tolist())
        lo = held[0]
        assert held == list(range(lo, n)) and lo >= n - capacity - 3
        reference = drafter(all_features[lo:n], torch.arange(lo, n), noise, n)
        torch.testing.assert_close(cached, reference[1:], rtol=1e-5, atol=1e-5)
        synced = n
        steps += 1
        if steps % 7 == 0:  # the target rolled back a few positions
            n -= 3
            synced = n - 2
        n += int(torch.randint(1, block_size + 1, (1,), generator=g))
    assert steps > 20


def test_a_bf16_drafter_infers_in_fp32_on_the_kernels_and_hands_back_bf16(monkeypatch):
    """On the CPU kernels a bf16 drafter's activations are fp32, which only saves conversions: its
    context ring stays bf16 and its block hidden states leave in bf16 and are those of torch's bf16 path
    (norms in torch, activations rounded after every op) up to that path's rounding; training
    (grad enabled) keeps the weights' dtype."""
    import dflash_kernels

    if not dflash_kernels.available():
        pytest.skip("no CPU kernels here: nothing differs")
    cfg = drafter_config(block_size=8, layer_types=(FULL, SLIDING), sliding_window=6)
    drafter = random_drafter(cfg, seed=4, std=0.3).to(torch.bfloat16)
    features, positions, noise, n = inputs(cfg, context=20, seed=6)
    cache = DraftKVCache(drafter, 64)
    cache.append(0, features)
    fast, _ = cache.draft_rows(noise.to(torch.bfloat16), n, cfg.block_size - 1)
    assert cache.keys.dtype == torch.bfloat16 and fast.dtype == torch.bfloat16
    monkeypatch.setattr(dflash_kernels, "available", lambda: False)  # torch's path, bf16 throughout
    slow = drafter(features, positions, noise.to(torch.bfloat16), n)[1:]
    assert slow.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), slow.float(), rtol=0.1, atol=0.1)  # a few bf16 roundings apart
    assert (fast.float() - slow.float()).abs().mean() < 0.03 * slow.float().abs().mean()  # here: 1.1%
    monkeypatch.undo()
    with torch.enable_grad():
        assert drafter.activation_dtype() == torch.bfloat16


def test_on_the_kernels_a_draft_is_torchs_through_wraps_rollbacks_and_passes_of_many(monkeypatch):
    """Full-attention drafters infer on the CPU kernels (draft_node/kernel_path.py): a draft equals
    torch's path up to fp32 rounding through a ring that wraps and rolls back (its holes listed as
    keys), and sessions drafted in one pass get the bits each gets alone."""
    import dflash_kernels
    from draft_node import kernel_path
    from draft_node.kv_cache import DraftStep, drafts_alone_in_one_pass, propose

    if not dflash_kernels.available():
        pytest.skip("no CPU kernels here: torch's path is the only one")
    cfg = drafter_config(block_size=8)
    drafter = random_drafter(cfg, seed=3, std=0.3)
    with torch.inference_mode():
        assert kernel_path.serves(drafter)
    assert not kernel_path.serves(drafter)  # training (grad on): torch's path
    passes = []
    monkeypatch.setattr(kernel_path, "run_blocks", lambda *a, f=kernel_path.run_blocks: passes.append(1) or f(*a))
    g = torch.Generator().manual_seed(8)
    rows = torch.randn(120, cfg.feature_width, generator=g)
    fast, slow = DraftKVCache(drafter, 32), DraftKVCache(drafter, 32)
    n, synced, worst, holes = 6, 0, 0.0, 0
    for step in range(30):
        noise = torch.randn(cfg.block_size, cfg.hidden_size, generator=g)
        fast.append(synced, rows[synced:n])
        holes += bool((fast.positions[: min(fast.length, fast.capacity)] < 0).any())
        got, _ = fast.draft_rows(noise, n, cfg.block_size - 1)
        with monkeypatch.context() as torch_only:
            torch_only.setattr(kernel_path, "serves", lambda drafter: False)
            slow.append(synced, rows[synced:n])
            want, _ = slow.draft_rows(noise, n, cfg.block_size - 1)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        worst = max(worst, float((got - want).abs().max()))
        synced = n
        if step % 5 == 4:  # the target rolled back: after the wrap, slots in the ring are left empty
            n, synced = n - 3, n - 5
        n += 1 + step % 4
    assert len(passes) == 30 and fast.length > fast.capacity and worst > 0  # the kernels' path, its own bits
    assert holes > 0  # drafts whose visible keys were listed, not a range
    assert drafts_alone_in_one_pass(drafter)
    steps = [
        DraftStep(DraftKVCache(drafter, 32), 0, rows[:k], torch.randn(8, cfg.hidden_size, generator=g), 7)
        for k in (3, 40)
    ]
    together = propose(steps)
    for step, (hidden, _) in zip(steps, together, strict=True):
        step.cache.reset(0)
        assert torch.equal(propose([step])[0][0], hidden)


def test_cache_refuses_gaps_and_can_restart_later():
    cfg = drafter_config()
    cache = DraftKVCache(random_drafter(cfg), 16)
    features = torch.randn(10, cfg.feature_width)
    cache.append(0, features[:4])
    with pytest.raises(OutOfOrderError):
        cache.append(6, features[6:8])
    with pytest.raises(OutOfOrderError):
        cache.draft_rows(torch.randn(cfg.block_size, cfg.hidden_size), 5, cfg.block_size - 1)
    cache.reset(6)  # a sender whose older rows are gone starts the context here
    cache.append(6, features[6:8])
    assert cache.length == 8 and sorted(cache.positions[cache.positions >= 0].tolist()) == [6, 7]


def test_draft_vocabulary_file_round_trips_and_is_checked(tmp_path):
    from draft_node.checkpoint import save_draft_vocab

    folder = save_drafter(random_drafter(drafter_config()), tmp_path / "c")
    assert load_drafter(folder).draft_vocab == []  # public checkpoints: the whole vocabulary
    save_draft_vocab(folder, [5, 3, 9])
    assert load_drafter(folder).draft_vocab == [5, 3, 9]
    (folder / "draft_vocab.json").write_text('{"ids": [1]}')
    with pytest.raises(CheckpointError, match="list of token ids"):
        load_drafter(folder)


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
}


@pytest.mark.parametrize("kind", [None, *ROPE_SCALINGS])
def test_drafter_rope_matches_transformers(kind):
    """Plain and scaled RoPE rotate queries and keys exactly as the transformers rotary embedding does."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    from draft_node.model import Rotary

    scaling = ROPE_SCALINGS.get(kind)
    cfg = drafter_config(rope_scaling=scaling, max_position_embeddings=1024 if scaling else None)
    hf = Qwen3Config(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=1024,
        rope_parameters={**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta},
    )
    positions = torch.tensor([0, 1, 7, 300, 1000])
    x = torch.randn(len(positions), cfg.num_attention_heads, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    cos, sin = Qwen3RotaryEmbedding(hf)(x, positions[None])
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    assert torch.allclose(Rotary(cfg)(x, positions), want[0].transpose(0, 1), atol=1e-4)


def test_rope_fields_are_read_in_every_spelling_and_round_trip(tmp_path):
    raw = drafter_config().to_json()
    del raw["rope_theta"]
    raw["rope_scaling"] = {"type": "linear", "factor": 2.0}  # the older spelling
    raw["rope_parameters"] = {"rope_theta": 5e5}
    cfg = DFlashConfig.from_json(raw)
    assert (cfg.rope_theta, cfg.rope_scaling) == (5e5, {"rope_type": "linear", "factor": 2.0})
    raw.pop("rope_scaling")
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, **ROPE_SCALINGS["yarn"]}
    cfg = DFlashConfig.from_json(raw)
    assert cfg.rope_scaling == ROPE_SCALINGS["yarn"] and cfg.rope_theta == 1e6
    folder = save_drafter(random_drafter(cfg), tmp_path / "yarn")
    assert load_config(folder) == cfg
    assert torch.isfinite(load_drafter(folder)(*inputs(cfg))).all()
    assert DFlashConfig.from_json(drafter_config().to_json()).rope_scaling is None


@pytest.mark.parametrize(
    "rope, message",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "sequence length"),
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "sequence length"),
        ({"rope_type": "wavy", "factor": 2.0}, "'wavy' is not supported"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial"),
        ({"full_attention": {"rope_type": "default"}}, "per-layer"),
        ({"rope_type": "yarn", "factor": 4.0}, "needs original_max_position_embeddings"),
    ],
)
def test_unsupported_rope_is_refused_by_name(rope, message):
    raw = drafter_config().to_json()
    raw["rope_parameters"] = rope
    with pytest.raises(CheckpointError, match=message):
        DFlashConfig.from_json(raw)
