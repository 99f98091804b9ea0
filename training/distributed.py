"""Training on many ranks: `torchrun --nproc_per_node N -m launch.train ...` (gloo on CPUs, NCCL on GPUs).

Every rank holds the whole drafter (a few tens of MB: data parallelism, not sharding) and takes its
share of each step's batch; DDP sums the gradients. The batch of a step is drawn as one process
would draw it and then split, and the loss is normalised by the whole batch's weight, so N ranks
take the step one process takes with the same `--batch` (up to the order of float sums), and a run
saved on N ranks resumes on any other number. Rank 0 alone writes checkpoints and logs; all ranks
read the same cache folder (one machine, or a shared file system across hosts).
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from basics.processes import a_torchrun_rank_ends_with_its_launcher


@dataclass(frozen=True)
class Ranks:
    """Where this process stands among the training processes."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """The rank that writes checkpoints and logs."""
        return self.rank == 0

    @property
    def many(self) -> bool:
        return self.world > 1

    def share(self, count: int) -> slice:
        """This rank's contiguous part of `count` items (the first ranks take one more where it does not divide)."""
        base, extra = divmod(count, self.world)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (self.rank < extra))

    def total(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the ranks (itself on one rank)."""
        if self.many:
            value = value.clone()
            dist.all_reduce(value)
        return value

    def most(self, value: int) -> int:
        """The largest of the ranks' `value`s: a signal one rank heard stops every rank after one
        step. On the collective's device: an NCCL group takes no CPU tensor (a review)."""
        if not self.many:
            return value
        held = torch.tensor([value], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        return int(held.item())

    def from_main(self, value: float) -> float:
        """Rank 0's `value` on every rank: what is read from a clock (stop now, the learning rate's
        place in its schedule) must not differ between ranks."""
        return float(self.tensor_from_main(torch.tensor([value], dtype=torch.float64)).item())

    def tensor_from_main(self, value: torch.Tensor) -> torch.Tensor:
        """Rank 0's `value` on every rank, on `value`'s device: what is measured on data that ranks
        opened at different moments (a feature cache that grew meanwhile) must not differ either."""
        if not self.many:
            return value
        sent = value.detach().to(_collective_device()).clone()
        dist.broadcast(sent, 0)
        return sent.to(value.device)

    def common(self, keys: set[str]) -> set[str]:
        """The keys every rank holds: what ranks that read a growing store or cache at slightly
        different times all train on (each drew its own set, and the ranks' batches disagreed)."""
        if not self.many:
            return keys
        everyone: list[set[str] | None] = [None] * self.world
        dist.all_gather_object(everyone, keys)
        return set.intersection(*everyone)

    def barrier(self) -> None:
        if self.many:
            dist.barrier()


ONE = Ranks()


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def start(device: str) -> tuple[Ranks, str]:
    """Join the process group `torchrun` describes in the environment (one process: nothing to join).
    Returns this process's ranks and its device: on CUDA, each rank takes the GPU of its local rank."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return ONE, device
    a_torchrun_rank_ends_with_its_launcher()  # launch.train arms it first thing; a library caller here
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        # Rank 0 fills features or evaluates while the others wait at a collective: allow it time.
        dist.init_process_group(backend, timeout=datetime.timedelta(hours=2))
    return Ranks(dist.get_rank(), dist.get_world_size()), device


def stop(ranks: Ranks) -> None:
    """Leave the process group. A DDP wrapper still alive in a reference cycle (a trainer is one)
    was freed at interpreter exit, after the group was gone, and gloo's teardown then aborted the
    rank (SIGABRT, "terminate called without an active exception": a CI run, a third of exits in a
    reproduction): collect it while the group and the interpreter are whole."""
    if ranks.many and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
