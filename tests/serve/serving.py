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
