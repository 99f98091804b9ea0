"""What the front end's tests share besides fixtures: the served name, a prompt, polling the daemon's stats."""

import time

import requests

MODEL = "tiny-chat"  # the name the `server` fixture serves
CHAT = [{"role": "user", "content": "Tell me about otters."}]


def daemon_stats(server: str) -> dict:
    """The target daemon's stats reply, through the front end's /stats."""
    reply = requests.get(f"{server}/stats", timeout=60)
    reply.raise_for_status()
    return reply.json()


def wait_for(condition, timeout_s: float = 60.0):
    """Poll until `condition()` returns something truthy (a check, not a sleep); returns it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def stream_end(failure: Exception) -> tuple[dict, str]:
    """How a chat stream ends whose reply after the first raises `failure`: its last event's
    body and the event after it."""
    import asyncio
    import json

    from frontend.app import events
    from frontend.responses import Answer
    from frontend.schemas import ChatCompletionRequest
    from protocol import Message

    class Failing:
        async def next(self, gone=None):
            raise failure

        async def close(self, wait_s=None):
            pass

    async def stream():
        first = Message("chunk", 1, {"text": "Ot", "token_ids": [1, 2]})
        body = ChatCompletionRequest(model=MODEL, messages=CHAT, stream=True)
        return [e async for e in events(Failing(), first, Answer(True, MODEL), body)]

    sent = [e.decode() for e in asyncio.run(stream())]
    return json.loads(sent[-2].split("data: ", 1)[1]), sent[-1]
