"""The drafter across the wire: a DEALER client the speculative loop uses like the local drafter.

Every request has a deadline. On a timeout or an error reply the client drops its socket
and the loop carries on with its fallback proposer (verification keeps the output exact);
after `retry_s` it probes the daemon again and, once it answers, re-opens the session and
lets the proposer resend whatever features the drafter lacks.
"""

from __future__ import annotations

import logging
import time
import uuid

import torch

from protocol import FLOAT_DTYPES, ErrorCode, Message, ProtocolError
from protocol.messages import fit_problems
from protocol.transport import Client
from target_node.drafting import DrafterMismatch
from target_node.proposers import DrafterUnavailable
from target_node.target import TargetModel

log = logging.getLogger("remote_drafter")


class RemoteDraftBackend:
    def __init__(
        self,
        address: str,
        target: TargetModel,
        *,
        timeout_s: float = 2.0,
        probe_timeout_s: float = 0.25,
        retry_s: float = 5.0,
        wire_dtype: str | None = None,
        name: str | None = None,
    ) -> None:
        self.address = address
        self.target = target
        self.timeout_s, self.probe_timeout_s, self.retry_s = timeout_s, probe_timeout_s, retry_s
        self.session = name or f"target-{uuid.uuid4().hex[:12]}"
        self.wire_request = wire_dtype
        self.client = Client(address)
        self.info: dict | None = None  # the drafter's description, once a handshake succeeded
        self.wire_dtype = "float32"
        self.attached = False  # session open on the daemon we are talking to
        self.retry_at = 0.0
        self.counters = dict.fromkeys(["round_trips", "timeouts", "errors", "bytes_out", "bytes_in", "proposals"], 0)
        self.counters.update(draft_ms=0.0, propose_rtt_ms=0.0)
        self.attach(self.timeout_s)
        if self.info is None:
            raise DrafterUnavailable(f"no drafter answered at {address} within {self.timeout_s:.1f} s")

    def _call(self, type_: str, fields: dict, tensors: dict | None = None, timeout_s: float | None = None) -> Message:
        timeout_s = timeout_s or self.timeout_s
        try:
            sent = self.client.send(type_, fields, tensors, wire_dtype=self.wire_dtype)
            self.counters["bytes_out"] = self.client.bytes_out
            reply = self.client.wait(sent, type_, timeout_s)
        except ProtocolError as exc:  # a garbled or out-of-place reply: treat the peer as unreliable
            self._drop(f"bad reply to {type_}: {exc.message}")
            raise DrafterUnavailable(exc.message) from exc
        if reply is None:
            self.counters["timeouts"] += 1
            self._drop(f"{type_} timed out after {timeout_s:.2f} s")
            raise DrafterUnavailable(f"draft daemon at {self.address} did not answer {type_}")
        self.counters["round_trips"] += 1
        self.counters["bytes_in"] += sum(spec.nbytes for spec, _ in reply.tensors.values())
        if reply.type == "error":
            self.counters["errors"] += 1
            if reply["code"] == ErrorCode.CONFIG_MISMATCH.value:
                raise DrafterMismatch(f"draft daemon at {self.address}: {reply['message']}")
            # The daemon lost our session (restart, eviction) or our stream: start over.
            self.attached = False
            log.warning("draft daemon refused %s: %s: %s", type_, reply["code"], reply["message"])
            raise DrafterUnavailable(reply["message"])
        return reply

    def _drop(self, why: str) -> None:
        """Lazy pirate: a socket that missed a reply may hold a stale one; build a new one later."""
        log.warning("drafter unavailable (%s); falling back, retrying in %.1f s", why, self.retry_s)
        self.client.close()
        self.attached = False
        self.retry_at = time.monotonic() + self.retry_s

    def attach(self, timeout_s: float) -> None:
        """Handshake and open our session; leaves `attached` False if the daemon does not answer."""
        target = self.target
        offered = [self.wire_request] if self.wire_request else list(FLOAT_DTYPES)
        try:
            reply = self._call(
                "hello",
                {"wire_dtypes": offered, "target": target.info, "client": self.session},
                timeout_s=timeout_s,
            )
            info = reply["drafter"]
            self._check_fits(info)
            self.info = info
            # The drafter's own dtype, unless the operator chose: wider only costs bytes.
            self.wire_dtype = self.wire_request or reply["wire_dtype"]
            mask = target.embed([info["mask_token_id"]])
            self._call("open", {"session": self.session}, {"mask": mask}, timeout_s=timeout_s)
            self.attached = True
        except DrafterUnavailable:
            pass

    def _check_fits(self, info: dict) -> None:
        if self.info is not None and info != self.info:
            raise DrafterMismatch(f"the drafter at {self.address} changed its config after a restart")
        problems = fit_problems(info, self.target.info)
        if problems:
            raise DrafterMismatch(f"drafter at {self.address} does not fit this target: " + "; ".join(problems))

    def ensure(self) -> None:
        """Attach if we are not, without waiting long: the loop must not stall on a dead daemon."""
        if self.attached:
            return
        if time.monotonic() < self.retry_at:
            raise DrafterUnavailable("draft daemon unavailable; waiting before the next probe")
        self.attach(self.probe_timeout_s)
        if not self.attached:
            raise DrafterUnavailable(f"draft daemon at {self.address} still unavailable")

    def begin_request(self) -> None:
        """A new request may probe a daemon that was down at once, instead of after `retry_s`."""
        self.retry_at = 0.0

    def reset(self, position: int) -> None:
        self.ensure()
        self._call("reset", {"session": self.session, "position": position})

    def draft(self, start: int, features: torch.Tensor, noise: torch.Tensor, position: int, rows: int) -> torch.Tensor:
        self.ensure()
        began = time.perf_counter()
        # Rows 1.. of the noise block are the mask embedding the daemon holds since `open`.
        reply = self._call(
            "propose",
            {"session": self.session, "start": start, "position": position, "rows": rows},
            {"features": features, "noise": noise[:1]},
        )
        self.counters["draft_ms"] += reply["draft_ms"]
        self.counters["propose_rtt_ms"] += (time.perf_counter() - began) * 1000
        self.counters["proposals"] += 1
        return reply.tensor("hidden", self.target.device)  # in the wire dtype: the projection casts once

    def close(self) -> None:
        if self.attached:
            try:
                self._call("close", {"session": self.session}, timeout_s=self.probe_timeout_s)
            except (DrafterUnavailable, ProtocolError):
                pass
        self.client.close()
