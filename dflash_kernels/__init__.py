"""CPU kernels whose outputs do not depend on the batch, built on the machine that runs them.

Each output element is one fixed sequence of IEEE operations over its own inputs (cpu.cpp says how),
so a row computed alone and the same row computed among others have the same bits. The target's
engine is built on them; a drafter uses their linear for speed alone. No model code here: weights
packed once (`pack`), activations in, outputs out, through `torch.ops.dflash`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from basics.files import locked
from dflash_kernels import build
from dflash_kernels.build import KernelsUnavailable, native_bf16

__all__ = [
    "KernelsUnavailable",
    "Packed",
    "Screen",
    "argmax",
    "available",
    "bf16_faster",
    "best_of_turns",
    "bf16_matmul",
    "linear",
    "load",
    "measured_once",
    "computes_bf16",
    "cuda_bf16",
    "native_bf16",
    "pack",
    "pack_screen",
    "runs_on",
    "screen_argmax",
    "screen_available",
    "screen_paths",
    "use_screen_path",
]

log = logging.getLogger(__name__)

PANEL = 64  # outputs per panel of packed weights (cpu.cpp)


@dataclass
class Packed:
    """A weight matrix [N, K] in the kernels' panel layout, and the N it computes."""

    data: torch.Tensor
    n: int


def pack(*weights: torch.Tensor) -> Packed:
    """Rows of `weights` stacked into one [N, K] matrix, then packed: fp32 as [N/64, K, 64], bf16 as
    [N/64, K/2, 64, 2] (pairs of k side by side), N padded to 64 and K to even with zeros."""
    w = torch.cat([x.detach() for x in weights])
    n, k = w.shape
    np_, kp = -(-n // PANEL) * PANEL, k + (k % 2 if w.dtype == torch.bfloat16 else 0)
    full = torch.zeros(np_, kp, dtype=w.dtype, device=w.device)
    full[:n, :k] = w
    if w.dtype == torch.bfloat16:
        data = full.view(np_ // PANEL, PANEL, kp // 2, 2).permute(0, 2, 1, 3).contiguous()
    else:
        data = full.view(np_ // PANEL, PANEL, kp).permute(0, 2, 1).contiguous()
    return Packed(data, n)


def linear(
    x: torch.Tensor,
    weight: Packed,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(x @ W.T + bias) + residual, fp32 [M, N], for fp32 rows x [M, K] (`out` may be `residual`)."""
    load()
    if out is None:
        out = torch.empty(x.shape[0], weight.n, device=x.device)
    torch.ops.dflash.linear(x, weight.data, weight.n, bias, residual, out)
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` of fp32 rows [M, N] on the CPU, the same indices (the first maximum; the first
    NaN where a row has one), in two vectorised passes: torch's CPU argmax reads about a value a
    nanosecond, so a chain verify's 8 x 49K logits cost 1 ms of a 31 ms step. Anything else: torch's."""
    # A one-column view ([7, 1] of a row's transpose) is contiguous with stride(1) != 1: the kernel
    # refused it (an audit); one column's argmax is 0 anyway.
    if x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 1 and runs_on(x.device):
        out = torch.empty(x.shape[0], dtype=torch.long)
        torch.ops.dflash.argmax(x if x.stride(1) == 1 else x.contiguous(), out)
        return out
    return x.argmax(-1)


@dataclass
class Screen:
    """An LM head [N, K] once more as int8 panels [N/64, K/4, 64, 4], a scale per token, with the
    factors of each token's error bound (`pack_screen`), for `screen_argmax`."""

    data: torch.Tensor  # int8
    coef: torch.Tensor  # fp32 [3, N padded to 64]: scale s, bound factors a and b
    colsum: torch.Tensor  # int32 [N padded]: each token's sum of its int8 weights
    n: int


def pack_screen(weight: torch.Tensor, chunk: int = 8192) -> Screen:
    """The screen of an LM head whose exact logits `linear` computes from `weight` ([N, K], fp32 or
    bf16). Why a screened token's logit v is within a*|h| + b*|d| of the exact one, for a row h (as the
    matmul rounds it) whose two int8 parts leave d: with w = s*q + e per token (q the int8 weights),
    h.w - v = e.h + s*q.d, so |h.w - v| <= |e| |h| + s |q| |d| (Cauchy-Schwarz); and `linear`'s sum of
    K products (exact in bf16, one rounding each in fp32) is within K 2^-24 sum|w_i h_i| <= K 2^-24 |w|
    |h| of h.w, taken twice here for any order of sums (AMX's too). The kernel adds the rounding of its
    own few float operations."""
    w = weight.detach()
    n, k = w.shape
    k4, np_ = -(-k // 4), -(-n // PANEL) * PANEL
    q = torch.zeros(np_, k4 * 4, dtype=torch.int8)
    coef = torch.zeros(3, np_)
    gamma = (k + 4) * 2.0**-23
    for start in range(0, n, chunk):
        rows32 = w[start : start + chunk].float()
        scale = rows32.abs().amax(1) / 127  # the kernel's scale, as it will read it
        # Any integer in [-127, 127] will do: the error is computed from the one chosen, in double.
        qi = torch.round(rows32 / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).clamp_(-127, 127)
        rows, s = rows32.double(), scale.double()
        err = torch.addcmul(rows, s[:, None], qi.double(), value=-1)
        end = start + rows.shape[0]
        q[start:end, :k] = qi.to(torch.int8)
        grow = 1 + 2.0**-20  # rounded up, as floats
        coef[0, start:end] = scale
        coef[1, start:end] = ((err.norm(dim=1) + gamma * rows.norm(dim=1)) * grow).float()
        coef[2, start:end] = ((s * qi.norm(dim=1)) * grow).float()
    colsum = q.sum(1, dtype=torch.int32)
    data = q.view(np_ // PANEL, PANEL, k4, 4).permute(0, 2, 1, 3).contiguous()
    return Screen(data, coef.contiguous(), colsum.contiguous(), n)


def screen_argmax(
    x: torch.Tensor, head: Packed, rows: torch.Tensor, screen: Screen, limit: int = 4096
) -> tuple[list[int], list[int]] | None:
    """Each row's argmax of `linear(x, head)` (head's rows [N, K] as `rows`, in its dtype), the first of
    ties, computed over only the tokens `screen` keeps for it (a row keeping more than `limit`: over all);
    and how many it kept per row. None where a row is not finite: compute the whole head then."""
    out, kept = torch.empty(x.shape[0], dtype=torch.long), torch.empty(x.shape[0], dtype=torch.long)
    done = torch.ops.dflash.screen_argmax(
        x.contiguous(), head.data, head.n, rows, screen.data, screen.coef, screen.colsum, limit, out, kept
    )
    return (out.tolist(), kept.tolist()) if done else None


@cache
def screen_available() -> bool:
    """Whether this CPU runs the int8 screen (AVX512-VNNI, as the kernels were built)."""
    return available() and bool(torch.ops.dflash.screen_available())


SCREEN_PATHS = {"vnni": 0, "amx": 1}  # cpu.cpp's screen_path: VPDPBUSD, or AMX tiles (TDPBUSD)
SCREEN_PATH_ENV = "DFLASH_SCREEN"  # forces a path (for measuring one against the other)


def screen_paths() -> list[str]:
    """The paths the screen's int8 sums can take here: VNNI, and AMX's int8 tiles where the CPU has them
    and the OS grants them (none where there is no screen). Both give the same exact int32 sums, so the
    choice is speed alone (`Engine._screen_rows` measures it). `DFLASH_SCREEN=vnni|amx` keeps one."""
    forced = os.environ.get(SCREEN_PATH_ENV, "")
    if forced and forced not in SCREEN_PATHS:
        raise ValueError(f"{SCREEN_PATH_ENV}={forced!r}: use one of {sorted(SCREEN_PATHS)}")
    if not screen_available():
        return []
    here = [name for name in SCREEN_PATHS if use_screen_path(name)]
    if forced and forced not in here:
        log.warning("%s=%s: this CPU (or its OS) offers no AMX; the screen takes VNNI", SCREEN_PATH_ENV, forced)
    return [forced] if forced in here else here


def use_screen_path(name: str) -> bool:
    """Take path `name` for this process's screens from now on; False (and VNNI) where it is not here."""
    return torch.ops.dflash.screen_path(SCREEN_PATHS[name]) == SCREEN_PATHS[name]


@cache
def available() -> bool:
    """Whether the kernels build and load here (a machine without a compiler runs torch's ops)."""
    try:
        load()
    except KernelsUnavailable as err:  # said once a process (a drafter fell back without a word: an audit)
        log.warning("the CPU kernels are unavailable here, torch's ops compute instead: %s", err)
        return False
    return True


def runs_on(device: torch.device) -> bool:
    """Whether the kernels compute for tensors on `device`: the CPU, where they build and load."""
    return device.type == "cpu" and available()


BF16_PATHS = {"avx512": 0, "amx": 1}  # cpu.cpp's linear_path: VDPBF16PS (or its fallback), AMX tiles
PREFETCH_LEVELS = {"L1": 0, "L2": 1}  # cpu.cpp's prefetch_level: where weights fetched ahead land
BF16_MATMUL_ENV = "DFLASH_BF16_MATMUL"  # forces a path for a measurement; never set it beside a serving daemon


@cache
def load() -> Path:
    """Build (if needed) and load the kernels, then fix this process's bf16 matmul path for good
    (`bf16_matmul`) before any matmul runs; returns the kernels' folder."""
    folder = build.load()
    torch.ops.dflash.linear_path(BF16_PATHS[bf16_matmul(folder)])
    name = f"prefetch-576x3072-{torch.get_num_threads()}threads"
    seconds = measured_once(folder, name, _prefetch_seconds, one_thread=False)
    torch.ops.dflash.prefetch_level(PREFETCH_LEVELS[min(seconds, key=lambda level: seconds[level])])
    return folder


def bf16_matmul(folder: Path) -> str:
    """Which instructions compute every bf16 matmul of this process: "amx" where the CPU has AMX-BF16,
    the OS grants it, and a one-row plus a nine-row matmul (a plain step and a chain verify of 8)
    measured faster on it than on AVX-512 BF16; else "avx512". The two round differently, so the
    choice is measured once per machine and read back by every process after it: a target daemon
    and the process that computed its training features, or two daemons, then share their bits.
    `DFLASH_BF16_MATMUL=amx|avx512` forces a path (for measuring one against the other)."""
    forced = os.environ.get(BF16_MATMUL_ENV, "")
    if forced:
        if forced not in BF16_PATHS:
            raise ValueError(f"{BF16_MATMUL_ENV}={forced!r}: use one of {sorted(BF16_PATHS)}")
        if torch.ops.dflash.linear_path(BF16_PATHS[forced]) == BF16_PATHS[forced]:
            return forced
        log.warning("%s=%s: this CPU (or its OS) offers no AMX; the AVX-512 path serves", BF16_MATMUL_ENV, forced)
        return "avx512"
    if torch.ops.dflash.linear_path(BF16_PATHS["amx"]) != BF16_PATHS["amx"]:
        return "avx512"  # no AMX here, or not granted: nothing to measure
    seconds = measured_once(folder, "bf16_matmul-576x3072", _path_seconds)
    return min(seconds, key=lambda path: seconds[path])


def bf16_numerics(folder: Path) -> str:
    """`bf16_matmul`'s path named by the instructions that compute it: "amx", "avx512" (VDPBF16PS),
    or "fma" where the build lacks AVX512-BF16 and its fallback computes the same dot products with
    two FMAs, equal but for subnormals, which VDPBF16PS flushes. Answers record it (`made_by`):
    an AVX2 build's were labelled "avx512" like a native one's, whose bits they need not share."""
    path = bf16_matmul(folder)
    return "fma" if path == "avx512" and not native_bf16() else path


def measured_once(
    folder: Path, name: str, measure: Callable[[], dict[str, float]], one_thread: bool = True
) -> dict[str, float]:
    """Timings kept beside the kernels (`name`.json): a choice remeasured by every process flips with
    the load of the moment (on a busy 2-core machine 1 in 8 did), and two daemons that chose
    differently give different outputs. A damaged record is measured again; delete it to remeasure.

    `one_thread`, for a choice that changes bits (the bf16 path, the dtype): at two threads beside a
    busy core, every option timed the same (the other core's wait), and the choice kept for good was
    noise (an audit). A choice of speed alone (the prefetch level, the screen's widths) is measured
    at the process's threads, under a name that says how many (a review). A folder that cannot be written
    (a read-only cache) gets a measurement for this process alone, with a warning, not a traceback."""
    record = folder / f"{name}.json"
    take = (lambda: _on_one_thread(measure)) if one_thread else measure
    seconds = _read_record(record)  # written whole (a rename), so read without the lock
    if seconds is not None:
        return seconds
    try:
        with locked(folder, "timing of the CPU kernels"):
            seconds = _read_record(record)
            if seconds is None:
                seconds = take()
                partial = record.with_suffix(".partial")
                partial.write_text(json.dumps({"seconds": seconds}))
                os.replace(partial, record)
                log.info("measured once for this machine (%s), kept in %s", name, record)
                log.debug("%s: %s", name, seconds)  # a dict of dozens of timings: no line for a user
    except OSError as err:
        log.warning("cannot keep the measurement %s in %s (%s): measured for this process alone", name, folder, err)
        seconds = take()
    return seconds


def _read_record(record: Path) -> dict[str, float] | None:
    try:
        return {str(k): float(v) for k, v in json.loads(record.read_text())["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _on_one_thread(measure: Callable[[], dict[str, float]]) -> dict[str, float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure()
    finally:
        torch.set_num_threads(threads)


def _path_seconds() -> dict[str, float]:
    """A one-row and a nine-row bf16 matmul on each path, the paths in turns."""
    return _setting_seconds(BF16_PATHS, torch.ops.dflash.linear_path, torch.bfloat16, widths=(1, 9))


def _prefetch_seconds() -> dict[str, float]:
    """A one-row matmul streaming weights with each prefetch level, on the path this process took
    (bf16 where the CPU computes it natively, else fp32), the levels in turns."""
    dtype = torch.bfloat16 if native_bf16() else torch.float32
    return _setting_seconds(PREFETCH_LEVELS, torch.ops.dflash.prefetch_level, dtype, widths=(1,))


def _setting_seconds(
    settings: dict[str, int], choose: Callable[[int], int], dtype: torch.dtype, widths: tuple[int, ...]
) -> dict[str, float]:
    """Per kernel setting, matmuls of `widths` rows over weights streamed from memory as a model's
    are (32 of 576 x 3072: 113 MB in bf16; with 8, held in a large L3, the prefetch levels measured
    alike while a step differed by 13%); the setting the process had is put back. The op itself is
    called: `linear` would load (and choose) first."""
    hidden, outputs = 576, 3072
    weights = [pack(torch.randn(outputs, hidden).to(dtype)) for _ in range(32)]
    rows = [(torch.randn(m, hidden), torch.empty(m, outputs)) for m in widths]

    def run(number: int) -> None:
        choose(number)
        for x, out in rows:
            for w in weights:
                torch.ops.dflash.linear(x, w.data, w.n, None, None, out)

    had = choose(-1)
    seconds = best_of_turns({name: lambda n=number: run(n) for name, number in settings.items()}, turns=11)
    choose(had)
    return seconds


def best_of_turns(runs: dict[str, Callable[[], None]], turns: int) -> dict[str, float]:
    """The best time of each run, the runs taking turns so a burst of load hits them alike; the
    first turn warms the caches and the thread pool and is not counted."""
    best = dict.fromkeys(runs, float("inf"))
    for turn in range(turns):
        for name, run in runs.items():
            began = time.perf_counter()
            run()
            if turn:
                best[name] = min(best[name], time.perf_counter() - began)
    return best


@cache
def bf16_faster(hidden: int = 1024, outputs: int = 4096) -> bool:
    """Whether a one-row engine matmul runs faster in bf16 than in fp32 on this machine (False where
    the kernels cannot be built); measured once per machine (`measured_once`): two daemons in
    different dtypes give different outputs."""
    if not available():
        return False
    seconds = measured_once(load(), f"bf16_faster-{hidden}x{outputs}", lambda: _one_row_seconds(hidden, outputs))
    return seconds["bfloat16"] < seconds["float32"]


def _one_row_seconds(hidden: int, outputs: int) -> dict[str, float]:
    """Four one-row matmuls per dtype, best of many, the dtypes in turns."""
    weight = torch.randn(outputs, hidden, generator=torch.Generator().manual_seed(0))
    x, out = torch.randn(1, hidden), torch.empty(1, outputs)
    packed = {str(dtype).removeprefix("torch."): pack(weight.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}

    def run(weights: Packed) -> None:
        for _ in range(4):
            linear(x, weights, out=out)

    return best_of_turns({name: lambda w=weights: run(w) for name, weights in packed.items()}, turns=21)


def cuda_bf16(device: str | torch.device) -> bool:
    """Whether a GPU has bf16 units (Ampere on): older ones emulate bf16, slower than fp32."""
    return torch.cuda.get_device_capability(torch.device(device))[0] >= 8


def computes_bf16(device: str | torch.device) -> bool:
    """Whether `device` computes bf16 natively: a GPU from Ampere on, or a CPU with AVX512-BF16 or
    AMX (on AVX2 bf16 matmuls are several times slower than fp32). The one place that says so: a
    second copy still took bf16 on pre-Ampere GPUs after the first was fixed (a review)."""
    device = torch.device(device)
    if device.type == "cuda":
        return cuda_bf16(device)
    return device.type == "cpu" and native_bf16()
