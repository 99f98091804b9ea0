"""Training hands the C heap's free pages back (training/heap.py)."""

import sys

import pytest
import torch

from training.heap import release_freed_memory


def anon_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RssAnon is Linux's")
def test_free_pages_below_a_live_tensor_go_back_to_the_system():
    """What a training run left behind: once a large tensor is freed, glibc serves tensors below
    that size from its heap, and the pages of those freed under a live one stay with the process."""
    if not release_freed_memory():
        pytest.skip("this C library has no malloc_trim")
    torch.empty(8 << 20, dtype=torch.uint8).fill_(1)  # freed at once: glibc raises its mmap threshold
    held = [torch.empty(512 << 10, dtype=torch.uint8).fill_(1) for _ in range(400)]  # 200 MB, from the heap
    top = held.pop()
    del held  # freed, but below `top`: the heap cannot shrink past it
    before = anon_kb()
    release_freed_memory()
    after = anon_kb()
    assert before - after > 100_000, (before, after)
    del top
