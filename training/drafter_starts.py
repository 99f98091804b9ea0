"""Where a drafter in training starts, and how a trained one leaves: random weights, a smaller
drafter grown deeper, target layers copied in, the DFlash2 format around a DFlash drafter, and
the export that folds the training-time feature scale into fc.

Each start keeps the drafts of what it starts from where it can (a grown layer adds nothing to
the residual stream until trained), so training begins where the last drafter ended, not from noise.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from draft_node.checkpoint import random_drafter
from draft_node.config import DFlashConfig, in_dflash2
from draft_node.model import DFlashDrafter


def init_drafter(cfg: DFlashConfig, seed: int, out_scale: float = 0.3) -> DFlashDrafter:
    """Small random weights, and a small output norm so the first drafts are unsure, not wrong.

    Starting the output norm at 1 (or at the target's own final norm) gives confident random
    logits and a first phase spent only unlearning them; 0.3 measured lower loss on SmolLM2.
    DFlash2's convolutions start as the identity: random kernels would scale every sublayer's
    input and output by ~0.02.
    """
    drafter = random_drafter(cfg, seed=seed)
    with torch.no_grad():
        drafter.norm.weight.fill_(out_scale)
        for name, p in drafter.named_parameters():
            if name.endswith(("base_kernel", "kernel_projection.weight")):
                p.copy_(_dflash2_start(name, p))
    return drafter


def _dflash2_start(name: str, like: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The first value of a tensor DFlash2 adds to a DFlash drafter: convolutions that pass each
    row through (tap 0 is 1 on both sides, no dynamic part), and small random codebooks and
    projection (a zero start has no gradient: the selector's pair term is a product)."""
    if name.endswith("base_kernel"):
        identity = torch.zeros(like.shape)
        identity[:, 0] = 1.0
        return identity
    if name.endswith("kernel_projection.weight"):
        return torch.zeros(like.shape)
    return torch.randn(like.shape, generator=generator) * 0.02


def export_drafter(drafter: DFlashDrafter, scale: torch.Tensor) -> DFlashDrafter:
    """A plain drafter whose fc absorbs the feature scale: same outputs, public format."""
    out = copy.deepcopy(drafter).float().cpu().eval()
    with torch.no_grad():
        out.fc.weight.mul_(scale.float().cpu()[None, :])
    return out


def grown_state(drafter: DFlashDrafter, cfg: DFlashConfig) -> dict[str, torch.Tensor]:
    """`drafter`'s weights for a drafter of config `cfg` with as many or more layers, and in the
    DFlash2 format where `cfg` is and `drafter` is not.

    Each added layer copies the last trained one but with zero output projections (o_proj,
    down_proj), so it adds nothing to the residual stream; DFlash2's additions start as
    `_dflash2_start` has them, identity convolutions. Either way the grown drafter's outputs
    equal the trained one's, and training starts from there rather than from noise.
    """
    have = drafter.config.num_hidden_layers
    source = (
        in_dflash2(drafter.config, cfg.vocab_size, cfg.selector_rank, cfg.selector_top_k)
        if cfg.dflash2
        else drafter.config
    )
    same_shape = replace(source, num_hidden_layers=cfg.num_hidden_layers, layer_types=cfg.layer_types)
    if same_shape != cfg or have > cfg.num_hidden_layers:
        raise ValueError(f"--init drafter has config {drafter.config}, this run trains {cfg}")
    state = dict(drafter.state_dict())
    if source is not drafter.config:
        with torch.device("meta"):
            skeleton = DFlashDrafter(replace(cfg, num_hidden_layers=have, layer_types=cfg.layer_types[:have]))
        generator = torch.Generator().manual_seed(0)
        for name, p in skeleton.state_dict().items():
            if name not in state:
                state[name] = _dflash2_start(name, p, generator)
    last = f"layers.{have - 1}."
    for i in range(have, cfg.num_hidden_layers):
        for name, weight in list(state.items()):
            if name.startswith(last):
                new = f"layers.{i}." + name[len(last) :]
                zero = name.endswith(("o_proj.weight", "down_proj.weight"))
                state[new] = torch.zeros_like(weight) if zero else weight.clone()
    return state


def grown_drafter(drafter: DFlashDrafter, layers: int) -> DFlashDrafter:
    """`drafter` grown to `layers` layers by `grown_state`: the same drafts at the deeper drafter's
    cost, a start for training it or a stand-in for timing one (docs/deployment.md)."""
    if layers < drafter.config.num_hidden_layers:
        raise ValueError(f"cannot grow a {drafter.config.num_hidden_layers}-layer drafter to {layers} layers")
    have = drafter.config.layer_types
    cfg = replace(drafter.config, num_hidden_layers=layers, layer_types=(*have, *[have[-1]] * (layers - len(have))))
    grown = DFlashDrafter(cfg)
    grown.load_state_dict({k: v.float() for k, v in grown_state(drafter, cfg).items()})
    grown.draft_vocab = getattr(drafter, "draft_vocab", [])
    return grown.eval()


def target_layers_state(model: torch.nn.Module, cfg: DFlashConfig, layer_ids: list[int]) -> dict[str, torch.Tensor]:
    """Drafter layer i's weights from target decoder layer `layer_ids[i]` (attention, MLP, their
    norms; q/k norms where the target has them, else ones): a drafter layer has a target layer's
    shapes (config_for_target), so it can start from what the target learned instead of noise.
    The fusion (fc, hidden_norm) and the output norm keep their fresh start."""
    if len(layer_ids) != cfg.num_hidden_layers:
        raise ValueError(f"{len(layer_ids)} target layers named for a drafter of {cfg.num_hidden_layers}")
    decoder = model.get_decoder().layers
    state = {}
    for i, layer_id in enumerate(layer_ids):
        if not 0 <= layer_id < len(decoder):
            raise ValueError(f"target layer {layer_id} does not exist (it has {len(decoder)})")
        theirs = decoder[layer_id].state_dict()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[f"layers.{i}.self_attn.{name}.weight"] = theirs[f"self_attn.{name}.weight"]
        for name in ("gate_proj", "up_proj", "down_proj"):
            state[f"layers.{i}.mlp.{name}.weight"] = theirs[f"mlp.{name}.weight"]
        for name in ("input_layernorm", "post_attention_layernorm"):
            state[f"layers.{i}.{name}.weight"] = theirs[f"{name}.weight"]
        for name in ("q_norm", "k_norm"):
            ones = torch.ones(cfg.head_dim)
            state[f"layers.{i}.self_attn.{name}.weight"] = theirs.get(f"self_attn.{name}.weight", ones)
    return {k: v.detach().float().clone() for k, v in state.items()}


def as_dflash2(drafter: DFlashDrafter, vocab_size: int, rank: int = 0, top_k: int = 0) -> DFlashDrafter:
    """`drafter` in the DFlash2 format (`in_dflash2`'s shapes): it drafts exactly as before, through
    identity convolutions, with a selector of small random codebooks. A DFlash2 drafter comes back
    as a copy."""
    cfg = in_dflash2(drafter.config, vocab_size, rank, top_k)
    out = DFlashDrafter(cfg)
    out.load_state_dict({k: v.float() for k, v in grown_state(drafter, cfg).items()})
    out.draft_vocab = list(drafter.draft_vocab)
    return out.to(drafter.dtype).eval()
