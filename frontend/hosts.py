"""The host a request names (`dflash-serve --allowed-hosts`): a server on a loopback address
answers only requests that name a loopback host.

A web page the user opens can point a name of its own at 127.0.0.1 (DNS rebinding); the browser
then sends that page's requests to the local server as "same origin", and it generated text and
showed /stats for them, key or no key on a default loopback server (an audit). Such a request
still names the page's host in its `Host` header, so that is what is checked.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from frontend.errors import APIError
from protocol.transport import is_loopback


class AllowedHosts:
    """ASGI middleware: a request whose Host is neither a loopback name nor one of `names` gets 400."""

    def __init__(self, app: ASGIApp, names: frozenset[str]) -> None:
        self.app, self.names = app, frozenset(name.lower().rstrip(".") for name in names)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = named_host(Headers(scope=scope).get("host", ""))
            if host and not (is_loopback(host) or host in self.names):
                await misdirected(host).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def named_host(header: str) -> str:
    """The host part of a Host header, lower-cased, without its port or a final dot ("" for none)."""
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:8000
        return header[: header.index("]") + 1] if "]" in header else header
    if header.count(":") == 1:
        header = header.rsplit(":", 1)[0]
    return header.rstrip(".")


def misdirected(host: str) -> APIError:
    shown = host if len(host) <= 64 else f"{host[:64]}..."
    return APIError(
        400,
        f"this server answers requests for a loopback host, not for {shown!r} (a web page's own name pointed at "
        "this host answers nothing); a name a proxy forwards here is allowed with --allowed-hosts NAME",
        code="invalid_host",
    )
