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

import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import sysconfig
import tempfile
import time
from functools import cache
from pathlib import Path

import torch

from basics.cache import CACHE_ROOT
from basics.files import as_umask_allows, left_by_gone_writers, locked, mended_mode
from basics.processes import dies_with

SOURCE = Path(__file__).with_name("cpu.cpp")
KERNEL_CACHE = CACHE_ROOT / "kernels"  # beside the project's other rebuildable files
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-std=c++20", "-fopenmp"]
# Builds the kernels for another -march than this CPU's (x86-64-v3: the AVX2 path, x86-64: the plain
# one), so a machine with AVX-512 can test the paths of CPUs without it; the Python side then takes the
# CPU for one with only that -march's features (`cpu_flags`). Not for serving: the default serves best.
MARCH_ENV = "DFLASH_MARCH"

FAILED_RETRY_S = 600.0  # a failed build is not tried again for this long (each try takes a daemon's start 20-60 s)
LIBRARY_MODE = 0o755  # read and run by every user of a shared cache, as the umask allows

log = logging.getLogger(__name__)


class KernelsUnavailable(RuntimeError):
    """The CPU kernels could not be built here (no compiler, or it failed); the message says why."""


CPUINFO = Path("/proc/cpuinfo")


def march() -> str:
    """The -march the kernels are built for: native, or $DFLASH_MARCH's."""
    return os.environ.get(MARCH_ENV, "").strip() or "native"


def flags() -> list[str]:
    """The compiler's options: FLAGS, with `march()`."""
    return [f"-march={march()}" if flag == "-march=native" else flag for flag in FLAGS]


def cpu_flags() -> str:
    """This CPU's feature flags (Linux); part of the library's key, since it is built for them.
    Where /proc says nothing, what the compiler's -march=native selects stands for them: the
    processor's name alone was "" on Linux, one key for every CPU of a shared cache (an audit).
    Kernels built for another -march (`MARCH_ENV`) have that -march's features alone: those stand
    for the CPU's, so nothing takes a path (native bf16) that the build does not have."""
    if march() != "native":
        return f"{platform.machine()} {_native_target(march())}"
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {_native_target()}"


def cpu_name() -> str:
    """This CPU's model name (Linux), or the processor's as Python sees it."""
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def _native_target(arch: str = "native") -> str:
    """The -march=`arch` options the compiler enables, in the C locale (its help is translated), with
    the bf16 ones also under /proc's names, which native_bf16 looks for."""
    try:
        command = [_compiler(), f"-march={arch}", "-Q", "--help=target"]
        env = {**os.environ, "LC_ALL": "C"}
        out = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env).stdout
    except (KernelsUnavailable, OSError, subprocess.SubprocessError):
        return ""
    lines = [line.split() for line in out.splitlines()]
    enabled = [words[0] for words in lines if len(words) == 2 and words[1] == "[enabled]"]
    march = [" ".join(words) for words in lines if words and words[0] == "-march="]
    proc_names = {"-mavx512bf16": "avx512_bf16", "-mamx-bf16": "amx_bf16"}
    return " ".join([*march, *enabled, *(proc_names[o] for o in enabled if o in proc_names)])


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
    this machine's (its key names the source, compiler, torch and CPU flags).

    A library is loaded only once its checksum says it is whole: a truncated one (a full disk, a
    crash before write-back) killed every process with a bus error, for good (an audit). Any
    trouble with the folder (read-only, not a folder) makes the kernels unavailable, with the
    reason, where it was a traceback; a whole library in a read-only folder still loads."""

    compiler = _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise KernelsUnavailable(f"{compiler} does not run: {err}") from err
    key = hashlib.sha256(
        "\n".join([SOURCE.read_text(), version, torch.__version__, cpu_flags(), " ".join(flags())]).encode()
    ).hexdigest()[:16]
    folder = KERNEL_CACHE / key
    library = folder / "dflash_kernels.so"
    if not _whole(library):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with locked(folder, "build of the CPU kernels"):
                if not _whole(library):
                    _compile(compiler, library)
        except OSError as err:
            raise KernelsUnavailable(f"cannot build the kernels in {folder}: {err}") from err
    mended_mode(library, LIBRARY_MODE)
    _refuse_untrusted_place(library)
    try:
        torch.ops.load_library(str(library))
    except OSError as err:
        raise KernelsUnavailable(f"cannot load {library}: {err}") from err
    return folder


def _refuse_untrusted_place(library: Path) -> None:
    """No kernels from a place another user could have written: one could put code there that this
    process loads (a cache under a 1777 folder, DFLASH_SPLIT_CACHE=/srv/shared: an audit). Every
    folder from the library up to / is owned by this user, root, or whoever owns this code (whose
    code runs here anyway), and none of them may be written by anyone; only above the cache
    folder does the sticky bit (/tmp) make that safe: below it, anyone could make the folders
    first (a review). A group's shared cache is its members' choice. Every such path is named."""
    trusted = {os.getuid(), 0, SOURCE.stat().st_uid}
    cache = KERNEL_CACHE.parent
    problems = []
    for path in (library, *library.parents):
        try:
            info = path.stat()
        except OSError:
            continue  # not made yet: made below as the umask says
        above_cache = path != cache and path in cache.parents
        if info.st_uid not in trusted:
            problems.append(f"{path} belongs to another user (uid {info.st_uid})")
        elif info.st_mode & stat.S_IWOTH and not (above_cache and info.st_mode & stat.S_ISVTX):
            problems.append(f"any user may write {path} (chmod o-w {path})")
    if problems:
        raise KernelsUnavailable(
            "no kernels from where another user could have put code in them: " + "; ".join(problems)
        )


def _checksum(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _whole(library: Path) -> bool:
    """Whether `library` is there with the checksum its build wrote beside it."""
    try:
        return library.with_suffix(".sha256").read_text().strip() == _checksum(library)
    except OSError:
        return False


def _compile(compiler: str, library: Path) -> None:
    """Compile into a file of this process's own (a killed build's orphaned compiler wrote the one
    the next build renamed, an audit), flushed to disk before it takes the library's name, and its
    checksum written last. A failure is kept beside it, and not tried again for FAILED_RETRY_S."""
    from torch.utils.cpp_extension import include_paths, library_paths

    failed = library.with_suffix(".failed")
    # A marker dated ahead (a clock stepped back, another host's on a shared disk) is as old as 0 s, not younger.
    if failed.is_file() and 0 <= time.time() - failed.stat().st_mtime < FAILED_RETRY_S:
        raise KernelsUnavailable(f"{failed.read_text().strip()} (an earlier build; delete {failed} to try again)")
    libs = library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    for gone in left_by_gone_writers(library.parent.glob("*.partial")):  # killed builds': one each, for good (an audit)
        gone.unlink(missing_ok=True)
    handle, partial = tempfile.mkstemp(dir=library.parent, prefix=f"{os.getpid()}-", suffix=".partial")
    os.close(handle)
    command = [
        compiler,
        *flags(),
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in include_paths()),
        f"-I{sysconfig.get_paths()['include']}",
        str(SOURCE),
        "-o",
        partial,
        *(f"-L{p}" for p in libs),
        *(f"-Wl,-rpath,{p}" for p in libs),
        "-lc10",
        "-ltorch_cpu",
    ]
    log.info("compiling the CPU kernels (once per machine): %s", library.parent)
    try:
        # The compiler's driver ends with this process, so no library is linked after a kill (it went on and
        # wrote a partial no one removed: an audit); the compile step it started may finish on its own.
        done = subprocess.run(command, capture_output=True, text=True, preexec_fn=dies_with(os.getpid()))
        if done.returncode != 0:
            lines = done.stderr.splitlines()
            why = [line for line in lines if "error" in line][:5] or lines[-3:] or [f"exit code {done.returncode}"]
            message = "compiling dflash_kernels/cpu.cpp failed: " + " | ".join(why)
            if done.returncode > 0:  # a compiler killed by a signal (out of memory, a stop) may do next time
                failed.write_text(message + "\n")
            raise KernelsUnavailable(message)
        _durable(Path(partial))
        as_umask_allows(Path(partial), LIBRARY_MODE)  # other users of a shared cache fell back to torch's ops
        os.replace(partial, library)
    finally:
        Path(partial).unlink(missing_ok=True)
    checksum = library.with_suffix(".sha256")
    written = checksum.with_suffix(".partial")
    written.write_text(_checksum(library) + "\n")
    _durable(written)
    os.replace(written, checksum)
    failed.unlink(missing_ok=True)
    _durable(library.parent)


def _durable(path: Path) -> None:
    """Flush a file's (or a folder's entries') writes to disk before anything depends on them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
