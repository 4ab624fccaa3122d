"""A TCP link to a real Redis that a test cuts at the worst moment for a reader: the request reaches Redis and
is carried out, its reply is dropped and the connection closed, and new connections are refused until the
link is restored (what a client sees when Redis goes down, or the network between them does, after it
executed a command and before the reply arrived)."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit, urlunsplit


class FlakyLink:
    def __init__(self, redis_url: str) -> None:
        parts = urlsplit(redis_url)
        self._parts = parts
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self.cut = False  # replies are dropped, connections closed and refused
        self.replies_dropped = 0
        self._replies_left: int | None = None

    def cut_after(self, replies: int) -> None:
        """Let ``replies`` more replies through, then cut (a reply counted as one read of bytes from Redis:
        exact for the small replies of a test)."""
        self._replies_left = replies

    @property
    def url(self) -> str:
        assert self._server is not None, "start the link first"
        port = self._server.sockets[0].getsockname()[1]
        userinfo, _, _ = self._parts.netloc.rpartition("@")
        netloc = f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}"
        return urlunsplit(self._parts._replace(netloc=netloc))

    async def start(self) -> FlakyLink:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer, replies=False)),
            asyncio.create_task(self._pump(up_reader, writer, replies=True)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
                self._tasks.discard(pump)
            for end in (writer, up_writer):
                end.close()
                with contextlib.suppress(Exception):
                    await end.wait_closed()

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, replies: bool) -> None:
        while data := await source.read(65536):
            if replies and self._replies_left == 0:
                self.cut, self._replies_left = True, None
            elif replies and self._replies_left is not None:
                self._replies_left -= 1
            if replies and self.cut:
                self.replies_dropped += 1
                return
            sink.write(data)
            await sink.drain()
