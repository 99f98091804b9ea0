"""The answer's text and its stop strings depend on the tokens alone, never on how many tokens a
step commits: plain decoding commits one a step, speculation several, and both must end alike.

Checked on the two kinds of tokenizer models ship: byte-level BPE (SmolLM2's, GPT-2's), where a
character's bytes may span tokens, and SentencePiece with byte fallback (Llama-2's, Mistral's),
whose decoder also strips a leading space and turns complete characters back into U+FFFD when an
unfinished one follows them.
"""

import random

import pytest
from transformers import AutoTokenizer

from target_node.decoding.output import Output
from target_node.model.default_model import ensure_default_model


@pytest.fixture(scope="module")
def byte_level():
    return AutoTokenizer.from_pretrained(ensure_default_model())


@pytest.fixture(scope="module")
def byte_fallback():
    """A SentencePiece-style tokenizer as Llama-2 and Mistral ship theirs: "▁" for spaces, <0xNN>
    byte tokens, and the decoder Replace, ByteFallback, Fuse, Strip."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    trained.train_from_iterator(
        ["The capital of France is Paris. The quick brown fox jumps over the dog."] * 20, trainer
    )
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken("<unk>"), AddedToken("<s>"), AddedToken("</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def run(tokenizer, tokens, groups, stops=(), prompt=()):
    """Commit `tokens` in steps of the sizes `groups` cycles through: (finish, kept tokens, text,
    the streamed deltas joined)."""
    out = Output(tokenizer, len(tokens), stop_strings=tuple(stops), context=list(prompt))
    deltas = []
    out.on_commit = lambda new, text: deltas.append(text)
    at, sizes = 0, iter(groups * len(tokens))
    while not out.done:
        size = next(sizes)
        out.commit(tokens[at : at + size])
        at += size
    return out.finish, out.tokens, out.text, "".join(deltas)


def answers(tokenizer, rng):
    """Token sequences with characters of 1-4 bytes, spaces, words, and characters cut short."""
    text = "The 日本 fox 🌱 jumps é over ü 𝄞 the dog. Paris 中文 capital"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for _ in range(12):
        cut = sorted(rng.sample(range(len(ids) + 1), 2))
        piece = ids[cut[0] : cut[1]] or ids[:3]
        yield piece[: rng.randrange(1, len(piece) + 1)] + ids[: rng.randrange(0, 4)]


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_text_and_stops_are_the_same_whatever_a_step_commits(kind, request):
    """Before, a stop string was looked for in the whole answer decoded again: a step that ended
    inside a character showed U+FFFD, which a stop matched, and a byte-fallback decoder's
    rewrites made plain and speculative decoding keep different tokens and the stream differ
    from the final text (an audit)."""
    tokenizer = request.getfixturevalue(kind)
    rng = random.Random(7)
    stops = [(), ("\ufffd",), ("日",), ("本 f",), (" ",), ("🌱", "x"), ("e d", "og.")]
    for tokens in answers(tokenizer, rng):
        for stop in stops:
            plain = run(tokenizer, tokens, [1], stop)
            for groups in ([2], [4, 3], [len(tokens)], [3, 1, 5]):
                assert run(tokenizer, tokens, groups, stop) == plain, (tokens, stop, groups)
            finish, kept, text, streamed = plain
            assert streamed == text
            assert all(s not in text for s in stop)
            if finish == "stop":  # the answer one token shorter, going on, held no stop string
                going_on = Output(tokenizer, len(tokens) + 1, stop_strings=stop)
                assert not any(going_on.commit([token]) for token in kept[:-1])


def test_a_stop_string_never_matches_a_character_still_being_decoded(byte_level):
    """An emoji's bytes span tokens: a step ending inside it decoded to U+FFFD, which the stop
    string "\\ufffd" took for text, and the answer ended there (an audit)."""
    tokens = byte_level("🌱🌱 ok", add_special_tokens=False)["input_ids"]
    assert len(tokens) > 3  # the emoji spans tokens
    finish, kept, text, _ = run(byte_level, tokens, [1], ["\ufffd"])
    assert (finish, kept, text) == ("length", tokens, "🌱🌱 ok")


def test_the_answer_keeps_its_first_token_s_leading_space(byte_fallback):
    """A SentencePiece decoder strips the space that starts what it decodes: the answer decoded
    alone lost the space of its first token, so prompt + answer was not the model's text."""
    answer = byte_fallback("France is Paris", add_special_tokens=False)["input_ids"]  # "▁France", ...
    assert byte_fallback.decode(answer) == "France is Paris"  # what decoding the answer alone gives
    # Prompts ending in characters of several byte tokens: the context reaches back to a character's
    # start, where it cut one and dropped the context, and the space with it (a review).
    for words in ("The capital of", "The capital of 日本", "I like 🌱🌱"):
        prompt = byte_fallback(words, add_special_tokens=False)["input_ids"]
        assert run(byte_fallback, answer, [1], prompt=prompt)[2] == " France is Paris", words
        finish, _, text, _ = run(byte_fallback, answer, [1], (" F",), prompt)
        assert (finish, text) == ("stop", ""), words  # a stop string may begin with that space


def test_tokens_without_text_do_not_rush_the_character_after_them(byte_level):
    """Special tokens (no text) counted towards the bound on a character's bytes: after 14 of
    them an emoji's bytes were given up as U+FFFD (a review)."""
    special = byte_level.convert_tokens_to_ids("<|im_end|>")
    for count in (1, 14, 15, 40):
        tokens = [*byte_level.encode("ok"), *[special] * count, *byte_level.encode("🌱 done")]
        assert run(byte_level, tokens, [1])[2] == "ok🌱 done", count


def test_an_answer_cut_inside_a_character_ends_with_what_its_bytes_decode_to(byte_level, byte_fallback):
    """The held-back bytes of an unfinished last character are flushed as the answer ends; a
    byte-fallback decoder no longer takes the complete character before them with it."""
    for tokenizer in (byte_level, byte_fallback):
        tokens = tokenizer("日本🌱", add_special_tokens=False)["input_ids"]
        finish, kept, text, streamed = run(tokenizer, tokens[:-1], [1])
        assert text.startswith("日本") and text.endswith("\ufffd") and streamed == text, text
