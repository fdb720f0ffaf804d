"""One hardened way to serve a FastAPI app to untrusted clients, shared by both front doors.

- :class:`Guard` (ASGI middleware): authentication by a callable (the principal goes to
  ``request.state.principal``), a body limit on every transfer encoding (a declared length over the
  limit is refused before a byte is read; a chunked body as soon as it passes the limit), a deadline
  for the whole body, and a rendered 500 for anything unexpected (logged; the server keeps serving).
- :class:`BackgroundServer`: uvicorn in a daemon thread on a socket bound here, with a listen
  backlog, a connection cap (503 past it), keep-alive that also closes connections which never send
  a request, and no signal handlers.
- :func:`read_body`: a route's whole body, with the errors above as :class:`HTTPProblem`.

Each door renders errors in its own JSON shape (``render``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from miles_multilora.errors import ConfigError

BODY_TIMEOUT_S = 30.0  # the whole request body must arrive within this
KEEP_ALIVE_S = 5.0  # idle connections (before the first request too) are closed after this
MAX_CONNECTIONS = 256  # open connections; a request on one more gets 503
BACKLOG = 2048
SHUTDOWN_TIMEOUT_S = 5.0
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
    asked on ``open_paths``. ``render`` draws every error this guard answers itself."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        render: Render,
        logger: logging.Logger,
        max_body_bytes: int,
        authenticate: Callable[[Scope], Any | None] | None = None,
        open_paths: tuple[str, ...] = (),
        unauthorized: tuple[str, str, dict[str, str]] = ("missing or wrong credentials", "AuthError", {}),
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> None:
        self.app, self.render, self.logger = app, render, logger
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.authenticate, self.open_paths, self.unauthorized = authenticate, open_paths, unauthorized

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        principal = None
        if self.authenticate is not None and scope["path"] not in self.open_paths:
            principal = self.authenticate(scope)
            if principal is None:
                message, type_, headers = self.unauthorized
                await self.render(401, message, type_, headers)(scope, receive, send)
                return
        scope.setdefault("state", {})["principal"] = principal
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


class KeepAliveProtocol(H11Protocol):
    """uvicorn's h11 protocol, plus: the keep-alive timer also runs until a request's headers are
    complete, so a connection that sends nothing (or trickles headers) is closed too."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def data_received(self, data: bytes) -> None:
        self.conn.receive_data(data)
        self.handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._unset_keepalive_if_required()  # a request is being served


class BackgroundServer:
    """Serves ``app`` from a daemon thread of this process (no signal handlers are installed).

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
        keep_alive_s: float = KEEP_ALIVE_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.app, self.host, self.port, self.name, self.port_key = app, host, port, name, port_key
        self.logger, self.keep_alive_s, self.max_connections = logger, keep_alive_s, max_connections
        self.url: str | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> str:
        if self.url is not None:
            return self.url
        sock = self._bind()
        config = uvicorn.Config(
            self.app,
            http=KeepAliveProtocol,
            ws="none",
            lifespan="off",
            loop="asyncio",
            log_config=None,  # leave this process's logging alone
            log_level="warning",
            access_log=False,
            server_header=False,
            proxy_headers=False,
            backlog=BACKLOG,
            timeout_keep_alive=self.keep_alive_s,  # type: ignore[arg-type]  (a float works)
            limit_concurrency=self.max_connections + 1,  # uvicorn counts the asking connection
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
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(BACKLOG)
        except OSError as exc:
            sock.close()
            raise ConfigError(self.port_key, f"cannot bind {self.host}:{self.port}: {exc}") from exc
        return sock

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
