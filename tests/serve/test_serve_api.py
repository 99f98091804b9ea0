"""The OpenAI API of dflash-serve, through the official client, against a real target daemon.

At temperature 0 the text over HTTP must be exactly what the msgpack client gets for the
same request: the front end passes the target's greedy output through untouched.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from serving import CHAT, MODEL, daemon_stats, wait_for

GREEDY = {"temperature": 0.0}


def test_chat_completion_equals_the_msgpack_client(openai_client, reference):
    want = reference(messages=CHAT, max_new_tokens=24, sampling=GREEDY, stream=False)
    got = openai_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert got.object == "chat.completion" and got.model == MODEL and len(got.choices) == 1
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want["text"] != ""
    assert choice.finish_reason == "length" == want["finish_reason"]
    assert got.usage.prompt_tokens == want["stats"]["prompt_tokens"] > 0
    assert got.usage.completion_tokens == len(want["token_ids"]) == 24
    assert got.usage.total_tokens == got.usage.prompt_tokens + 24


def test_streamed_chat_equals_the_msgpack_client(openai_client, reference):
    want = reference(messages=CHAT, max_new_tokens=24, sampling=GREEDY, stream=False)
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1, "the answer should arrive in several chunks"
    assert "".join(pieces) == want["text"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    *body, last = chunks
    assert last.choices == [] and all(c.usage is None for c in body)
    assert last.usage.prompt_tokens == want["stats"]["prompt_tokens"] and last.usage.completion_tokens == 24


def test_the_sse_stream_is_framed_as_openai_frames_it(server):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "temperature": 0, "stream": True}
    reply = requests.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = reply.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event
        chunk = json.loads(event[len("data: ") :])
        assert set(chunk) == {"id", "object", "created", "model", "system_fingerprint", "choices"}
        assert set(chunk["choices"][0]) == {"index", "delta", "logprobs", "finish_reason"}


def test_unicode_line_ends_in_a_chunk_keep_it_one_line_for_every_sse_reader():
    """U+2028, U+2029 and U+0085 end lines for str.splitlines(), which httpx's iter_lines splits
    with (clients that read OpenAI streams line by line over httpx, httpx-sse before 0.4.2): raw
    in a chunk's JSON they cut its `data:` line in two and json.loads failed (an audit). Escaped,
    they are the same text to every JSON reader."""
    from frontend.responses import Answer, sse

    text = "a\u2028b\u2029c\x85d"
    for answer in (Answer(True, MODEL), Answer(False, MODEL)):
        event = sse(answer.chunk(text)).decode()
        lines = event.splitlines()
        assert lines == [lines[0], ""] and lines[0].startswith("data: "), lines
        choice = json.loads(lines[0][len("data: ") :])["choices"][0]
        assert choice.get("text", choice.get("delta", {}).get("content")) == text


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_a_raw_prompt(openai_client, reference, stream):
    prompt = "Once upon a time"
    want = reference(prompt=prompt, max_new_tokens=12, sampling=GREEDY, stream=False)
    got = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=stream)
    if stream:
        chunks = list(got)
        assert {c.object for c in chunks} == {"text_completion"}
        text = "".join(c.choices[0].text for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        text = got.choices[0].text
        assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 12
    assert text == want["text"] != ""


def test_stop_sequences_and_max_tokens_set_the_finish_reason(openai_client, reference):
    full = reference(messages=CHAT, max_new_tokens=24, sampling=GREEDY, stream=False)["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full[: full.find(stop)]
    want = reference(messages=CHAT, max_new_tokens=24, sampling=GREEDY, stream=False, stop=[stop])
    assert want["finish_reason"] == "stop" and want["text"] == cut
    got = openai_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stop=stop)
    assert got.choices[0].message.content == cut and got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == len(want["token_ids"]) < 24
    streamed = openai_client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stop=[stop, "never appears"], stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    short = openai_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


def test_seeded_sampling_reproduces(openai_client):
    ask = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    first, second = (openai_client.chat.completions.create(**ask).choices[0].message.content for _ in range(2))
    other = openai_client.chat.completions.create(**dict(ask, seed=99)).choices[0].message.content
    assert first == second != other


def test_eight_concurrent_streams_all_complete_with_their_own_text(openai_client, reference):
    prompts = [[{"role": "user", "content": f"Question number {i}: what is {i} squared?"}] for i in range(8)]
    want = [reference(messages=m, max_new_tokens=16, sampling=GREEDY, stream=False)["text"] for m in prompts]

    def ask(messages):
        stream = openai_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, prompts))
    assert got == want and len(set(want)) == 8


def test_models_and_health(server, openai_client):
    assert [m.id for m in openai_client.models.list()] == [MODEL]
    reply = requests.get(f"{server}/health", timeout=30)
    assert reply.status_code == 200 and reply.json() == {"status": "ok"}


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_cancels_its_request_in_the_daemon(server, openai_client, stream):
    before = daemon_stats(server)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 1900, "temperature": 0, "stream": stream}
    if stream:
        with requests.post(f"{server}/v1/chat/completions", json=body, stream=True, timeout=60) as reply:
            lines = reply.iter_lines()
            assert [next(lines) for _ in range(6)]  # a few chunks arrived: it is generating
    else:
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(f"{server}/v1/chat/completions", json=body, timeout=1.0)

    def cancelled():
        now = daemon_stats(server)
        return now if now["requests"].get("cancelled", 0) == before["requests"].get("cancelled", 0) + 1 else None

    after = wait_for(cancelled)
    assert after["running"] == 0 and after["queued"] == 0
    assert 0 < after["generation_tokens"] - before["generation_tokens"] < 1900  # it stopped early
    quick = openai_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    assert quick.choices[0].finish_reason == "length" and quick.usage.completion_tokens == 4
    assert daemon_stats(server)["generation_tokens"] == after["generation_tokens"] + 4  # nothing else ran


def test_a_chats_next_turn_reports_the_prompt_tokens_the_prefix_cache_gave(openai_client):
    """As OpenAI reports its prompt caching: `usage.prompt_tokens_details.cached_tokens`."""
    first = openai_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    history = [*CHAT, {"role": "assistant", "content": first.choices[0].message.content}]
    history.append({"role": "user", "content": "And once more, shorter?"})
    second = openai_client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    metrics = requests.get(str(openai_client.base_url).replace("/v1/", "/metrics"), timeout=10).text
    assert "dflash_prefix_cache_hits_total" in metrics and "dflash_prompt_tokens_cached_total" in metrics


def test_a_chat_sent_back_as_the_sdk_keeps_it_goes_on(openai_client, reference):
    """The SDK's way of holding a conversation, messages.append(choice.message), sends this
    server's answer back with OpenAI's other assistant fields (refusal, tool_calls, audio, ...)
    null: they were refused as unknown, so every second turn was a 400 (an audit). Null flags
    (`stream`, `include_usage`) and vLLM's top_k -1 mean what OpenAI and vLLM say they mean."""
    first = openai_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    answer = first.choices[0].message.model_dump()
    assert answer["refusal"] is None and "tool_calls" in answer and "audio" in answer
    history = [*CHAT, answer, {"role": "user", "content": "And once more, shorter?"}]
    second = openai_client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=8, temperature=0, stream=None, top_p=None, extra_body={"top_k": -1}
    )
    plain = [*CHAT, {"role": "assistant", "content": answer["content"]}, history[-1]]
    want = reference(messages=plain, max_new_tokens=8, sampling=GREEDY, stream=False)
    assert second.choices[0].message.content == want["text"] != ""
    streamed = openai_client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": None}
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["text"]
    assert all(c.usage is None for c in chunks)  # include_usage null: false, OpenAI's default
