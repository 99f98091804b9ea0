"""Compile the CPU kernels on the machine that runs them, once, and load them.

The kernels are built with `-march=native` for this CPU and `-ffp-contract=off` (the compiler
may not fuse or reorder float operations: the order is the kernels' own), against the installed
torch, so the library is keyed by the source, the compiler, torch's version and this CPU's
flags, and kept under the cache folder. Concurrent processes (two daemons starting together)
take a lock; the first compiles, the others wait and load the same file. No compiler means no
engine on CPU: the target falls back to the transformers path and says why, a drafter keeps torch's
matmuls.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu.cpp")
# Beside the project's other rebuildable files ($DFLASH_SPLIT_CACHE, as target_node.CACHE_ROOT), which
# this package, below both nodes, cannot import.
KERNEL_CACHE = Path(os.environ.get("DFLASH_SPLIT_CACHE", Path.home() / ".cache" / "dflash-split")) / "kernels"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-std=c++20", "-fopenmp"]

log = logging.getLogger(__name__)


class KernelsUnavailable(RuntimeError):
    """The CPU kernels could not be built here (no compiler, or it failed); the message says why."""


def cpu_flags() -> str:
    """This CPU's feature flags (Linux); part of the library's key, since it is built for them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def native_bf16() -> bool:
    """Whether this CPU has native bf16 dot products (AVX512-BF16 or AMX-BF16)."""
    flags = cpu_flags().split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise KernelsUnavailable("no C++ compiler (g++) on PATH")


@cache
def load() -> Path:
    """Build (if needed) and load the kernels into torch.ops.dflash; returns their folder, which is
    this machine's (its key names the source, compiler, torch and CPU flags)."""

    compiler = _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise KernelsUnavailable(f"{compiler} does not run: {err}") from err
    key = hashlib.sha256(
        "\n".join([SOURCE.read_text(), version, torch.__version__, cpu_flags(), " ".join(FLAGS)]).encode()
    ).hexdigest()[:16]
    folder = KERNEL_CACHE / key
    library = folder / "dflash_kernels.so"
    folder.mkdir(parents=True, exist_ok=True)
    with locked(folder):
        if not library.is_file():
            _compile(compiler, library)
    torch.ops.load_library(str(library))
    return folder


@contextmanager
def locked(folder: Path) -> Iterator[None]:
    """One process at a time in `folder`: concurrent daemons wait for one build (or one measurement)."""
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _compile(compiler: str, library: Path) -> None:
    from torch.utils.cpp_extension import include_paths, library_paths

    libs = library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = [
        compiler,
        *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in include_paths()),
        f"-I{sysconfig.get_paths()['include']}",
        str(SOURCE),
        "-o",
        str(library.with_suffix(".partial")),
        *(f"-L{p}" for p in libs),
        *(f"-Wl,-rpath,{p}" for p in libs),
        "-lc10",
        "-ltorch_cpu",
    ]
    log.info("compiling the CPU kernels (once per machine): %s", library.parent)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "error" in line][:5]
        raise KernelsUnavailable("compiling dflash_kernels/cpu.cpp failed: " + " | ".join(errors))
    library.with_suffix(".partial").rename(library)
