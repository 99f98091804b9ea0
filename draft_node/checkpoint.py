"""Read and write drafters in the public DFlash checkpoint layout (config.json + model.safetensors).

Released checkpoints load unchanged; checkpoints we write (random test drafters, trained
drafters) use the same layout so every path through the system loads them the same way.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from basics.files import as_umask_allows, write_atomically
from draft_node.config import CheckpointError, DFlashConfig, in_dflash2, load_config, read_json
from draft_node.model import DFlashDrafter


def load_drafter(
    folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> DFlashDrafter:
    """Load a checkpoint folder, refusing missing, extra or misshapen tensors by name."""
    cfg = load_config(folder)
    weights_path = Path(folder) / "model.safetensors"
    if not weights_path.is_file():
        raise CheckpointError(f"{folder} has no model.safetensors")
    try:
        weights = load_file(str(weights_path))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{weights_path} cannot be read: {exc}") from None
    with torch.device("meta"):
        skeleton = DFlashDrafter(cfg)
    expected = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    misshapen = [
        f"{name} is {tuple(weights[name].shape)}, expected {shape}"
        for name, shape in expected.items()
        if name in weights and tuple(weights[name].shape) != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if extra:
        problems.append(f"unexpected tensors {extra}")
    if misshapen:
        problems.append("inconsistent shapes: " + "; ".join(misshapen))
    if problems:
        raise CheckpointError(f"checkpoint {folder} does not match its config.json: " + "; ".join(problems))
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(weights)
    drafter.draft_vocab = load_draft_vocab(folder)
    return drafter.to(device=device, dtype=dtype).eval()


DRAFT_VOCAB_FILE = "draft_vocab.json"


def load_draft_vocab(folder: str | Path) -> list[int]:
    """Our optional addition to the public layout: the token ids a drafter proposes from.

    Public checkpoints have no such file and propose from the whole vocabulary ([]).
    """
    path = Path(folder) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return []
    ids = read_json(path)
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):  # not true, which is an int
        raise CheckpointError(f"{path} must hold a JSON list of token ids")
    return ids


def save_draft_vocab(folder: str | Path, token_ids: list[int]) -> Path:
    path = Path(folder) / DRAFT_VOCAB_FILE
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps([int(i) for i in token_ids]) + "\n"))
    return path


def save_drafter(drafter: DFlashDrafter, folder: str | Path) -> Path:
    """Write `drafter` (with the draft vocabulary load_drafter attached, or none) to `folder`.

    Each file is replaced whole, the weights last: a save killed midway (a training rank ended by
    torchrun) left half a model.safetensors in place of the last good one (an audit). Where the
    folder holds another drafter's config or vocabulary, its weights go first, so a save killed
    before its own weights leaves a folder that says it has none, not one whose parts disagree.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = json.dumps(drafter.config.to_json(), indent=2) + "\n"
    vocab = [int(i) for i in getattr(drafter, "draft_vocab", None) or []]
    if not _holds(folder, config, vocab):
        (folder / "model.safetensors").unlink(missing_ok=True)
    write_atomically(folder / "config.json", lambda tmp: tmp.write_text(config))
    if vocab:  # what load_drafter attached: a load-save round trip keeps it
        save_draft_vocab(folder, vocab)
    else:  # an earlier drafter's would be read as this one's
        (folder / DRAFT_VOCAB_FILE).unlink(missing_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}

    def weights(tmp: Path) -> None:
        # Bytes written here, not safetensors' save_file: that writes a file of its own naming
        # beside it first (.tmpXXXXXX, 0600), which a save killed midway left for good (an audit).
        tmp.write_bytes(save(state, metadata={"format": "pt"}))
        as_umask_allows(tmp)  # written 0600 by safetensors before: unreadable to a shared cache's other users

    write_atomically(folder / "model.safetensors", weights)
    return folder


def _holds(folder: Path, config: str, vocab: list[int]) -> bool:
    """Whether `folder`'s config and draft vocabulary are these already (a run's next save)."""
    try:
        return (folder / "config.json").read_text() == config and load_draft_vocab(folder) == vocab
    except (OSError, UnicodeDecodeError, CheckpointError):
        return False


def random_drafter(cfg: DFlashConfig, seed: int = 0, std: float = 0.02) -> DFlashDrafter:
    """A random-weight drafter: proposes junk, which verification must still turn into exact output."""
    generator = torch.Generator().manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    return drafter.eval()


def config_for_target(
    target_config,  # any transformers PretrainedConfig
    *,
    num_layers: int = 1,
    block_size: int = 8,
    taps: int | list[int] = 5,
    mask_token_id: int | None = None,
    sliding_window: int | None = None,
    layer_types: list[str] | None = None,
    dflash2: bool = False,
) -> DFlashConfig:
    """A drafter shaped to fit a target: its hidden size, its depth, a mask id its vocabulary has.
    `taps`: the target layers it reads, or how many, spread over the target's depth. `dflash2`: in
    the DFlash2 format, with the published convolution and selector shapes (kernel 2, groups of 16
    channels, rank 256, top 16; smaller where the target is smaller) and blocks that see all their
    rows, as the published checkpoints have them."""
    target_config = target_config.get_text_config(decoder=True)
    hidden = target_config.hidden_size
    depth = target_config.num_hidden_layers
    heads = getattr(target_config, "num_attention_heads", None)
    if heads:
        kv_heads = getattr(target_config, "num_key_value_heads", None) or heads
        head_dim = getattr(target_config, "head_dim", None) or hidden // heads
    else:  # a target without attention (state-space layers only): a common attention shape
        head_dim = 64 if hidden % 64 == 0 else hidden
        heads = kv_heads = hidden // head_dim
    if isinstance(taps, int):
        count = min(taps, depth)
        # Spread over depth, from layer 1 up to the second-to-last layer.
        spread = (round(1 + i * (depth - 3) / max(count - 1, 1)) for i in range(count))
        target_layer_ids = sorted({min(depth - 1, max(0, layer)) for layer in spread})
    else:
        target_layer_ids = list(taps)
    cfg = DFlashConfig(
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=getattr(target_config, "intermediate_size", None) or 3 * hidden,
        target_layer_ids=tuple(target_layer_ids),
        block_size=block_size,
        mask_token_id=target_config.vocab_size - 1 if mask_token_id is None else mask_token_id,
        num_target_layers=depth,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        rope_theta=float((getattr(target_config, "rope_parameters", None) or {}).get("rope_theta", 1e6)),
        layer_types=tuple(layer_types or ()),
        sliding_window=sliding_window,
    )
    return replace(in_dflash2(cfg, target_config.vocab_size), is_causal=False) if dflash2 else cfg
