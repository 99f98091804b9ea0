"""What the target adapter cannot serve is refused when it loads, with the reason; limits hold."""

import pytest
import torch
import transformers
from helpers import tiny_target
from transformers.cache_utils import Cache, DynamicLayer

from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.drafting.proposers import NoProposer
from target_node.model.cache_policy import UnsupportedCache, policy_for
from target_node.model.support import UnsupportedModel
from target_node.model.target import ContextLengthError, TargetModel
from target_node.model.tiny import tiny_config


def test_encoder_decoder_models_are_refused():
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
    with pytest.raises(UnsupportedModel, match="encoder-decoder"):
        TargetModel(transformers.T5ForConditionalGeneration(config))


def test_lm_heads_with_a_bias_are_refused():
    model = transformers.LlamaForCausalLM(tiny_config("llama", layers=2))
    model.lm_head = torch.nn.Linear(64, model.config.vocab_size, bias=True)
    with pytest.raises(UnsupportedModel, match="bias"):
        TargetModel(model)


def test_models_without_a_decoder_stack_are_refused():
    class HeadOnly(transformers.LlamaForCausalLM):
        def get_decoder(self):
            return self

    with pytest.raises(UnsupportedModel, match="get_decoder"):
        TargetModel(HeadOnly(tiny_config("llama", layers=2)))


def test_logits_the_head_does_not_explain_are_refused():
    """Falcon-H1 multiplies its logits; a multiplier the config does not state would go unseen."""
    model = transformers.FalconH1ForCausalLM(tiny_config("falcon_h1", layers=2))
    TargetModel(model)  # the stated multiplier is applied
    model.model.lm_head_multiplier = 3.0
    with pytest.raises(UnsupportedModel, match="LM head"):
        TargetModel(model)


def test_unknown_cache_layers_are_refused_by_name():
    class CompressedLayer(DynamicLayer):  # a subclass may hold state its parent's crop leaves behind
        pass

    with pytest.raises(UnsupportedCache, match="CompressedLayer"):
        policy_for(Cache(layers=[DynamicLayer(), CompressedLayer()]))
    with pytest.raises(ValueError, match="unknown cache policy"):
        tiny_target("mamba2", layers=2, cache_policy="rewind")


def test_requests_beyond_the_models_positions_are_refused_before_any_work():
    target = tiny_target("qwen3_sliding", layers=2)  # max_position_embeddings 2048
    target.check_length(2000, 48)
    with pytest.raises(ContextLengthError, match="2049 positions; this model holds 2048"):
        generate(target, [5] * 2000, NoProposer(), DecodeOptions(49))
    assert target.cache is None


def test_position_limits_under_other_names_and_none():
    target = tiny_target("mamba2", layers=2)
    assert target.max_positions is None  # a state-space model has no position limit
    target.check_length(100_000, 100_000)
    target.config.max_seq_len = 64  # the name some families use
    assert target.max_positions == 64
    with pytest.raises(ContextLengthError):
        target.check_length(60, 5)


def test_layered_policies_roll_back_within_the_last_forward_and_keep_prefixes_only():
    target = tiny_target("mistral", layers=2, engine=False)  # the engine's static cache keeps every row
    target.reset()
    target.forward(list(range(3, 23)))
    target.forward([4, 5, 6, 7])
    with pytest.raises(ValueError, match="within the last forward"):
        target.rollback(19)
    with pytest.raises(ValueError, match="prefix"):
        target.policy.keep(target.cache, 20, [0, 2])
    target.policy.keep(target.cache, 20, [0, 1])
    assert target.length == 22


def test_a_saved_model_loads_with_the_cache_policy_asked_for(tmp_path):
    tiny_target("mamba2", layers=2).model.save_pretrained(tmp_path)
    assert TargetModel.load(tmp_path).policy.name == "replay"
    assert TargetModel.load(tmp_path, cache_policy="capture").policy.name == "capture"


def test_a_model_is_named_by_its_folder_however_the_folder_is_written(chat_model_dir, monkeypatch):
    """`--model .` (served from inside the folder) named the model "": the server's id fell back to
    "dflash-split", and recorded answers and the datastore were keyed by "" (an audit)."""
    from target_node.model.target import TargetModel

    monkeypatch.chdir(chat_model_dir)
    assert TargetModel.load(".", dtype="float32", slots=1).name == chat_model_dir.name
