"""A lean closed-loop HTTP/1.1 load generator: asyncio protocols on uvloop, httptools for parsing.

Run as a long-lived child process (pinned to a core by the caller). It reads one JSON job per line on stdin and
answers one JSON line on stdout:

    {"host": "127.0.0.1", "port": 8000, "request": "<the full HTTP request, latin-1>", "concurrency": 16,
     "warmup": 1.0, "duration": 5.0}
    -> {"completed": N, "errors": E, "ttfb": [...seconds...], "total": [...seconds...], "duration": 5.0, ...}

Each of `concurrency` keep-alive connections sends the same request, waits for the whole response and sends the
next at once (a closed loop). Per request it records the time to the first byte of the response body and the
total time, both from the moment the request was written. Requests that complete inside the measurement window
(after the warm-up) count; their latencies are the samples. A response counts as an error unless it is a 200
whose body ends with `data: [DONE]`. Connections are opened during the warm-up and closed after each job.

Why not aiohttp or httpx: on one core aiohttp caps near 1,500-2,000 req/s as a client, which would hide the
gateway's cost; this loop does little more than a `write` and a parser feed per request.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import httptools

DONE = b"data: [DONE]\n\n"
perf = time.perf_counter


class Run:
    def __init__(self, job: dict):
        self.host, self.port = job["host"], int(job["port"])
        self.request = job["request"].encode("latin-1")
        self.concurrency = int(job["concurrency"])
        self.warmup, self.duration = float(job["warmup"]), float(job["duration"])
        self.window_start = self.window_end = 0.0
        self.running = True
        self.ttfb: list[float] = []
        self.total: list[float] = []
        self.errors = 0
        self.error_samples: list[str] = []
        self.connections: list[Conn] = []
        self.reconnects = 0

    def record(self, sent: float, first: float | None, done: float, ok: bool, why: str) -> None:
        if self.window_start <= done <= self.window_end:
            if ok:
                self.ttfb.append((first or done) - sent)
                self.total.append(done - sent)
            else:
                self.errors += 1
                if len(self.error_samples) < 3:
                    self.error_samples.append(why)

    async def open(self) -> Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: Conn(self), self.host, self.port)
        return conn

    async def execute(self) -> dict:
        loop = asyncio.get_running_loop()
        start = perf()
        self.window_start = start + self.warmup
        self.window_end = self.window_start + self.duration
        self.connections = [await asyncio.wait_for(self.open(), 10) for _ in range(self.concurrency)]
        for conn in self.connections:
            conn.fire()
        await asyncio.sleep(max(0.0, self.window_end - perf()))
        self.running = False
        # Requests still in flight at the end are not counted; give them a moment, then cut the connections.
        waiter = loop.create_future()
        loop.call_later(0.05, waiter.set_result, None)
        await waiter
        for conn in self.connections:
            conn.close()
        return {
            "completed": len(self.total),
            "errors": self.errors,
            "error_samples": self.error_samples,
            "reconnects": self.reconnects,
            "duration": self.duration,
            "ttfb": self.ttfb,
            "total": self.total,
        }


class Conn(asyncio.Protocol):
    """One keep-alive connection that sends the next request as soon as the last response is complete."""

    def __init__(self, run: Run):
        self.run = run
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.sent = 0.0
        self.first: float | None = None
        self.tail = b""
        self.status = 0
        self.busy = False
        self.closed = False

    # asyncio.Protocol
    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"parse error: {exc}")

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.busy:
            self.busy = False
            self.run.record(self.sent, self.first, perf(), False, f"connection lost: {exc!r}")
        if self.run.running:
            self.run.reconnects += 1
            asyncio.ensure_future(self._replace())

    async def _replace(self) -> None:
        try:
            conn = await self.run.open()
        except OSError as exc:
            self.run.record(perf(), None, perf(), False, f"reconnect failed: {exc!r}")
            await asyncio.sleep(0.05)
            if self.run.running:
                asyncio.ensure_future(self._replace())
            return
        self.run.connections.append(conn)
        conn.fire()

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.first is None:
            self.first = perf()
        self.tail = (self.tail + body)[-len(DONE) :]

    def on_message_complete(self) -> None:
        done = perf()
        ok = self.status == 200 and self.tail == DONE
        why = "" if ok else f"status {self.status}, body ends {self.tail!r}"
        self.busy = False
        self.run.record(self.sent, self.first, done, ok, why)
        if not self.parser.should_keep_alive():
            self.close()
            return
        if self.run.running:
            self.fire()

    # ours
    def fire(self) -> None:
        if self.closed:
            return
        self.first = None
        self.tail = b""
        self.status = 0
        self.busy = True
        self.sent = perf()
        self.transport.write(self.run.request)

    def _fail(self, why: str) -> None:
        if self.busy:
            self.busy = False
            self.run.record(self.sent, self.first, perf(), False, why)
        self.close()

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()


def write_all(data: bytes) -> bool:
    """Write the whole answer to stdout's pipe with os.write on a blocking descriptor, over short writes too;
    returns whether the descriptor was blocking already.

    Written through sys.stdout, an answer larger than the pipe (64 KB) was now and then lost past its first
    64 KB: the load generator had written 350 KB, the benchmark had read 64 KB, the pipe was empty and held by
    no one else, and the benchmark waited for the rest (4 of 5 runs of `--quick --rounds 3` stalled once so);
    written this way, none of 6 did.
    """
    fd = sys.stdout.fileno()
    blocking = os.get_blocking(fd)
    os.set_blocking(fd, True)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    return blocking


def main() -> None:
    import faulthandler
    import signal

    import uvloop

    # The benchmark sends SIGUSR1 before giving up on a point: where this process was stuck goes to its log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        run = Run(job)
        began = time.monotonic()
        print(
            f"{time.strftime('%H:%M:%S')} job: port {run.port}, c={run.concurrency}",
            file=sys.stderr,
            flush=True,
        )
        try:
            # Every point answers, on time: a gateway that refuses or stops answering is an error, not a hang.
            result = uvloop.run(asyncio.wait_for(run.execute(), run.warmup + run.duration + 30))
        except (OSError, TimeoutError) as exc:
            result = {
                "completed": 0,
                "errors": 1,
                "error_samples": [f"the point did not run: {exc!r}"],
                "reconnects": run.reconnects,
                "duration": run.duration,
                "ttfb": [],
                "total": [],
            }
        answer = (json.dumps(result) + "\n").encode()
        blocking = write_all(answer)
        took = time.monotonic() - began
        print(
            f"{time.strftime('%H:%M:%S')} answered: {len(answer)} bytes after {took:.1f} s"
            + ("" if blocking else " (stdout had been left non-blocking)"),
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    main()
