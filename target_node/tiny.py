"""Tiny random targets built from transformers' own config classes: for tests and quick benchmarks.

They load and run through exactly the code real targets use, in a fraction of a second,
with logits spread wide enough that greedy paths are not decided by near-ties.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from target_node.target import TargetModel

VOCAB = 320


def tiny_target(arch: str = "llama", seed: int = 0, layers: int = 4, vocab: int = VOCAB) -> TargetModel:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=vocab - 2,
        bos_token_id=1,
        tie_word_embeddings=arch == "llama",
    )
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(f"no tiny {arch!r} target; known: llama, qwen3")
    # A larger init spread makes logits decisive, so greedy paths are not dominated by near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return TargetModel(model.float().eval(), tokenizer=None)
