"""The benchmarks' open-loop streamed client (bench/prefix_routing.py, bench/disagg.py): each request to its own path,
/v1/completions (token ids), /v1/chat/completions or /v1/messages (agent sessions as text).

Each request is sent at its own time from the start of the replay (`Req.at`), on a fresh connection, to router
replica i mod len(ports), as a load balancer in front of several replicas spreads them; a request that continues
an earlier one (`Req.after`) is not sent before that one has ended, as no client could. Per request it records
when it was sent, the time to the first content event, when it ended, the usage the stream ends with (Anthropic:
input + cache creation + cache read tokens, cached = cache read), the
router's `x-request-id` (which its decision log names) and, with `chunk_times`, the gaps between content chunks.
"""

from __future__ import annotations

import asyncio
import json
import time

from bench import routing_workloads as wl

COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"


def completion_bodies(model: str, reqs: list[wl.Req], *, ignore_eos: bool = False) -> list[bytes]:
    """Streamed completion requests whose prompt is the request's token ids, asking for usage at the end."""
    out = []
    for req in reqs:
        payload = {
            "model": model,
            "prompt": wl.prompt_tokens(req),
            "max_tokens": req.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ignore_eos:
            payload["ignore_eos"] = True
        out.append(json.dumps(payload, separators=(",", ":")).encode())
    return out


async def replay(
    ports: list[int],
    headers: dict,
    reqs: list[wl.Req],
    bodies: list[bytes],
    *,
    chunk_times: bool = False,
    host: str = "127.0.0.1",
) -> list[dict]:
    """Replay `reqs` (with their encoded `bodies`) open loop; one result dict per request, in order."""
    import aiohttp

    results: list[dict] = [{} for _ in reqs]
    # A fresh connection per request: reusing a pooled one races uvicorn's 5 s keep-alive timeout ("Can not
    # write request body") after a quiet spell.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter() + 0.2
        ended = [asyncio.Event() for _ in reqs]

        async def one(i: int) -> None:
            req = reqs[i]
            delay = start + req.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if req.after is not None and not ended[req.after].is_set():
                waited = time.perf_counter()
                await ended[req.after].wait()  # the turn this one continues has not answered yet
                results[i]["held_back"] = time.perf_counter() - waited
            try:
                await send(i, req)
            finally:
                ended[i].set()

        async def send(i: int, req: wl.Req) -> None:
            h = {"Content-Type": "application/json", **headers}
            if req.session:
                h["x-session-id"] = req.session
            anthropic = req.path == MESSAGES
            if anthropic:
                h["anthropic-version"] = "2023-06-01"
            content = b'"content_block_' if anthropic else b'"choices":[{'
            sent = time.perf_counter()
            out = results[i]
            out["sent"] = sent - start
            arrivals: list[float] = []
            url = f"http://{host}:{ports[i % len(ports)]}{req.path}"
            try:
                async with session.post(url, data=bodies[i], headers=h) as resp:
                    out["status"] = resp.status
                    out["request_id"] = resp.headers.get("x-request-id")
                    async for line in resp.content:
                        if not line.startswith(b"data: {"):
                            continue
                        if content in line and (chunk_times or not arrivals):
                            arrivals.append(time.perf_counter())
                        if anthropic and b'"message_delta"' in line:
                            usage = json.loads(line[6:]).get("usage") or {}
                            out["cached"] = usage.get("cache_read_input_tokens") or 0
                            created = usage.get("cache_creation_input_tokens") or 0
                            out["prompt"] = usage.get("input_tokens", 0) + out["cached"] + created
                            out["completion"] = usage.get("output_tokens", 0)
                        elif not anthropic and b'"prompt_tokens"' in line:
                            usage = json.loads(line[6:]).get("usage") or {}
                            out["prompt"] = usage.get("prompt_tokens", 0)
                            out["completion"] = usage.get("completion_tokens", 0)
                            out["cached"] = (
                                (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                            ) or 0
                    if resp.status != 200:
                        out["error"] = f"status {resp.status}"
                    done = time.perf_counter()
                    out["ttft"] = (arrivals[0] if arrivals else done) - sent
                    if chunk_times:
                        out["itl"] = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
                    out["done"] = done - start
                    out["ok"] = resp.status == 200 and bool(arrivals)
            except Exception as exc:  # noqa: BLE001 - counted as an error
                out["ok"] = False
                out["error"] = repr(exc)[:200]

        await asyncio.gather(*(one(i) for i in range(len(reqs))))
    return results
