"""dflash-serve all in one on SmolLM2, as the README's main job runs it: front end, target daemon,
draft daemon (the shipped drafter) in three processes. Over HTTP, through the official OpenAI
client, the answers are exactly what the msgpack client gets from the same target daemon.
"""

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from frontend.target_client import TargetClient
from launch.local import free_address, free_port
from launch.serve import front_end

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"  # the default model's name, which all-in-one serves it as
CHAT = [{"role": "user", "content": "Give me three tips for learning to cook."}]
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def main_job():
    """(base URL, target daemon address) of an all-in-one dflash-serve."""
    target = free_address()
    with front_end(free_port(), ["--threads", "1", "--target-address", target], ready_timeout_s=300) as url:
        yield url, target


@pytest.fixture
def clients(main_job):
    from openai import OpenAI

    url, target = main_job
    http = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    msgpack = TargetClient(target, timeout_s=300)
    yield http, msgpack
    http.close()
    msgpack.close()


def test_chat_over_http_equals_the_msgpack_client_streamed_or_not(clients):
    http, msgpack = clients
    want = msgpack.generate(messages=CHAT, max_new_tokens=32, sampling=GREEDY, stream=False)
    got = http.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=32, temperature=0)
    assert got.choices[0].message.content == want["text"] != ""
    assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 32
    assert got.usage.prompt_tokens == want["stats"]["prompt_tokens"]
    stream = http.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=32, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["text"]
    assert chunks[-1].usage.completion_tokens == 32 and chunks[-2].choices[0].finish_reason == "length"


def test_a_stop_sequence_and_a_raw_completion(clients):
    http, msgpack = clients
    full = msgpack.generate(messages=CHAT, max_new_tokens=32, sampling=GREEDY, stream=False)["text"]
    stop = full.split()[len(full.split()) // 2]
    got = http.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=32, temperature=0, stop=[stop])
    assert got.choices[0].finish_reason == "stop" and got.choices[0].message.content == full[: full.find(stop)]
    want = msgpack.generate(prompt="The three primary colours are", max_new_tokens=16, sampling=GREEDY)
    text = http.completions.create(model=MODEL, prompt="The three primary colours are", max_tokens=16, temperature=0)
    assert text.choices[0].text == want["text"] != ""


def test_metrics_show_the_remote_drafter(main_job):
    url, _ = main_job
    families = {f.name: f for f in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=60).text)}
    value = {name: f.samples[0].value for name, f in families.items() if len(f.samples) == 1}
    assert value["dflash_target_daemon_up"] == 1 and value["dflash_drafter_reachable"] == 1
    assert value["dflash_drafter_timeouts"] == 0 and value["dflash_generation_tokens"] > 0
