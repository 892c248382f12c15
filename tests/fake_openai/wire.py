"""HTTP/1.1 over asyncio, by hand: answers inline when it can, drops a connection with a TCP RST on demand."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from http import HTTPStatus

from .app import FakeApp
from .bodies import CLOSE, RESET, Reply, _json_reply, error_body
from .config import FakeConfig

_MAX_HEAD = 64 * 1024
_MAX_BODY = 256 * 1024 * 1024


def _encode_reply(reply: Reply, keep_alive: bool) -> bytes:
    phrase = HTTPStatus(reply.status).phrase
    lines = [f"HTTP/1.1 {reply.status} {phrase}", f"content-length: {len(reply.body)}"]
    if reply.content_type:
        lines.append(f"content-type: {reply.content_type}")
    lines += [f"{k}: {v}" for k, v in reply.headers]
    if not keep_alive:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + reply.body


class HttpConnection(asyncio.Protocol):
    """One client connection: parses requests in order, answers inline or through one task at a time."""

    def __init__(self, app: FakeApp, connections: set):
        self.app = app
        self.connections = connections
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.connections.discard(self)
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.task is None:
            self._process()

    def _process(self) -> None:
        while not self.closed and self.task is None:
            request = self._next_request()
            if request is None:
                return
            method, target, headers, body, keep_alive = request
            try:
                result = self.app.handle(method, target, headers, body)
            except Exception as exc:  # a bug here must show up as a 500, not a dead connection
                result = _json_reply(500, error_body(500, f"fake server bug: {exc!r}"))
            if isinstance(result, (Reply, str)):
                self._finish(result, keep_alive)
            else:
                self.task = asyncio.ensure_future(result)
                self.task.add_done_callback(lambda t, k=keep_alive: self._task_done(t, k))

    def _task_done(self, task: asyncio.Task, keep_alive: bool) -> None:
        self.task = None
        if task.cancelled() or self.closed:
            return
        exc = task.exception()
        if exc is not None:
            self._finish(_json_reply(500, error_body(500, f"fake server bug: {exc!r}")), False)
        else:
            self._finish(task.result(), keep_alive)
        self._process()

    def _finish(self, result: Reply | str, keep_alive: bool) -> None:
        if result == RESET:
            self.abort()
        elif result == CLOSE:
            self.close()
        else:
            self.transport.write(_encode_reply(result, keep_alive))
            if not keep_alive:
                self.close()

    def _next_request(self) -> tuple[str, str, dict[str, str], bytes, bool] | None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > _MAX_HEAD:
                self._finish(_json_reply(431, {"detail": "Request Header Fields Too Large"}), False)
            return None
        lines = self.buffer[:end].decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ", 2)
        except ValueError:
            self._finish(_json_reply(400, {"detail": "Bad Request"}), False)
            return None
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", ""):
            self._finish(_json_reply(411, {"detail": "Length Required"}), False)
            return None
        length = headers.get("content-length") or "0"
        length = int(length) if length.isdigit() else _MAX_BODY + 1
        if length > _MAX_BODY:
            self._finish(_json_reply(413, {"detail": "Request Entity Too Large"}), False)
            return None
        if len(self.buffer) < end + 4 + length:
            return None
        body = bytes(self.buffer[end + 4 : end + 4 + length])
        del self.buffer[: end + 4 + length]
        connection = headers.get("connection", "").lower()
        keep_alive = "close" not in connection and (version != "HTTP/1.0" or "keep-alive" in connection)
        return method, target, headers, body, keep_alive

    def close(self) -> None:
        self.closed = True
        self.transport.close()

    def abort(self) -> None:
        """Drop the connection with a TCP RST (SO_LINGER 0), the way a crashed server looks."""
        self.closed = True
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()


async def serve(cfg: FakeConfig, host: str, port: int, stop: asyncio.Future, on_ready=None) -> None:
    """Serve until `stop` resolves; then drop every connection."""
    app = FakeApp(cfg)
    connections: set[HttpConnection] = set()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: HttpConnection(app, connections), host, port, backlog=4096, reuse_address=True
    )
    if on_ready is not None:
        on_ready(server.sockets[0].getsockname()[1])
    try:
        await stop
    finally:
        server.close()
        for conn in list(connections):
            conn.abort()
        await server.wait_closed()
        await asyncio.sleep(0)  # let cancelled tasks unwind
