"""Two hosts for real: the target daemon and the draft daemon each in its own network namespace,
joined by a veth pair (10.77.0.1 <-> 10.77.0.2, addresses that exist only inside the two
namespaces), CURVE on the link between them. Latency is added with tc netem; the link is cut
and restored with `ip link set down/up`. Output stays exactly the target's greedy output
throughout. The test talks to the target daemon over an ipc:// socket (a file, reachable
across network namespaces). Needs root and iproute2: CI runs as root, so it runs there.
"""

import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from helpers import greedy, tiny_target

from draft_node.checkpoint import config_for_target, random_drafter, save_drafter
from frontend.target_client import TargetClient
from launch.processes import stop
from protocol.keys import create_keypair
from protocol.transport import wait_ready
from target_node.model.target import TargetModel

PROMPT = [200, 11, 11, 11, 250, 12, 13, 14]
TARGET_NS, DRAFT_NS = f"dflash-t{os.getpid()}", f"dflash-d{os.getpid()}"
DRAFT_ADDRESS = "tcp://10.77.0.2:5555"
SETUP = [
    ["ip", "netns", "add", TARGET_NS],
    ["ip", "netns", "add", DRAFT_NS],
    ["ip", "link", "add", "vt", "netns", TARGET_NS, "type", "veth", "peer", "name", "vd", "netns", DRAFT_NS],
    ["ip", "-n", TARGET_NS, "addr", "add", "10.77.0.1/24", "dev", "vt"],
    ["ip", "-n", DRAFT_NS, "addr", "add", "10.77.0.2/24", "dev", "vd"],
    ["ip", "-n", TARGET_NS, "link", "set", "vt", "up"],
    ["ip", "-n", DRAFT_NS, "link", "set", "vd", "up"],
    ["ip", "-n", TARGET_NS, "link", "set", "lo", "up"],
    ["ip", "-n", DRAFT_NS, "link", "set", "lo", "up"],
]


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30)


def teardown() -> None:
    for ns in (TARGET_NS, DRAFT_NS):  # deleting a namespace deletes its end of the veth pair
        ip("ip", "netns", "del", ns)


@contextmanager
def in_namespace(ns: str, module: str, args: list[str], log):
    """`python -m module` inside network namespace `ns`; SIGTERM (then SIGKILL) on exit."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", module, *args],
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=out,
            stderr=out,
        )
        try:
            yield proc
        finally:
            stop(proc)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 ('ip'); CI runs as root")
    teardown()
    for command in SETUP:
        done = ip(*command)
        if done.returncode != 0:
            teardown()
            pytest.skip(f"network namespaces are not allowed here: {' '.join(command)}: {done.stderr.strip()}")
    try:
        folder = tmp_path_factory.mktemp("hosts")
        target = tiny_target("qwen3", seed=4)
        target.model.save_pretrained(folder / "model")
        cfg = config_for_target(target.config, block_size=8, taps=3)
        checkpoint = save_drafter(random_drafter(cfg, seed=1, std=0.1), folder / "drafter")
        for name in ("draft", "target"):
            create_keypair(folder, name)
        address = f"ipc://{folder}/target.sock"
        target_args = ["--bind", address, "--model", str(folder / "model"), "--drafter", DRAFT_ADDRESS]
        target_args += ["--always-draft", "--draft-timeout", "1", "--draft-retry", "1", "--threads", "1"]
        target_args += ["--curve-key", str(folder / "target.key_secret"), "--drafter-key", str(folder / "draft.key")]
        draft_args = ["--bind", DRAFT_ADDRESS, "--checkpoint", str(checkpoint), "--threads", "1"]
        draft_args += ["--curve-key", str(folder / "draft.key_secret"), "--curve-allow", str(folder / "target.key")]
        # The target first: it must start and serve without its drafter.
        with in_namespace(TARGET_NS, "launch.target_daemon", target_args, folder / "target.log") as proc:
            assert wait_ready(address, 120, alive=lambda: proc.poll() is None), (folder / "target.log").read_text()
            client = TargetClient(address, timeout_s=60)
            alone = client.generate(token_ids=PROMPT, max_new_tokens=40)
            with in_namespace(DRAFT_NS, "launch.draft_daemon", draft_args, folder / "draft.log"):
                # The daemon's own reference: the same folder loaded the same way (dtype auto).
                want = greedy(TargetModel.load(folder / "model"), PROMPT, 120)
                yield SimpleNamespace(client=client, want=want, alone=alone, folder=folder)
            client.close()
    finally:
        teardown()


def generate(hosts, max_new_tokens=120, on_chunk=None):
    replies = []
    for reply in hosts.client.stream(token_ids=PROMPT, max_new_tokens=max_new_tokens):
        replies.append(reply)
        if on_chunk is not None and len(replies) == 1:
            on_chunk()
    done = replies[-1]
    assert done["token_ids"] == hosts.want[:max_new_tokens]
    return done["stats"]


def until_drafted(hosts, timeout_s=60.0):
    """Requests until one drafts remotely; each must be exact on the way."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = generate(hosts)
        if stats["sources"].get("dflash", 0) > 0:
            return stats
    raise AssertionError("the drafter across the link was never used")


def test_a_target_started_first_serves_exactly_then_drafts_across_the_link(hosts):
    assert hosts.alone["token_ids"] == hosts.want[:40] and "dflash" not in hosts.alone["stats"]["sources"]
    stats = until_drafted(hosts)
    assert stats["sources"]["dflash"] == stats["steps"] - stats["plain_steps"]


@pytest.mark.parametrize("delay_ms", [1, 5])
def test_latency_on_the_link_keeps_output_exact(hosts, delay_ms):
    added = [ip("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem", "delay",
                f"{delay_ms}ms") for ns, dev in ((TARGET_NS, "vt"), (DRAFT_NS, "vd"))]  # fmt: skip
    try:
        if any(a.returncode for a in added):
            pytest.skip(f"tc netem is not available in this kernel: {added[0].stderr.strip()}")
        before = until_drafted(hosts)["drafter"]
        stats = generate(hosts)
        drafter = stats["drafter"]
        rtt = (drafter["propose_rtt_ms"] - before["propose_rtt_ms"]) / (drafter["proposals"] - before["proposals"])
        print(f"netem {delay_ms} ms each way: {rtt:.1f} ms per propose round trip")
        assert rtt >= 2 * delay_ms and stats["sources"]["dflash"] == stats["steps"] - stats["plain_steps"]
        assert drafter["timeouts"] == before["timeouts"]
    finally:
        for ns, dev in ((TARGET_NS, "vt"), (DRAFT_NS, "vd")):
            ip("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root")


def test_a_cut_link_falls_back_exactly_and_a_restored_one_drafts_again(hosts):
    before = until_drafted(hosts)["drafter"]
    try:
        stats = generate(hosts, on_chunk=lambda: ip("ip", "-n", TARGET_NS, "link", "set", "vt", "down"))
        assert stats["drafter"]["timeouts"] > before["timeouts"]  # noticed, then the fallback drafted
        stats = generate(hosts)  # still cut: exact, without the drafter
        assert "dflash" not in stats["sources"]
    finally:
        ip("ip", "-n", TARGET_NS, "link", "set", "vt", "up")
    until_drafted(hosts)
