"""A slow store for tests and benchmarks: a TCP proxy that adds a fixed delay each way (a remote
store's round trip, on loopback), and a count of the requests an S3 client makes.

Put it in front of the SeaweedFS test server (:class:`deck.testing.s3_server.SeaweedS3`) and
point the S3 client at it, and every request the real client makes -- listings, HEADs, ranged
GETs, a PUT's ``Expect: 100-continue`` exchange, connection reuse -- pays the latency it would
pay to a store far away, without deck or the client knowing::

    with LatencyProxy(server.ports["s3"], delay_s=0.05) as proxy:   # 100 ms round trip
        storage = open_storage(server.uri("run"), proxy.s3_options(server.storage_options))

Each chunk of bytes read from one side is written to the other ``delay_s`` after it was read,
in order: a fixed one-way latency with no bandwidth limit of its own (the loopback's). A
storage wrapper that sleeps per call would only delay deck's calls, not the client's own round
trips (a missing key's HEAD then LIST in s3fs, multipart uploads), so benchmarks of where
requests go use this.

:class:`S3Requests` counts what an s3fs client sends, by operation, with each request's time
and key: what one checkpoint, verify or merge costs in round trips.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import socket
import threading
import time
from typing import Any

# Bytes read per chunk, and chunks queued per direction before the proxy stops reading: the
# delay line's memory bound (a fast sender otherwise fills it with delay_s x loopback rate).
_READ_BYTES = 64 * 1024
_QUEUED_CHUNKS = 256


class LatencyProxy:
    """A loopback TCP proxy to ``127.0.0.1:target_port`` (``target_host`` otherwise) adding
    ``delay_s`` to every byte each way (a round trip of ``2 * delay_s``).

    Runs its own event loop on a daemon thread from :meth:`start` to :meth:`stop`; :attr:`port`
    is where clients connect. :attr:`connections` counts the connections accepted."""

    def __init__(self, target_port: int, delay_s: float, target_host: str = "127.0.0.1") -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.target = (target_host, target_port)
        self.delay_s = delay_s
        self.port = 0
        self.connections = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def s3_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """s3fs ``storage_options`` (e.g. ``SeaweedS3.storage_options``) sending every request
        through this proxy (fsspec caches one client per endpoint: none is shared with a client
        of the server itself)."""
        out = copy.deepcopy(options)
        out.setdefault("client_kwargs", {})["endpoint_url"] = self.endpoint_url
        return out

    def start(self) -> LatencyProxy:
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._handle, "127.0.0.1", 0, reuse_address=True)
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as e:  # reported by start(), on the caller's thread
                failed.append(e)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="deck-latency-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), loop)
        thread.join(timeout=10)
        self._loop = self._thread = None

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- event loop --------------------------------------------------------------------------
    async def _handle(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            try:
                up_r, up_w = await asyncio.open_connection(*self.target)
            except OSError:
                return  # the client sees its connection closed, as with the server down
            try:
                _nodelay(down_w)
                _nodelay(up_w)
                await asyncio.gather(self._pipe(down_r, up_w), self._pipe(up_r, down_w))
            finally:
                up_w.close()
        except (OSError, asyncio.IncompleteReadError):
            pass  # a reset either side ends the connection, as it would without the proxy
        except asyncio.CancelledError:
            pass  # stop(): the connection ends with the proxy (the task ends, not cancelled)
        finally:
            down_w.close()
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy ``reader`` to ``writer``, each chunk ``delay_s`` after it was read; the end of
        the stream (a half close) is passed on after the delay too."""
        loop = asyncio.get_running_loop()
        line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_QUEUED_CHUNKS)

        async def read() -> None:
            while True:
                try:
                    data = await reader.read(_READ_BYTES)
                except OSError:
                    data = b""
                await line.put((loop.time() + self.delay_s, data))
                if not data:
                    return

        reading = asyncio.ensure_future(read())
        try:
            while True:
                due, data = await line.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        with contextlib.suppress(OSError):
                            writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await reading


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class S3Requests(collections.Counter[str]):
    """The requests an s3fs filesystem ``fs`` sends from now on (each call of its ``_call_s3``:
    one HTTP request, retries aside), counted by operation (``put_object``, ``head_object``,
    ...); :attr:`timeline` has each one's (start, end, operation, key or prefix), in
    ``time.perf_counter()`` seconds. Every client of the same options is the same fsspec
    instance (fsspec caches them), so a store opened elsewhere with them is counted too."""

    def __init__(self, fs: Any) -> None:
        super().__init__()
        self.timeline: list[tuple[float, float, str, str]] = []
        self._lock = threading.Lock()
        call = fs._call_s3

        async def counted(method: str, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await call(method, *args, **kwargs)
            finally:
                key = str(kwargs.get("Key", kwargs.get("Prefix", "")))
                with self._lock:
                    self[method] += 1
                    self.timeline.append((t0, time.perf_counter(), method, key))

        fs._call_s3 = counted

    def clear(self) -> None:
        with self._lock:
            super().clear()
            self.timeline = []

    def taken(self) -> dict[str, int]:
        """The counts so far, and start counting again."""
        with self._lock:
            out = dict(self)
            super().clear()
            self.timeline = []
        return out
