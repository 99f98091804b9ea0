"""Real processes for the HTTP front end's tests: a tiny chat target, its daemon, and dflash-serve."""

import pytest
from serving import MODEL

from frontend.target_client import TargetClient
from launch.local import daemon, free_port
from launch.serve import front_end


@pytest.fixture(scope="session")
def target_address(chat_model_dir, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('sock')}/target.sock"
    args = ["--model", str(chat_model_dir), "--proposer", "ngram", "--threads", "1"]
    with daemon("target daemon", "launch.target_daemon", address, args, 120):
        yield address


@pytest.fixture(scope="session")
def server(target_address):
    """dflash-serve, standalone, in front of the tiny chat target's daemon; its base URL."""
    with front_end(free_port(), ["--target", target_address, "--served-model-name", MODEL]) as url:
        yield url


@pytest.fixture
def openai_client(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()


@pytest.fixture
def reference(target_address):
    """The same request through the msgpack client, straight to the daemon: the `done` reply."""
    client = TargetClient(target_address, timeout_s=120)
    yield client.generate
    client.close()
