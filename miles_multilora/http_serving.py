"""One hardened way to serve a FastAPI app to untrusted clients, shared by both front doors (the
controller's API and ``tinker-serve``), under the limits of
:class:`~miles_multilora.config.http_limits.HTTPLimits` (each door's config section).

Capacity model. Open connections are cheap: idle ones cost a socket, so a server holds thousands
(``max_connections``; the open-file limit is raised to fit), and no peer can hold many of them
(``max_connections_per_peer``, by address; IPv6 per /64). A connection must send a complete request
head within ``head_timeout_s`` (of connecting, or of the head's first byte) whatever
``keep_alive_s`` says, so silent or trickling sockets go quickly; when a cap is reached, an idle
connection of the peer holding most is closed to make room (the new one is refused with 503 only
when nothing is idle). Requests in flight are the scarce resource: at most ``max_requests`` at once,
of which requests without credentials (open routes) may take only ``max_anonymous_requests``, so the
rest is reserved for authenticated callers, and those of one principal (an API key's tenant, the
bearer token) only ``max_requests_per_key`` (past any: 503 with ``Retry-After``).

- :class:`Guard` (ASGI middleware): authentication by a callable (the principal goes to
  ``request.state.principal``), the requests-in-flight caps, a body limit on every transfer
  encoding (a declared length over the limit is refused before a byte is read; a chunked body as
  soon as it passes the limit), a deadline for the whole body, and a rendered 500 for anything
  unexpected (logged; the server keeps serving).
- :class:`GuardedProtocol` and :class:`Connections`: the connection rules above; an answer sent
  before the body was read (413, ...) reaches the client before the connection closes (lingering
  close).
- :class:`BackgroundServer`: uvicorn in a daemon thread on a socket bound here, with a listen
  backlog and no signal handlers.
- :func:`read_body`: a route's whole body, with the errors above as :class:`HTTPProblem`.

Each door renders errors in its own JSON shape (``render``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import ipaddress
import logging
import os
import resource
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from miles_multilora.config.http_limits import HTTPLimits
from miles_multilora.errors import ConfigError

BACKLOG = 2048
SHUTDOWN_TIMEOUT_S = 5.0
BIND_RETRY_S = 10.0  # a port in use is tried again this long (the server it replaces may be exiting)
SPARE_FILES = 256  # open files kept free beside the connections (state files, logs, ...)
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")

# render(status, message, error type, extra headers) -> the door's error response
Render = Callable[[int, str, str, dict[str, str]], Response]


class HTTPProblem(Exception):
    """An HTTP error a route or the guard answers with (``field``: what to change, if any)."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field = status, message, field


async def read_body(request: Request, *, required: str = "a request body") -> bytes:
    """The whole body (the :class:`Guard` enforces its size and deadline): 411 for a POST that
    declares no length at all, 400 for an empty body or a client gone mid-body."""
    headers = request.headers
    if "content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "").lower():
        raise HTTPProblem(411, f"a body with Content-Length is required: send {required}")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
    except ClientDisconnect as exc:
        raise HTTPProblem(400, "the client disconnected while sending the body", "<body>") from exc
    if not body:
        raise HTTPProblem(400, f"empty body: send {required}", "<body>")
    return bytes(body)


class Guard:
    """ASGI middleware in front of a whole app: auth, body limits, and a 500 for the unexpected.

    ``authenticate(scope)`` returns the caller's principal, or None to refuse (401); it is not
    asked on ``open_paths`` (requests there are anonymous; without ``authenticate`` none is).
    ``render`` draws every error this guard answers itself; ``max_body_bytes`` overrides
    ``limits.max_body_mb``."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        render: Render,
        logger: logging.Logger,
        limits: HTTPLimits,
        max_body_bytes: int | None = None,
        authenticate: Callable[[Scope], Any | None] | None = None,
        open_paths: tuple[str, ...] = (),
        unauthorized: tuple[str, str, dict[str, str]] = ("missing or wrong credentials", "AuthError", {}),
    ) -> None:
        self.app, self.render, self.logger, self.limits = app, render, logger, limits
        self.max_body_bytes = max_body_bytes if max_body_bytes is not None else limits.max_body_mb << 20
        self.body_timeout_s = limits.body_timeout_s
        self.authenticate, self.open_paths, self.unauthorized = authenticate, open_paths, unauthorized
        self.in_flight = self.anonymous_in_flight = 0  # requests (this event loop's only)
        self.by_key: Counter[Any] = Counter()  # requests in flight per principal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        principal, anonymous = None, False
        if self.authenticate is not None:
            anonymous = scope["path"] in self.open_paths
            if not anonymous:
                principal = self.authenticate(scope)
                if principal is None:
                    message, type_, headers = self.unauthorized
                    await self.render(401, message, type_, headers)(scope, receive, send)
                    return
        scope.setdefault("state", {})["principal"] = principal
        key = None if anonymous or self.authenticate is None else principal  # whose share it takes
        busy = self._busy(anonymous, key)
        if busy is not None:
            await self.render(503, busy, "Busy", {"Retry-After": "1"})(scope, receive, send)
            return
        self.in_flight += 1
        self.anonymous_in_flight += anonymous
        if key is not None:
            self.by_key[key] += 1
        try:
            await self._serve(scope, receive, send)
        finally:
            self.in_flight -= 1
            self.anonymous_in_flight -= anonymous
            if key is not None:
                self.by_key[key] -= 1
                if not self.by_key[key]:
                    del self.by_key[key]

    def _busy(self, anonymous: bool, key: Any | None) -> str | None:
        """Why this request cannot be taken now (None: it can)."""
        limits = self.limits
        if self.in_flight >= limits.max_requests:
            return f"the server has {self.in_flight} requests in flight, its limit (max_requests); retry"
        if anonymous and self.anonymous_in_flight >= limits.max_anonymous_requests:
            return (
                f"{self.anonymous_in_flight} requests without credentials are in flight, their limit "
                "(max_anonymous_requests); retry"
            )
        if key is not None and self.by_key[key] >= limits.max_requests_per_key:
            return (
                f"{self.by_key[key]} requests with these credentials are in flight, their limit "
                "(max_requests_per_key); retry"
            )
        return None

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and int(length) > self.max_body_bytes:  # h11 has checked it is a number
            message = f"body of {int(length)} bytes is larger than the limit of {self.max_body_bytes} bytes"
            await self.render(413, message, "HTTPError", {})(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, self._limited(receive), tracking_send)
        except HTTPProblem as exc:  # raised by the body limits outside any route's handler
            if not started:
                await self.render(exc.status, exc.message, "HTTPError", {})(scope, receive, send)
        except Exception as exc:  # keep serving; the caller sees a 500 with the message
            self.logger.exception("%s %s failed", scope["method"], scope["path"])
            if not started:
                message = f"internal error: {type(exc).__name__}: {exc}"
                await self.render(500, message, type(exc).__name__, {})(scope, receive, send)

    def _limited(self, receive: Receive) -> Receive:
        """``receive`` that counts body bytes (413 past the limit, whatever the transfer encoding)
        and gives the whole body ``body_timeout_s`` (408); after the body it passes through."""
        received, done, deadline = 0, False, None
        limit, timeout_s = self.max_body_bytes, self.body_timeout_s

        async def limited() -> Message:
            nonlocal received, done, deadline
            if done:
                return await receive()
            loop = asyncio.get_running_loop()
            deadline = deadline if deadline is not None else loop.time() + timeout_s
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError as exc:
                raise HTTPProblem(408, f"the body did not arrive within {timeout_s:g} s") from exc
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPProblem(413, f"body is larger than the limit of {limit} bytes")
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        return limited


def peer_of(host: str) -> str:
    """Whom a connection counts toward: its address (an IPv4-mapped one as IPv4; IPv6 per /64, the
    block one host usually holds)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class Connections:
    """The open connections of one server, by peer (used on the server's event loop only).

    A new connection past ``max_connections_per_peer`` closes its peer's oldest idle connection,
    one past ``max_connections`` the oldest idle one of the peer holding most; with nothing idle to
    close, the new one is refused (503). Idle: no request in flight and nothing left to send."""

    def __init__(self, limits: HTTPLimits) -> None:
        self.limits = limits
        self.peers: dict[str, dict[GuardedProtocol, None]] = {}  # each peer's, oldest first
        self.count = 0

    def admit(self, conn: GuardedProtocol) -> bool:
        mine = self.peers.setdefault(conn.peer, {})
        if len(mine) >= self.limits.max_connections_per_peer:
            if not self._evict(mine):
                self._forget(conn.peer)
                return False
        elif self.count >= self.limits.max_connections:
            holders = sorted(self.peers.values(), key=len, reverse=True)
            if not any(self._evict(held) for held in holders):
                self._forget(conn.peer)
                return False
        self.peers.setdefault(conn.peer, {})[conn] = None  # (an eviction may have dropped its empty dict)
        self.count += 1
        return True

    def release(self, conn: GuardedProtocol) -> None:
        held = self.peers.get(conn.peer)
        if held is not None and held.pop(conn, False) is None:
            self.count -= 1
            self._forget(conn.peer)

    def _forget(self, peer: str) -> None:
        if not self.peers.get(peer, True):
            del self.peers[peer]

    def _evict(self, held: dict[GuardedProtocol, None]) -> bool:
        victim = next((c for c in held if c.idle), None)
        if victim is None:
            return False
        self.release(victim)
        victim.close_now()
        return True


class _Transport:
    """A connection's transport as uvicorn's request cycle sees it: ``close`` may linger
    (:meth:`GuardedProtocol.close`)."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedProtocol) -> None:
        self._transport, self._protocol = transport, protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol.close()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol under the connection rules of :class:`HTTPLimits`:

    - admission by :class:`Connections` (per-peer and total caps);
    - a request head (request line and headers) must be complete ``head_timeout_s`` after the
      connection opened or after the head's first byte, else the connection closes, whatever
      ``keep_alive_s`` says; between requests an idle connection closes after ``keep_alive_s``;
    - a connection closed after an answer sent before the request body was read (413, 401, ...)
      first sends its end (FIN) and drops what the client still sends for up to ``linger_s``, so the
      client can finish sending and read the answer (closing at once would reset the connection)."""

    def __init__(self, *args: Any, limits: HTTPLimits, peers: Connections, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits, self.peers = limits, peers  # (uvicorn's self.connections: the server's set)
        self.peer = ""
        self.lingering = False
        self._head_pending = True
        self._raw: asyncio.Transport | None = None

    @property
    def idle(self) -> bool:
        """No request in flight and nothing left to send (closing it loses nothing)."""
        raw = self._raw
        return (
            (self.cycle is None or self.cycle.response_complete)
            and raw is not None
            and not raw.is_closing()
            and raw.get_write_buffer_size() == 0
        )

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._raw = transport
        super().connection_made(_Transport(transport, self))  # type: ignore[arg-type]
        self.peer = peer_of(self.client[0]) if self.client else ""
        if not self.peers.admit(self):
            self.peer = ""  # never counted
            body = b"too many connections from this address or to this server; retry later"
            transport.write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
                b"Connection: close\r\nRetry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            transport.close()
            return
        self._arm(self.limits.head_timeout_s)  # the first request's head

    def connection_lost(self, exc: Exception | None) -> None:
        self.peers.release(self)
        super().connection_lost(exc)
        self._unset_keepalive_if_required()

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of a request already answered: dropped
        if not self._head_pending and (self.cycle is None or self.cycle.response_complete):
            self._head_pending = True  # a new request's head starts
            self._arm(self.limits.head_timeout_s)
        self.conn.receive_data(data)
        self.handle_events()

    def on_response_complete(self) -> None:
        self._head_pending = False  # idle: keep_alive_s until the next head's first byte
        super().on_response_complete()

    def _arm(self, delay: float) -> None:
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(delay, self.close_now)

    def timeout_keep_alive_handler(self) -> None:
        self.close_now()

    def close_now(self) -> None:
        """Close without lingering (a missed deadline, or room made for another connection): with
        nothing left to send an orderly close, else at once (a client that does not read loses it)."""
        self._unset_keepalive_if_required()
        raw = self._raw
        if raw is not None and raw.get_write_buffer_size() == 0:
            raw.close()
        elif raw is not None:
            raw.abort()

    def close(self) -> None:
        """Close after an answer: at once, unless the client may still be sending this request's
        body (then linger, see the class)."""
        raw = self._raw
        if raw is None or raw.is_closing() or self.lingering:
            return
        self._unset_keepalive_if_required()
        if self.limits.linger_s <= 0 or self.conn.their_state is not h11.SEND_BODY or not raw.can_write_eof():
            raw.close()
            return
        self.lingering = True
        raw.write_eof()  # after what is buffered: the client sees the answer, then our end
        raw.resume_reading()
        self.timeout_keep_alive_task = self.loop.call_later(self.limits.linger_s, self.close_now)


def fit_open_files(limits: HTTPLimits, logger: logging.Logger) -> HTTPLimits:
    """``limits`` with room for ``max_connections`` sockets: the soft open-file limit is raised
    toward the hard one as needed; past the hard one the cap is lowered (logged), so a full server
    refuses connections instead of failing to accept them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = SPARE_FILES
    needed = limits.max_connections + in_use + SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    room = needed if soft == resource.RLIM_INFINITY else soft - in_use - SPARE_FILES
    if room >= limits.max_connections:
        return limits
    cap = max(1, room)
    logger.warning(
        "max_connections=%d does not fit the open-file limit (%d, hard %d): serving at most %d "
        "connections; raise the limit (ulimit -n) to serve more",
        limits.max_connections, soft, hard, cap,
    )  # fmt: skip
    return dataclasses.replace(
        limits, max_connections=cap, max_connections_per_peer=min(cap, limits.max_connections_per_peer)
    )


class BackgroundServer:
    """Serves ``app`` from a daemon thread of this process (no signal handlers are installed),
    under the connection rules of ``limits`` (:class:`GuardedProtocol`).

    ``start()`` binds, waits until the server accepts connections and returns the URL
    (``http://host:port``; ``port=0`` picks a free port; a bind failure is a :class:`ConfigError`
    naming ``port_key``); ``stop()`` stops accepting, closes connections, waits for requests in
    flight and joins the thread (idempotent)."""

    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        *,
        name: str,
        port_key: str,
        logger: logging.Logger,
        limits: HTTPLimits,
    ) -> None:
        self.app, self.host, self.port, self.name, self.port_key = app, host, port, name, port_key
        self.logger, self.limits = logger, limits
        self.url: str | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> str:
        if self.url is not None:
            return self.url
        limits = fit_open_files(self.limits, self.logger)
        sock = self._bind()
        protocol = functools.partial(GuardedProtocol, limits=limits, peers=Connections(limits))
        config = uvicorn.Config(
            self.app,
            http=protocol,  # type: ignore[arg-type]
            ws="none",
            lifespan="off",
            loop="asyncio",
            log_config=None,  # leave this process's logging alone
            log_level="warning",
            access_log=False,
            server_header=False,
            proxy_headers=False,
            backlog=BACKLOG,
            timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  (a float works)
            limit_concurrency=None,  # the caps are GuardedProtocol's (connections) and Guard's (requests)
            timeout_graceful_shutdown=int(SHUTDOWN_TIMEOUT_S),
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=self.name, daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not server.started:
            server.should_exit = True
            thread.join(timeout=SHUTDOWN_TIMEOUT_S)
            sock.close()
            raise RuntimeError(f"the {self.name} server on {self.host}:{self.port} did not start")
        host, port = sock.getsockname()[:2]
        self.url = f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"
        self._server, self._thread = server, thread
        return self.url

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto=IPPROTO_TCP: asyncio then sets TCP_NODELAY on every accepted connection (with proto 0
        # it does not, and keep-alive responses wait ~40 ms on Nagle + delayed ACK).
        deadline = time.monotonic() + BIND_RETRY_S
        while True:
            sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((self.host, self.port))
                sock.listen(BACKLOG)
                return sock
            except OSError as exc:
                sock.close()
                # a restarted service's port may still be held for a moment by the server it replaces
                if exc.errno == errno.EADDRINUSE and self.port and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                raise ConfigError(self.port_key, f"cannot bind {self.host}:{self.port}: {exc}") from exc

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = self.url = None
        if server is None or thread is None:
            return
        server.should_exit = True
        thread.join(timeout=SHUTDOWN_TIMEOUT_S + 5)
        if thread.is_alive():
            server.force_exit = True
            thread.join(timeout=5)
            self.logger.warning(
                "%s server thread did not stop in time (alive: %s)", self.name, thread.is_alive()
            )
