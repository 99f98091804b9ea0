"""The self-instruct prompt generator: deterministic, varied, and never a held-out prompt."""

import itertools

import pytest

from answers.store import Answer
from training.prompts import (
    EVAL_PROMPTS,
    Ask,
    HeldOut,
    Sources,
    jobs,
    next_turns,
    parse_code,
    parse_questions,
    read_prompts,
)
from training.variety import report

SOURCES = Sources(
    topics=["volcanoes", "bees", "the moon", "why the sky is blue", "tax returns", "sourdough bread"],
    personas=["a nurse", "a farmer", "a student"],
    functions=[("os.path.join", "Join two or more pathname components, inserting '/' as needed.")],
    commands=[("grep", "print lines that match patterns")],
)


def _first(n, **kw):
    return list(itertools.islice(jobs(**kw), n))


def test_the_stream_is_deterministic_for_a_seed_and_differs_across_seeds():
    a = _first(300, seed=3, src=SOURCES)
    assert a == _first(300, seed=3, src=SOURCES)
    assert a != _first(300, seed=4, src=SOURCES)
    kinds = {ask.job.rsplit("-", 1)[1] for ask in a}
    assert kinds == {"ask", "text", "code", "problem", "math", "explain", "roleplay", "docs"}


def test_held_out_prompts_and_their_near_duplicates_are_never_emitted():
    held_out = HeldOut.load()
    assert len(held_out.prompts) >= 30
    for p in held_out.prompts:
        assert held_out.excludes(p) and held_out.excludes(p.upper() + "  ")
    assert held_out.excludes("Explain why the sky is blue in simple terms.")  # a near-duplicate
    assert not held_out.excludes("Explain why volcanoes erupt.")
    # Starter prompts that are held out (or nearly) are dropped; the rest pass in order.
    starter = ["Explain why the sky is blue.", "What is 27 times 14? Show each step, please.", "Hello there!"]
    firsts = _first(1, src=SOURCES, starter=starter)
    assert firsts[0].user_text == "Hello there!"
    # The seeded stream, topics chosen to collide with held-out prompts, never emits one.
    emitted = _first(5000, seed=0, src=SOURCES)
    assert not [a.user_text for a in emitted if held_out.excludes(a.user_text)]
    # Nor do the turns that follow an answer.
    ask = Ask("j", "questions", (("user", "List three questions about the sky."),))
    answer = "1. Why is the sky blue?\n2. Explain why the sky is blue.\n3. Why are sunsets red at dusk?"
    turns = next_turns(ask, answer, held_out=held_out)
    assert [t.user_text.split("?")[0] for t in turns] == ["Why is the sky blue"]


def test_a_custom_held_out_set_is_honoured():
    held = HeldOut(["Write a haiku about bees."])
    emitted = _first(3000, seed=1, src=SOURCES, held_out=held)
    assert "Write a haiku about bees." not in {a.user_text for a in emitted}
    assert all(held.nearest(a.user_text) < held.threshold for a in emitted)


def test_answers_become_next_turns():
    questions = Ask("j", "questions", (("user", "List three questions a nurse might ask about bees."),))
    listed = 'Here are three:\n\n1. "How do bees make honey?"\n2. What do bees eat in winter?\n3. Why do bees sting?'
    assert parse_questions(listed) == ["How do bees make honey?", "What do bees eat in winter?", "Why do bees sting?"]
    turns = next_turns(questions, listed, held_out=HeldOut([]))
    assert len(turns) == 2 and turns[0].then == "Why do bees sting?"
    follow = next_turns(turns[0], "They collect nectar.", held_out=HeldOut([]))
    assert [m[0] for m in follow[0].messages] == ["user", "assistant", "user"]
    assert follow[0].stage == "followup" and next_turns(follow[0], "ok", held_out=HeldOut([])) == []

    code = Ask("j", "code", (("user", "Write a Go function that reverses a string."),))
    reply = "Here:\n```go\nfunc Reverse(s string) string {\n  r := []rune(s)\n  return string(r)\n}\n```\nDone."
    assert parse_code(reply).startswith("func Reverse")
    (task,) = next_turns(code, reply, held_out=HeldOut([]))
    assert "```go\nfunc Reverse" in task.user_text

    text = Ask("j", "text", (("user", "Write a short news report about bees."),))
    report_text = " ".join(["Bees returned to the valley this spring, farmers said on Monday."] * 4)
    tasks = next_turns(text, report_text, held_out=HeldOut([]))
    assert len(tasks) == 2 and all(report_text in t.user_text for t in tasks)
    assert next_turns(text, "Too short.", held_out=HeldOut([])) == []


def test_every_eval_prompt_is_distinct_and_read():
    prompts = read_prompts(EVAL_PROMPTS)
    assert len(prompts) >= 30 and len(set(prompts)) == len(prompts)


@pytest.mark.parametrize("count", [400])
def test_variety_report_measures_the_stream(count):
    asks = _first(count, seed=0, src=SOURCES)
    answers = [Answer(a.key, a.job, a.stage, [list(m) for m in a.messages], [1, 2, 3, 4], 2) for a in asks]
    rep = report(answers)
    assert rep["answers"] == count and rep["distinct_prompts"] <= count
    assert 0 < rep["distinct_3"] <= 1 and rep["prompt_words"]["p90"] >= rep["prompt_words"]["p10"]
    assert rep["held_out_nearest"]["max"] < rep["held_out_nearest"]["threshold"]
