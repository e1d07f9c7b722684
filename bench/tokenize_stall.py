"""How long one large prompt stops the router's other streams while it is tokenized, with the tokenizing pool
(routing/rendering/tokenize_pool.py) and without it (ROUTER_TOKENIZE_PROCESSES=0: every prompt on the router's tokenizing
thread, as before the pool).

    .venv/bin/python -m bench.tokenize_stall [--sizes 1000000,2600000] [--crossover]

Against a real router and a simulated engine: a stream runs (chunks every few milliseconds); while it does, a
count_tokens call and a generation request with a prompt of each size are sent; the table gives the longest gap
between two of the stream's chunks while the large request was in flight, and that request's latency. The
generation request's prompt is over the deployment's context: the router tokenizes it (for prefix routing), then
refuses it (400), so the engine, which serves the stream too, never tokenizes it.

`--crossover` measures, in this process, what one prompt of each size costs the event loop and the caller
tokenized on the thread and in a worker: where the pool starts to pay (ROUTER_TOKENIZE_POOL_MIN_BYTES).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import string
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from bench.harness import (
    MODEL,
    PYTHON,
    ROOT,
    STATE,
    Processes,
    free_port,
    fresh_database,
    header,
    http_get,
    log,
    migrate,
    platform_env,
    run,
    sim_deployment,
    under_devstack,
    wait_until,
)

DECODE_TIME_S = 0.004  # the simulated engine's time per output token: a chunk every 4 ms
STREAM_TOKENS = 2500  # the background stream: about 10 s


def text_of(size: int, seed: int = 1) -> str:
    """`size` characters of word-like text (one piece for the tokenizer: no special tokens in it)."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(5000)]
    return " ".join(rng.choices(words, k=size // 5 + 1))[:size]


# --- the event loop's cost in this process ----------------------------------------------------------------


async def _stall_of(work) -> tuple[float, float]:
    """(the loop's longest lateness while `work` ran, its latency), in ms."""
    done = False
    worst = 0.0

    async def ticker():
        nonlocal worst
        while not done:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            worst = max(worst, time.perf_counter() - before - 0.001)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    await work()
    latency = time.perf_counter() - started
    done = True
    await tick
    return worst * 1000, latency * 1000


async def crossover(sizes: list[int]) -> list[str]:
    import orjson

    from routing.rendering.tokenize import RouterTokenizer
    from routing.rendering.tokenize_pool import TokenizePool, prompt_tokens

    folder = ROOT / "models" / MODEL
    tokenizer = RouterTokenizer(folder)
    thread = ThreadPoolExecutor(1)
    pool = TokenizePool(1, "forkserver")
    pool.preload(str(folder), "")
    await asyncio.sleep(3)  # the worker starts and loads its tokenizer
    loop = asyncio.get_running_loop()
    rows = [
        "| request JSON | thread: loop stall | thread: latency | pool: loop stall | pool: latency |",
        "|---:|---:|---:|---:|---:|",
    ]
    for size in sizes:
        results = []
        for mode in ("thread", "pool"):
            best = (float("inf"), float("inf"))
            for attempt in range(5):
                # A new text each time: nothing comes from the tokenizer's caches.
                payload = {"messages": [{"role": "user", "content": text_of(size, seed=attempt + 7 * size)}]}

                async def work(payload=payload, mode=mode):
                    if mode == "thread":
                        await loop.run_in_executor(thread, prompt_tokens, tokenizer, payload, "/v1/messages")
                    else:
                        body = orjson.dumps(payload)
                        await pool.encode(str(folder), "", body, payload, "/v1/messages")

                stall, latency = await _stall_of(work)
                best = min(best, (stall, latency), key=lambda pair: pair[1])
            results.append(best)
        (ts, tl), (ps, pl) = results
        rows.append(f"| {size:,} B | {ts:.1f} ms | {tl:.1f} ms | {ps:.1f} ms | {pl:.1f} ms |")
    pool.close()
    return rows


# --- against a router ---------------------------------------------------------------------------------------


def create_objects(env: dict, engine_url: str) -> str:
    import os

    os.environ.update(env)
    import django

    django.setup()
    from routing.models import RoutingPolicy
    from serving.models import Endpoint, Health, Pool
    from tenants.keys import api_key_create
    from tenants.models import Scope, Team, Tenant

    tenant = Tenant.objects.create(name="Bench", slug="bench")
    team = Team.objects.create(tenant=tenant, name="Stall", slug="stall")
    deployment = sim_deployment(
        # Shorter than the prompts measured: the router refuses a generation request (400) once it has tokenized
        # it, so the simulated engine, which serves the stream too, never tokenizes it (its own stall is not ours).
        max_model_len=200_000,
    )
    pool = Pool.objects.create(deployment=deployment, name="main", replicas=1)
    Endpoint.objects.create(pool=pool, name=f"{MODEL}-0", url=engine_url, role="both", health=Health.HEALTHY)
    RoutingPolicy.objects.create(
        deployment=deployment, mode="approximate"
    )  # the router tokenizes each prompt
    return api_key_create(team=team, name="bench", scopes=[Scope.INFERENCE]).secret


def stream_gaps(url: str, key: str, out: dict, started: threading.Event) -> None:
    """Read a long stream, recording when each chunk came."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say a lot."}],
        "max_tokens": STREAM_TOKENS,
        "stream": True,
    }
    times = out.setdefault("times", [])
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=120,
    ) as resp:
        for _ in resp.iter_raw():
            times.append(time.perf_counter())
            if len(times) == 20:
                started.set()
    started.set()


def one_case(url: str, key: str, route: str, size: int) -> tuple[float, float, int]:
    """(longest gap between the stream's chunks while the large request ran, its latency; in ms), its status."""
    out: dict = {}
    started = threading.Event()
    reader = threading.Thread(target=stream_gaps, args=(url, key, out, started))
    reader.start()
    started.wait(30)
    time.sleep(0.3)
    content = text_of(size, seed=hash((route, size, time.time())))  # new text: no tokenizer cache helps
    if route == "count_tokens":
        path, body = (
            "/v1/messages/count_tokens",
            {"model": MODEL, "messages": [{"role": "user", "content": content}]},
        )
    else:
        path = "/v1/messages"
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    began = time.perf_counter()
    resp = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)
    ended = time.perf_counter()
    reader.join()
    times = [t for t in out.get("times", [])]
    window = [t for t in times if began - 0.05 <= t <= ended + 0.5]
    # Gaps between consecutive chunks that overlap the large request's time in flight.
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b >= began and a <= ended]
    if not window or not gaps:
        return float("nan"), (ended - began) * 1000, resp.status_code
    return max(gaps) * 1000, (ended - began) * 1000, resp.status_code


def against_router(sizes: list[int]) -> list[str]:
    import os

    base = os.environ["DATABASE_URL"]
    STATE.mkdir(parents=True, exist_ok=True)
    env = platform_env(fresh_database(base, "bench_tokenize_stall"), os.environ["REDIS_URL"])
    migrate(env)
    rows = [
        "| tokenizing | request | prompt | longest gap in the other stream | its latency | status |",
        "|---|---|---:|---:|---:|---:|",
    ]
    with Processes() as procs:
        port = free_port()
        argv = [PYTHON, "-m", "simulator", "--model", str(ROOT / "models" / MODEL)]
        argv += ["--served-model-name", MODEL, "--port", str(port), "--decode-time", str(DECODE_TIME_S)]
        sim = procs.start("stall-simulator", argv, core=None)
        wait_until(lambda: http_get(port, "/health") == 200, sim, "simulator", 120)
        key = create_objects(env, f"http://127.0.0.1:{port}")
        for label, processes in (("thread only (before)", "0"), ("worker pool (after)", "2")):
            router_port = free_port()
            argv = [
                PYTHON,
                "-m",
                "uvicorn",
                "inference_platform.asgi:application",
                "--port",
                str(router_port),
            ]
            argv += ["--loop", "uvloop", "--http", "routing.server.http_server:LimitedHttpToolsProtocol"]
            argv += ["--no-access-log", "--log-level", "warning"]
            router_env = {
                **env,
                "ROUTER_TOKENIZE_PROCESSES": processes,
                "ROUTER_COUNT_TOKENS_MAX_BYTES": str(64 * 1024 * 1024),
                "ROUTER_MAX_BODY_BYTES": str(64 * 1024 * 1024),
                "ROUTER_TOKENIZE_WAIT_SECONDS": "60",
            }
            router = procs.start(f"stall-router-{processes}", argv, core=None, env=router_env)
            wait_until(lambda p=router_port: http_get(p, "/health") == 200, router, "router", 120)
            url = f"http://127.0.0.1:{router_port}"
            # Warm up: the tokenizer loads (and the workers start) before anything is timed.
            one_case(url, key, "count_tokens", 10_000)
            time.sleep(3)
            for route in ("count_tokens", "messages"):
                for size in sizes:
                    gap, latency, status = one_case(url, key, route, size)
                    log(f"{label} {route} {size}: gap {gap:.0f} ms, latency {latency:.0f} ms ({status})")
                    rows.append(
                        f"| {label} | {route} | {size / 1e6:.1f} MB | {gap:.0f} ms | {latency:.0f} ms | {status} |"
                    )
            procs.stop(router)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default="1000000,2600000", help="prompt sizes in characters, comma-separated"
    )
    parser.add_argument(
        "--crossover", action="store_true", help="measure the thread/pool crossover in-process"
    )
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    if args.crossover:
        rows = asyncio.run(crossover(sizes))
    else:
        under_devstack("tokenize_stall", argv, ("DATABASE_URL", "REDIS_URL"))
        rows = against_router(sizes)
    print(header("tokenize_stall", argv))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    run(main)
