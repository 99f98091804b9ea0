"""The target adapter: any transformers causal LM behind the handful of calls the loop needs.

It owns the KV cache and the feature ring, so the loop only says which tokens to run and
how many of them to keep.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from target_node.feature_ring import FeatureRing
from target_node.greedy_head import ExactArgmaxHead


class TargetModel:
    def __init__(self, model, tokenizer=None, ring_capacity: int = 4096) -> None:  # noqa: ANN001
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.ring_capacity = ring_capacity
        self.tap_layers: tuple[int, ...] = ()
        self.ring: FeatureRing | None = None
        self.cache: DynamicCache | None = None
        self.eos_ids = self._eos_ids()
        self.body = model.get_decoder()
        self.head = model.get_output_embeddings()
        if getattr(self.head, "bias", None) is not None:
            raise ValueError("LM heads with a bias are not supported")
        # On CPU in fp32 the head dominates a verify step and a bf16 screen halves it; on a GPU,
        # or for a model already in reduced precision, the plain head is the right tool.
        on_cpu_fp32 = self.head.weight.device.type == "cpu" and self.head.weight.dtype == torch.float32
        self.greedy_head = ExactArgmaxHead(self.head.weight) if on_cpu_fp32 else None
        self.draft_head: tuple[torch.Tensor, torch.Tensor] | None = None  # (token ids, their head rows)

    @classmethod
    def load(
        cls, folder: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32, ring_capacity: int = 4096
    ) -> TargetModel:
        folder = Path(folder)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder} is not a Hugging Face model folder (no config.json)")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
        # A folder without tokenizer files still serves token-id requests.
        has_tokenizer = any(
            (folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        )
        tokenizer = AutoTokenizer.from_pretrained(folder) if has_tokenizer else None
        return cls(model, tokenizer, ring_capacity)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            ids.update([value] if isinstance(value, int) else value or [])
        return frozenset(ids)

    def set_taps(self, layer_ids: tuple[int, ...]) -> None:
        """Capture these layers' outputs (hidden_states[l + 1]) into the feature ring from now on."""
        depth = self.config.num_hidden_layers
        bad = [layer for layer in layer_ids if not 0 <= layer < depth]
        if bad:
            raise ValueError(f"drafter taps target layers {bad}, but the target has {depth} layers (0..{depth - 1})")
        self.tap_layers = tuple(layer_ids)
        width = len(layer_ids) * self.hidden_size
        if self.ring is None or self.ring.rows.shape[1] != width:
            self.ring = FeatureRing(self.ring_capacity, width, self.model.dtype, self.device)

    def check_token(self, token_id: int, what: str) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(
                f"{what} {token_id} is outside the target's embedding table ({self.vocab_size} rows); "
                "this drafter was built for a different vocabulary"
            )

    @property
    def length(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run tokens at the next positions; return final hidden states [k, hidden] and tapped features.

        The LM head is left to the caller (`greedy` or `logits`), which needs far less of it
        than the full logits for every row. Nothing is committed: the caller keeps what it
        accepts with `keep`.
        """
        if self.cache is None:
            self.cache = DynamicCache(config=self.config)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        out = self.body(input_ids=ids, cache=self.cache, use_cache=True, output_hidden_states=bool(self.tap_layers))
        features = None
        if self.tap_layers:
            features = torch.cat([out.hidden_states[layer + 1][0] for layer in self.tap_layers], -1)
        return out.last_hidden_state[0], features

    def greedy(self, hidden: torch.Tensor) -> list[int]:
        """The target's greedy choice after each row: the exact fp32 argmax of its logits."""
        if self.greedy_head is not None:
            return self.greedy_head(hidden)
        return self.logits(hidden).argmax(-1).tolist()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full fp32 logits [k, vocab], for sampling."""
        return self._final_scaling(self.head(hidden).float())

    def _final_scaling(self, logits: torch.Tensor) -> torch.Tensor:
        """What some families apply after the LM head; none of it moves the argmax."""
        scale = getattr(self.config, "logit_scale", None)  # Cohere-style
        if scale:
            logits = logits * scale
        divide = getattr(self.config, "logits_scaling", None)  # Granite-style
        if divide:
            logits = logits / divide
        cap = getattr(self.config, "final_logit_softcapping", None)  # Gemma-style
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def keep(self, start: int, count: int, features: torch.Tensor | None) -> None:
        """Commit `count` tokens run from position `start`: drop the rest from the KV cache, ring their features."""
        self.cache.crop(start + count - self.cache.get_seq_length())
        if features is not None and self.ring is not None:
            self.ring.write(start, features[:count])

    def reset(self) -> None:
        """A new request: no KV cache, and no feature capture until a proposer asks (set_taps)."""
        self.cache = None
        self.tap_layers = ()
        if self.ring is not None:
            self.ring.reset()

    @torch.inference_mode()
    def embed(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return self.model.get_input_embeddings()(ids)

    def set_draft_vocab(self, token_ids: list[int]) -> None:
        """Restrict draft projections to these token ids (the drafter's vocabulary); [] = all."""
        if self.draft_head is not None and self.draft_head[0].tolist() == list(token_ids):
            return
        if not token_ids:
            self.draft_head = None
            return
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"draft vocabulary ids {bad[:5]} are outside the target's vocabulary")
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        weight = self.head.weight.detach()[ids]
        self.draft_head = (ids, weight.to(torch.bfloat16) if self.greedy_head is not None else weight)

    @torch.inference_mode()
    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [rows, vocab]: the drafter's hidden states through the target's own LM head.

        Drafts need not be exact (verification is), so on CPU this runs a bf16 copy of the
        head, and only over the drafter's vocabulary when it has one (-inf elsewhere).
        """
        if self.draft_head is not None:
            ids, weight = self.draft_head
            sub = self._final_scaling((hidden.to(device=self.device, dtype=weight.dtype) @ weight.T).float())
            logits = sub.new_full((sub.shape[0], self.vocab_size), float("-inf"))
            logits[:, ids] = sub
            return logits
        if self.greedy_head is None:
            return self._final_scaling(self.head(hidden.to(device=self.device, dtype=self.head.weight.dtype)).float())
        screen = self.greedy_head.screen
        return self._final_scaling((hidden.to(device=self.device, dtype=screen.dtype) @ screen.T).float())

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this target has no tokenizer; send token ids")
        if getattr(self.tokenizer, "chat_template", None):
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return list(ids)
        return self.encode_text("\n".join(m["content"] for m in messages))

    def encode_text(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this target has no tokenizer; send token ids")
        return list(self.tokenizer(text)["input_ids"])
