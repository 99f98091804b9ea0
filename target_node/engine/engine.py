"""The target engine: a decoder forward over explicit rows, batch-invariant by construction.

One forward runs M rows (a plain step's one token, a chain or a tree to verify, a prefill
chunk) through every layer with the kernels of dflash_kernels/cpu.cpp, writing keys and values into the
static cache in place. Each row's result depends only on its token, its position and the keys
its list names (rows.py), never on the other rows: so a verify forward gives every row the bits
the plain step would have given it, and speculative decoding is bit-identical to plain decoding
in fp32 and in bf16 alike. Activations stay fp32 between kernels; weights and the cache are in
the model's dtype.

The architecture is the transformers model's own (weights.py reads it from the modules); the
load check runs both on a few tokens and refuses the engine for a model it does not reproduce.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

import dflash_kernels
from target_node.engine import torch_ops
from target_node.engine.check import check_against
from target_node.engine.kv_cache import StaticKVCache
from target_node.engine.rows import Rows, chain_rows, tree_rows
from target_node.engine.torch_ops import TorchOps
from target_node.engine.weights import DecoderWeights, EngineUnsupported, read_decoder

log = logging.getLogger(__name__)


class Engine:
    """A model's decoder on the kernels, with its static cache (slot 0 unless told otherwise)."""

    name = "static"
    tree = True  # any rows can be kept: a tree's accepted path is gathered into place

    screened: dflash_kernels.Screen | None = None  # the head's int8 screen, on CPUs with VNNI
    screen_rows = 0  # the most rows `greedy` screens (measured: where the screen is the faster)
    screen_rows_by_path: dict[str, int] = {}  # the same on each path the screen can take here
    screen_path = "vnni"  # the faster of them, which the screen takes

    def __init__(self, model: nn.Module, slots: int = 1, max_positions: int | None = None, ops="auto") -> None:
        """`ops`: "kernels" (the CPU kernels), "torch" (torch_ops.py, the GPU's), "device" (the one
        the model's device runs), "auto" (the same, but declining a GPU until the engine's bitwise
        tests have passed there: docs/engine.md), or an object with the same operations, `prepare`
        and `block` (benchmarks measure alternatives)."""
        device = model.get_output_embeddings().weight.device
        ops = ops_for(device, ops) if isinstance(ops, str) else ops
        if ops == "kernels":
            if device.type != "cpu":
                raise EngineUnsupported(f"the CPU kernels do not run on {device.type}")
            dflash_kernels.load()
            self.ops, prepare, self.block = torch.ops.dflash, dflash_kernels.pack, None
            if dflash_kernels.screen_available():  # greedy steps screen the head in int8 (`greedy`)
                # The head's rows as loaded, as the packed copy holds them: a served model's weights stay put.
                self._head_rows = model.get_output_embeddings().weight.detach().contiguous()
                self.screened = dflash_kernels.pack_screen(self._head_rows)
        elif ops == "torch":
            self.ops, prepare, self.block = TorchOps(), torch_ops.prepare, torch_ops.BLOCK
        else:
            self.ops, prepare, self.block = ops, ops.prepare, ops.block
        self.w: DecoderWeights = read_decoder(model, prepare)
        self.device = device
        self.dtype = self.w.head.data.dtype
        self.windows = {layer.window for layer in self.w.layers}
        # Blocks of fixed size pad with rows that write to one more slot, which no sequence owns.
        self.scratch = slots if self.block else None
        self.cache = StaticKVCache(
            len(self.w.layers),
            self.w.kv_heads,
            self.w.head_dim,
            self.dtype,
            device,
            slots + (self.block is not None),
            256,
            max_positions,
        )
        self._cos = self._sin = torch.empty(0, self.w.head_dim, device=device)
        check_against(self, model)
        if self.screened is not None:
            self.screen_rows = self._screen_rows()

    # --- rows of one sequence (the adapter's calls) ---------------------------------------------

    def length(self, slot: int = 0) -> int:
        return self.cache.lengths[slot]

    def reset(self, slot: int = 0, expect: int = 0) -> None:
        """An empty slot, with room made at once for `expect` positions (within the model's)."""
        self.cache.lengths[slot] = 0
        limit = self.cache.doubling_limit
        self.cache.reserve(min(expect, limit) if limit else expect)

    def rollback(self, length: int, slot: int = 0) -> None:
        if not 0 <= length <= self.cache.lengths[slot]:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self.cache.lengths[slot]} positions")
        self.cache.lengths[slot] = length

    def keep(self, start: int, rows: list[int], slot: int = 0) -> None:
        self.cache.keep(slot, start, rows)

    def step(
        self, tokens: list[int], taps: tuple[int, ...] = (), parents: list[int] | None = None, slot: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens at the slot's next positions (a tree where `parents` are given): final hidden
        states [k, hidden] and the tapped layers' outputs [k, len(taps) * hidden]."""
        return self.step_batch([(slot, tokens, parents)], taps)[0]

    def step_batch(
        self, parts: list[tuple[int, list[int], list[int] | None]], taps: tuple[int, ...] = ()
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Several slots' tokens in one forward, each (slot, tokens, parents) at its slot's next
        positions: per part, its hidden states and taps. Each row's bits are what it would get
        alone (rows.py), so batching changes speed only."""
        rows = []
        for slot, tokens, parents in parts:
            if slot == self.scratch or not 0 <= slot < self.cache.slots:
                raise ValueError(f"slot {slot} is not one of this engine's {self.slots} slots")
            start = self.cache.lengths[slot]
            self.cache.reserve(start + len(tokens))
            if parents is None:
                rows.append(chain_rows(tokens, start, self.windows, slot, self.device))
            else:
                rows.append(tree_rows(tokens, start, parents, self.windows, slot, self.device))
        hidden, features = self.forward(Rows.concat(rows), taps)
        out, at = [], 0
        for slot, tokens, _ in parts:
            end = at + len(tokens)
            out.append((hidden[at:end], None if features is None else features[at:end]))
            self.cache.lengths[slot] += len(tokens)
            at = end
        return out

    @property
    def slots(self) -> int:
        """Sequences the cache holds at once (a scratch slot for padding rows not counted)."""
        return self.cache.slots - (self.scratch is not None)

    # --- the forward ------------------------------------------------------------------------------

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [M, head_dim] fp32 from the model's own rotary module, tabled by position."""
        needed = int(positions.max()) + 1
        if needed > self._cos.shape[0]:
            size = max(needed, 2 * self._cos.shape[0], 256)
            ids = torch.arange(size, device=self.device)[None]
            probe = torch.zeros(1, dtype=torch.float32, device=self.device)
            with torch.inference_mode():
                cos, sin = self.w.rotary(probe, ids)
            self._cos, self._sin = cos[0].float().contiguous(), sin[0].float().contiguous()
        return self._cos[positions], self._sin[positions]

    @torch.inference_mode()
    def forward(self, rows: Rows, taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final hidden states [M, hidden] and taps of `rows`: at once on the CPU kernels, in blocks of
        exactly `block` rows on torch's (each block through every layer before the next)."""
        if self.block is None:
            return self._forward(rows, taps)
        parts = [self._forward(block, taps) for block in rows.blocks(self.block, self.scratch)]
        m = len(rows)
        hidden = torch.cat([h for h, _ in parts])[:m]
        return hidden, torch.cat([f for _, f in parts])[:m] if taps else None

    def _forward(self, rows: Rows, taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = self.w
        h = w.embed.weight[rows.tokens].float()
        cos, sin = self._rotary(rows.positions)
        work = _Work(w, len(rows), self.device)
        tapped: dict[int, torch.Tensor] = {}
        for i in range(len(w.layers)):
            self._layer(i, h, rows, cos, sin, work)
            if i in taps:
                tapped[i] = h.clone()
        normed = work.normed
        self.ops.rmsnorm(h, w.norm, w.eps, False, normed)
        if len(w.layers) - 1 in taps:  # as transformers' hidden_states: the last entry is normed
            tapped[len(w.layers) - 1] = normed
        features = torch.cat([tapped[t] for t in taps], -1) if taps else None
        return normed, features

    def layer_alone(self, i: int, tokens: list[int], given: torch.Tensor) -> torch.Tensor:
        """Layer i on `given` inputs [M, hidden] of `tokens` at positions 0.. of slot 0 (the load
        check feeds it what the transformers layer was fed); the slot is left empty."""
        rows = chain_rows(tokens, 0, self.windows, 0, self.device)
        self.cache.reserve(len(tokens))
        h = given.float().contiguous().clone()
        self._layer(i, h, rows, *self._rotary(rows.positions), _Work(self.w, len(tokens), self.device))
        self.reset()
        return h

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(h)
        self.ops.rmsnorm(h.contiguous(), self.w.norm, self.w.eps, False, out)
        return out

    def _layer(self, i: int, h: torch.Tensor, rows: Rows, cos: torch.Tensor, sin: torch.Tensor, work: _Work) -> None:
        """Decoder layer i on the residual stream `h` [M, hidden], in place."""
        ops, w, layer = self.ops, self.w, self.w.layers[i]
        keys = rows.keys[layer.window]
        kc, vc = self.cache.keys[i], self.cache.values[i]
        ops.rmsnorm(h, layer.norm_attn, w.eps, False, work.normed)
        ops.linear(work.normed, layer.qkv.data, layer.qkv.n, layer.qkv_bias, None, work.qkv)
        ops.rope_store(
            work.qkv, cos, sin, kc, vc, rows.slots, rows.index, w.heads, w.kv_heads, layer.q_norm, layer.k_norm, w.eps
        )
        ops.attention(
            work.qkv, kc, vc, rows.slots, keys.lo, keys.hi, keys.extra, keys.count, w.heads, w.scaling, work.attended
        )
        ops.linear(work.attended, layer.o.data, layer.o.n, layer.o_bias, h, h)
        ops.rmsnorm(h, layer.norm_mlp, w.eps, False, work.normed)
        ops.linear(work.normed, layer.gate_up.data, layer.gate_up.n, layer.gate_up_bias, None, work.gate_up)
        ops.silu_mul(work.gate_up, work.act)
        ops.linear(work.act, layer.down.data, layer.down.n, layer.down_bias, h, h)

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [M, vocab] of final hidden states, each row by the same dot products."""
        hidden = hidden.float().contiguous()
        if self.block is None:
            out = torch.empty(hidden.shape[0], self.w.head.n, device=hidden.device)
            self.ops.linear(hidden, self.w.head.data, self.w.head.n, None, None, out)
            return out
        m, size = hidden.shape[0], self.block
        padded = torch.zeros(-(-m // size) * size, hidden.shape[1], device=hidden.device)
        padded[:m] = hidden
        out = torch.empty(padded.shape[0], self.w.head.n, device=hidden.device)
        for start in range(0, padded.shape[0], size):
            rows = slice(start, start + size)
            self.ops.linear(padded[rows], self.w.head.data, self.w.head.n, None, None, out[rows])
        return out[:m]

    @torch.inference_mode()
    def greedy(self, hidden: torch.Tensor) -> list[int] | None:
        """Each row's argmax of the head's fp32 logits, for about half the head's bytes: the int8
        screen keeps the few tokens that may be the row's largest (1-25 on real rows), and only their
        logits are computed, each the same bits as in the whole head, so the argmax is the whole
        head's (ties to the first, as there). None where the screen does not serve: none here, more
        rows than it is faster for, or a row not finite (the caller computes the whole head)."""
        if not 0 < hidden.shape[0] <= self.screen_rows:
            return None
        dflash_kernels.use_screen_path(self.screen_path)  # the process's path, which another engine may have set
        chosen = dflash_kernels.screen_argmax(hidden.float(), self.w.head, self._head_rows, self.screened)
        return None if chosen is None else chosen[0]

    def _screen_rows(self, widest: int = 17) -> int:
        """Up to how many rows the screen beats the whole head here, on the faster of its paths (VNNI, or
        AMX's int8 tiles), which it then takes. It reads half the bytes, but on VNNI its two int8 parts
        cost about one bf16 row's compute each: a gain while the head streams from memory (a plain step,
        a narrow verify), none once the head computes; AMX's tiles take 16 rows for about the price of
        one. Measured once per machine and head, all in turns, on rows shaped like final hidden states.
        The path is the process's (the sums are the same integers on either: a choice of speed alone)."""
        n, k = self.w.head.n, self.w.norm.numel()
        paths = dflash_kernels.screen_paths()

        def measure() -> dict[str, float]:
            # A final hidden state points at its token's head row, give or take: the screen keeps as
            # many tokens for these as for real ones (random rows, far flatter, keep ten times more).
            generator = torch.Generator().manual_seed(0)
            picked = self._head_rows[torch.randint(0, n, (widest,), generator=generator)].float()
            noise = 0.05 * picked.norm(dim=1).mean() * torch.randn(widest, k, generator=generator)
            rows = self.final_norm((picked + noise.to(picked.device)).contiguous())
            had = self.screen_rows, self.screen_path
            self.screen_rows = widest
            runs = {}
            for m in range(1, widest + 1):
                x = rows[:m].contiguous()
                runs[f"head-{m}"] = lambda x=x: dflash_kernels.argmax(self.head(x))
                for path in paths:
                    runs[f"screen-{path}-{m}"] = lambda x=x, path=path: self._screen_on(path, x)
            try:
                return dflash_kernels.best_of_turns(runs, turns=6)
            finally:
                self.screen_rows, self.screen_path = had

        name = f"screen-{n}x{k}-{self.dtype}-{'-'.join(paths)}-{torch.get_num_threads()}threads"
        seconds = dflash_kernels.measured_once(dflash_kernels.load(), name, measure, one_thread=False)
        self.screen_rows_by_path = {}
        for path in paths:
            faster = 0
            while faster < widest and seconds.get(f"screen-{path}-{faster + 1}", 1.0) < seconds.get(
                f"head-{faster + 1}", 0.0
            ):
                faster += 1
            self.screen_rows_by_path[path] = faster
        # The path serving the most widths; of two serving as many, the one faster over all of them.
        total = {path: sum(seconds.get(f"screen-{path}-{m}", 1.0) for m in range(1, widest + 1)) for path in paths}
        self.screen_path = max(paths, key=lambda path: (self.screen_rows_by_path[path], -total[path]))
        return self.screen_rows_by_path[self.screen_path]

    def _screen_on(self, path: str, x: torch.Tensor) -> list[int] | None:
        self.screen_path = path
        return self.greedy(x)


class _Work:
    """One forward's scratch buffers, [M, ...] fp32, reused by every layer."""

    def __init__(self, w: DecoderWeights, m: int, device: torch.device) -> None:
        inter = w.layers[0].gate_up.n // 2 if w.layers else 0
        hidden = w.norm.numel()
        self.normed = torch.empty(m, hidden, device=device)
        self.qkv = torch.empty(m, (w.heads + 2 * w.kv_heads) * w.head_dim, device=device)
        self.attended = torch.empty(m, w.heads * w.head_dim, device=device)
        self.gate_up = torch.empty(m, 2 * inter, device=device)
        self.act = torch.empty(m, inter, device=device)


def ops_for(device: torch.device, ops: str) -> str:
    """The ops an `Engine` runs on `device` when asked for `ops` by name (see `Engine`)."""
    if ops == "auto" and device.type != "cpu":
        raise EngineUnsupported(f"the engine has run on CPU only, not yet on {device.type}")
    if ops in ("auto", "device"):
        return "kernels" if device.type == "cpu" else "torch"
    return ops


PREFER_DEVICE = "prefer-device"  # `TargetModel`'s engine: the device's ops where they serve the model, else none


def declines(device: str | torch.device) -> str | None:
    """Why the engine does not run on `device` unless asked to (None: it does)."""
    try:
        ops_for(torch.device(device), "auto")
    except EngineUnsupported as exc:
        return str(exc)
    return None


def batch_engine(device: str | torch.device) -> str | None:
    """`TargetModel.load`'s `engine` for work that needs many slots (generation, batching
    benchmarks): where "auto" declines the device (off the CPU, until a GPU run has verified the
    engine there), the engine's ops for the device where it serves the model (PREFER_DEVICE: the
    transformers path for a family it does not serve); elsewhere what "auto" chooses. Else the
    transformers path's one slot ran the GPU run's batching phases into an error and its
    generation at batch 1 (an audit)."""
    return PREFER_DEVICE if declines(device) else None


def engine_for(model: nn.Module, slots: int = 1, max_positions: int | None = None, ops: str = "auto") -> Engine | None:
    """The engine for `model` (as `Engine` takes them), or None (logged once, with the reason)
    where it cannot serve it."""
    try:
        return Engine(model, slots, max_positions, ops)
    except dflash_kernels.KernelsUnavailable as err:  # the machine's lack, not the model's (it read as one: an audit)
        log.warning(
            "the target engine's CPU kernels are unavailable (%s): the slower transformers path runs the model", err
        )
        return None
    except EngineUnsupported as err:
        log.info("the target engine does not serve %s (%s); the transformers path runs it", type(model).__name__, err)
        return None
