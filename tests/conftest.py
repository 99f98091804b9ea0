import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# Two threads on CI's two cores; fewer when the machine is shared with a background job.
torch.set_num_threads(int(os.environ.get("DFLASH_TEST_THREADS", "2")))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny forward passes run faster on one thread, and far faster than two on a busy 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template: text in and out, at tiny-model speed."""
    from helpers import tiny_target
    from transformers import AutoTokenizer

    from target_node.model.default_model import ensure_default_model

    folder = tmp_path_factory.mktemp("tiny-chat")
    tiny_target("llama", seed=5, vocab=49152).model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(ensure_default_model()).save_pretrained(folder)
    return folder
