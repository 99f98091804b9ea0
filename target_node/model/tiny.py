"""Tiny random targets built from transformers' own config classes: for tests and quick benchmarks.

They load and run through exactly the code real targets use, in a fraction of a second,
with logits spread wide enough that greedy paths are not decided by near-ties. One per
family whose cache the target must roll back its own way: full attention, sliding windows
(short ones, so a test's context passes them), mixture-of-experts, linear attention and
state-space layers.
"""

from __future__ import annotations

import torch
import transformers

from target_node.model.target import TargetModel

VOCAB = 320
WINDOW = 8  # sliding-window families: far shorter than a test's context
ALTERNATE = ("sliding_attention", "full_attention")  # layer_types given as a tuple repeat to the layer count

EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)

# Families the engine serves (the others run on the transformers path only).
ENGINE_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_sliding", "mistral")

# family -> (transformers class prefix, what sets it apart, its config beyond the common fields)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("Llama", "full attention, tied embeddings", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2", "full attention, q/k/v biases", dict()),
    "qwen3": ("Qwen3", "full attention, q/k norms", dict(head_dim=16)),
    "qwen3_sliding": (
        "Qwen3",
        "sliding and full attention layers",
        dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW, layer_types=ALTERNATE),
    ),
    "mistral": ("Mistral", "sliding attention in every layer", dict(sliding_window=WINDOW)),
    "gemma2": (
        "Gemma2",
        "sliding and full layers, attention and final logit softcaps",
        # A final softcap low enough to bend these logits, so a head without it shows.
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            layer_types=ALTERNATE,
            final_logit_softcapping=10.0,
        ),
    ),
    "gpt_oss": (
        "GptOss",
        "sliding and full layers, mixture of experts, attention sinks",
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=ALTERNATE,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    "qwen3_moe": ("Qwen3Moe", "mixture of experts", dict(head_dim=16, **EXPERTS)),
    "qwen3_next": (
        "Qwen3Next",
        "linear attention (gated delta rule) layers, a full attention layer, experts",
        dict(
            head_dim=16,
            shared_expert_intermediate_size=32,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            **EXPERTS,
        ),
    ),
    "mamba2": (
        "Mamba2",
        "state-space layers only, no attention",
        dict(num_heads=8, head_dim=16, state_size=16, n_groups=1, chunk_size=16),
    ),
    "falcon_h1": (
        "FalconH1",
        "state space and attention side by side in every layer, LM head multiplier",
        dict(mamba_d_ssm=128, lm_head_multiplier=0.5, **MAMBA),
    ),
    "nemotron_h": (
        "NemotronH",
        "state-space, attention and attention-free MLP layers",
        dict(
            layer_types=("linear_attention", "mlp", "full_attention", "mlp"),
            mamba_num_heads=8,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=1,
            chunk_size=16,
        ),
    ),
}


def tiny_config(arch: str, layers: int = 4, vocab: int = VOCAB) -> transformers.PreTrainedConfig:
    """A small config of family `arch`: hidden 64, `layers` layers."""
    if arch not in FAMILIES:
        raise ValueError(f"no tiny {arch!r} target; known: {', '.join(FAMILIES)}")
    prefix, _, extra = FAMILIES[arch]
    fields = dict(vocab_size=vocab, eos_token_id=vocab - 2, bos_token_id=1, hidden_size=64, num_hidden_layers=layers)
    if arch != "mamba2":  # attention and MLP shapes
        fields.update(
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        )
    fields.update(extra)
    pattern = fields.get("layer_types")
    if isinstance(pattern, tuple):
        fields["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    return getattr(transformers, f"{prefix}Config")(**fields)


def tiny_target(
    arch: str = "llama",
    seed: int = 0,
    layers: int = 4,
    vocab: int = VOCAB,
    cache_policy: str | None = None,
    engine: bool | str | None = None,
    dtype: torch.dtype = torch.float32,
    slots: int = 1,
) -> TargetModel:
    """A random `arch` model behind the target adapter (`cache_policy`, `engine`, `slots`: see TargetModel)."""
    config = tiny_config(arch, layers, vocab)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{FAMILIES[arch][0]}ForCausalLM")(config)
    # A larger init spread makes logits decisive, so greedy paths are not dominated by near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith(".bias"):  # biases too, so a path that drops them shows
                p.normal_(0, 0.2)
    return TargetModel(model.to(dtype).eval(), tokenizer=None, cache_policy=cache_policy, engine=engine, slots=slots)
