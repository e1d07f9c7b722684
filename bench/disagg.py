"""Prefill/decode disaggregation and the CPU KV tier on simulated engines at fleet scale, on the agentic workload
of bench/prefix_routing.py, through the router (policy precise).

    .venv/bin/python -m bench.disagg            # full: 20 agent sessions over 30 s, 4 scenarios, about 4 minutes
    .venv/bin/python -m bench.disagg --quick    # 6 sessions over 10 s, about 2 minutes

Scenarios, each on freshly started engines and a freshly started router:

- `pd`: 4 prefill engines (NIXL `kv_producer`) + 4 decode engines (NIXL `kv_consumer`), each with its own
  side-channel port, in one deployment with a prefill and a decode pool; `pd_split_threshold_tokens` 512.
- `aggregated`: 8 aggregated engines.
- `tight`: 8 aggregated engines with a small GPU KV cache (`--num-gpu-blocks-override` TIGHT_BLOCKS).
- `tight+cpu`: the same plus a CPU tier (`--cpu-offload-blocks` CPU_BLOCKS; restores cost the simulator's default
  fraction of a recompute).

Every request is an open-loop streamed /v1/completions (prompt as token ids); TTFT and the inter-token latency are
taken from the arrival times of the streamed chunks at the client. Setup (database, key, deployment, KV-event
ingester, router) reuses bench/prefix_routing.py, the /metrics scraper bench/harness.py. It uses the database
`bench_disagg` (dropped and re-created) and Redis database 13 (flushed) on DATABASE_URL / REDIS_URL (defaults: the
local PostgreSQL and Redis). Every process started here runs in its own session and is stopped at the end, on error
and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from bench import harness as h
from bench import prefix_routing as rb
from bench import routing_workloads as wl
from bench import streamed
from bench.docs_section import write_section

ROOT, PYTHON, MODEL, STATE = h.ROOT, h.PYTHON, h.MODEL, h.STATE

BENCH_DB = "bench_disagg"
BENCH_REDIS_DB = 13
BLOCK = rb.BLOCK
KV_BLOCKS = rb.KV_BLOCKS  # 2048 blocks per engine, as in bench/prefix_routing.py
TIGHT_BLOCKS = 104  # 13,312 tokens per engine: one long agent context (up to 96 blocks) at a time
CPU_BLOCKS = 2048
MAX_OUTPUT = 32  # enough streamed tokens per request for an inter-token latency
PD_THRESHOLD = 512
SIM_TIMING = {
    "--prefill-time-per-token": "0.00003",  # as bench/prefix_routing.py: 30 us per uncached prompt token
    "--prefill-overhead": "0.005",
    "--decode-time": "0.01",  # 10 ms per token with one sequence running
    "--decode-time-per-seq": "0.003",  # + 3 ms per other running sequence (6x prefix_routing's 0.5 ms)
    "--max-num-seqs": "32",
    "--kv-transfer-time-per-token": "0.000002",  # NIXL pull: 2 us per token (15x cheaper than recomputing)
}
SCENARIOS = ["pd", "aggregated", "tight", "tight+cpu"]


log = h.log


class Engine(rb.Engine):
    """bench/prefix_routing.py's simulated engine, with a role, a KV capacity and extra flags."""

    def __init__(self, index: int, role: str, blocks: int, extra: list[str], nixl_role: str | None):
        super().__init__(index, blocks)
        self.role = role
        self.extra = extra
        self.nixl_role = nixl_role
        self.name = f"{MODEL}-{role}-{index}"

    def start(self, procs: h.Processes) -> None:
        argv = self.argv(SIM_TIMING)
        env = {"PYTHONHASHSEED": "0"}
        if self.nixl_role:
            transfer = {"kv_connector": "NixlConnector", "kv_role": self.nixl_role, "kv_buffer_device": "cpu"}
            argv += ["--kv-transfer-config", json.dumps(transfer)]
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(h.free_port())
        argv += self.extra
        self.proc = procs.start(f"disagg-engine-{self.role}-{self.index}", argv, core=None, env=env)


def engines_for(scenario: str) -> list[Engine]:
    if scenario == "pd":
        return [Engine(i, "prefill", KV_BLOCKS, [], "kv_producer") for i in range(4)] + [
            Engine(i, "decode", KV_BLOCKS, [], "kv_consumer") for i in range(4)
        ]
    if scenario == "aggregated":
        return [Engine(i, "both", KV_BLOCKS, [], None) for i in range(8)]
    cpu = ["--cpu-offload-blocks", str(CPU_BLOCKS)] if scenario == "tight+cpu" else []
    return [Engine(i, "both", TIGHT_BLOCKS, cpu, None) for i in range(8)]


def create_objects(engines: list[Engine], scenario: str) -> tuple[str, int]:
    """One tenant, team, key and deployment; pools by role as tests/routing/test_disaggregation.py makes them."""
    from inference_platform.config_version import bump_config_version
    from routing.models import RoutingPolicy
    from serving.models import Endpoint, Health, ModelDeployment, Pool
    from tenants.keys import api_key_create
    from tenants.models import Scope, Team, Tenant

    ModelDeployment.objects.all().delete()
    tenant, _ = Tenant.objects.get_or_create(slug="bench", defaults={"name": "Bench"})
    team, _ = Team.objects.get_or_create(tenant=tenant, slug="agents", defaults={"name": "Agents"})
    deployment = h.sim_deployment(max_model_len=rb.MAX_MODEL_LEN, block_size=BLOCK)
    pools = {}
    for role in dict.fromkeys(e.role for e in engines):
        members = [e for e in engines if e.role == role]
        pools[role] = Pool.objects.create(
            deployment=deployment,
            name="main" if role == "both" else role,
            role=role,
            kv_connector="" if role == "both" else "NixlConnector",
            replicas=len(members),
        )
    for engine in engines:
        Endpoint.objects.create(
            pool=pools[engine.role],
            name=engine.name,
            url=engine.url,
            role=engine.role,
            health=Health.HEALTHY,
            kv_events_endpoint=f"tcp://127.0.0.1:{engine.kv_port}",
        )
    RoutingPolicy.objects.update_or_create(
        deployment=deployment, defaults={"mode": "precise", "pd_split_threshold_tokens": PD_THRESHOLD}
    )
    bump_config_version()
    key = api_key_create(team=team, name=f"bench-{scenario}", scopes=[Scope.INFERENCE]).secret
    return key, deployment.id


# --- the replay ----------------------------------------------------------------------------------------------


def router_plans(port: int) -> dict[str, float]:
    import http.client

    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "router_plans":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.labels.get("kind", "?")] = out.get(s.labels.get("kind", "?"), 0) + s.value
    return out


def summarize(results: list[dict]) -> dict:
    pct = rb.pct
    ok = [r for r in results if r.get("ok")]
    errors = [r for r in results if not r.get("ok")]
    ttfts = [r["ttft"] for r in ok]
    itls = [x for r in ok for x in r["itl"]]
    prompt = sum(r.get("prompt", 0) for r in ok)
    cached = sum(r.get("cached", 0) for r in ok)
    completion = sum(r.get("completion", 0) for r in ok)
    wall = max((r["done"] for r in ok), default=0) - min((r["sent"] for r in ok), default=0)
    return {
        "requests": len(results),
        "errors": len(errors),
        "error_sample": (errors[0].get("error") or f"status {errors[0].get('status')}") if errors else "",
        "hit_share": cached / prompt if prompt else float("nan"),
        "ttft_p50": pct(ttfts, 0.5) * 1000,
        "ttft_p90": pct(ttfts, 0.9) * 1000,
        "itl_p50": pct(itls, 0.5) * 1000,
        "itl_p90": pct(itls, 0.9) * 1000,
        "itl_mean": statistics.mean(itls) * 1000 if itls else float("nan"),
        "rps": len(ok) / wall if wall else float("nan"),
        "otps": completion / wall if wall else float("nan"),
        "wall": wall,
    }


# --- main ---------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="6 sessions over 10 s (about 2.5 minutes)")
    p.add_argument("--scenarios", nargs="+", default=SCENARIOS, choices=SCENARIOS)
    p.add_argument(
        "--docs", default=None, help="write the section here (default docs/benchmarks.md; none with --quick)"
    )
    return p.parse_args(argv)


def run_scenario(procs, env, rclient, scenario, reqs, bodies) -> dict:
    engines = engines_for(scenario)
    for engine in engines:
        engine.start(procs)
    for engine in engines:
        engine.wait()
    key, deployment_id = create_objects(engines, scenario)
    ingester = procs.start(
        f"disagg-kv-ingester-{scenario}", [PYTHON, "manage.py", "run_kv_ingester"], core=None, env=env
    )
    router = None
    try:
        time.sleep(1.0)  # the ingester subscribes to the engines
        router, port = rb.start_router(procs, env, f"disagg-{scenario}")
        t0 = time.monotonic()
        results = asyncio.run(
            streamed.replay([port], {"Authorization": f"Bearer {key}"}, reqs, bodies, chunk_times=True)
        )
        elapsed = time.monotonic() - t0
        s = summarize(results)
        s["plans"] = router_plans(port)
        s["index"] = rb.index_size(rclient, deployment_id)
        s["engines"] = sum(e.role != "prefill" for e in engines)
        log(
            f"{scenario:<11} TTFT p50 {s['ttft_p50']:.0f} p90 {s['ttft_p90']:.0f} ms  ITL p50 {s['itl_p50']:.1f} "
            f"p90 {s['itl_p90']:.1f} ms  {s['rps']:.1f} req/s {s['otps']:.0f} out tok/s  hit {s['hit_share']:.3f}  "
            f"plans {s['plans']}  errors {s['errors']} {s['error_sample']}  ({elapsed:.0f} s)"
        )
        return s
    finally:
        from serving.models import ModelDeployment

        ModelDeployment.objects.all().delete()  # the scraper stops polling these engines
        if router is not None:
            procs.stop(router)
        procs.stop(ingester)
        for engine in engines:
            procs.stop(engine.proc)
        rclient.flushdb()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0")
    started = time.monotonic()
    STATE.mkdir(parents=True, exist_ok=True)
    docs = Path(args.docs) if args.docs else (None if args.quick else ROOT / "docs" / "benchmarks.md")
    redis_url = h.with_path(os.environ["REDIS_URL"], f"/{BENCH_REDIS_DB}")
    with h.Processes() as procs:
        procs.after_stop(lambda: h.flush_redis(redis_url))
        import redis

        rclient = redis.Redis.from_url(redis_url)
        rclient.flushdb()
        env = h.platform_env(h.fresh_database(os.environ["DATABASE_URL"], BENCH_DB), redis_url)
        log(f"database {BENCH_DB} (dropped and re-created), Redis db {BENCH_REDIS_DB} (flushed)")
        h.migrate(env)
        os.environ.update(env)
        import django

        django.setup()
        h.scrape_loads(procs)

        sessions, duration = (6, 10.0) if args.quick else (20, 30.0)
        reqs, info = wl.agentic(sessions, duration, MAX_OUTPUT)
        ceil = wl.ceilings(reqs, BLOCK, 8 * TIGHT_BLOCKS)
        meta = {**info, **ceil, "n": len(reqs), "span": reqs[-1].at}
        log(
            f"agentic: {len(reqs)} requests over {reqs[-1].at:.1f} s, ceiling {ceil['ceiling']:.3f}, one LRU of "
            f"the tight fleet's capacity {ceil['lru_fleet']:.3f}; {info}"
        )
        bodies = streamed.completion_bodies(MODEL, reqs, ignore_eos=True)
        rows = {}
        for scenario in args.scenarios:
            rows[scenario] = run_scenario(procs, env, rclient, scenario, reqs, bodies)

        block = report(args, argv, rows, meta)
        print()
        print(block)
        if docs:
            write_section(docs, "disagg", block, "Prefill/decode disaggregation", "bench/disagg.py")
            log(f"wrote {docs}")
        log(f"done in {time.monotonic() - started:.0f} s")
        return 0


def report(args, argv, rows, meta) -> str:
    fmt = rb.fmt
    lines = [
        f"### {'Quick' if args.quick else 'Full'} run",
        "",
        h.header("disagg", argv) + f" Router at commit {h.git_head()}.",
        f"- Workload: bench/routing_workloads.py's agentic generator, {meta['sessions']} sessions, {meta['n']} requests "
        f"({meta['subagent_requests']} from {meta['bursts']} sub-agent bursts) over {meta['span']:.0f} s, mean "
        f"prompt {meta['prompt_tokens'] / meta['n']:,.0f} tokens, `max_tokens` {MAX_OUTPUT} with `ignore_eos`; "
        f"open loop, streamed /v1/completions, one connection per request. Prefix ceiling (one infinite cache) "
        f"{meta['ceiling']:.1%}; one LRU cache of the tight fleet's total capacity ({8 * TIGHT_BLOCKS} blocks) would "
        f"reach {meta['lru_fleet']:.1%}.",
        "- Engines: simulators, "
        + ", ".join(f"`{k} {v}`" for k, v in SIM_TIMING.items())
        + f", {BLOCK}-token blocks, KV events on, the KV-event ingester running, /metrics scraped every second. "
        f"pd: 4 prefill (NIXL `kv_producer`) + 4 decode (`kv_consumer`) engines, {KV_BLOCKS} GPU blocks each; "
        f"aggregated: 8 engines, {KV_BLOCKS} blocks each; tight: 8 engines, {TIGHT_BLOCKS} blocks each; "
        f"tight+cpu: the same plus `--cpu-offload-blocks {CPU_BLOCKS}` (restore = the simulator's default fraction "
        "of the recompute time). Fresh engines and router per scenario. Nothing pinned.",
        f"- Router: policy precise (defaults), `pd_split_threshold_tokens` {PD_THRESHOLD}; one uvicorn worker.",
        "- TTFT and inter-token latency (ITL) from the arrival times of the streamed chunks at the client; "
        "prefix-hit share = usage `cached_tokens` / `prompt_tokens` summed over the requests; throughput over the "
        "span from the first send to the last completion.",
        "",
        "| scenario | TTFT p50 / p90 (ms) | ITL p50 / p90 (ms) | req/s | output tok/s | prefix-hit share (usage) | "
        "router plans | errors |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    names = {
        "pd": "4 prefill + 4 decode (P/D)",
        "aggregated": "8 aggregated",
        "tight": f"8 aggregated, {TIGHT_BLOCKS} GPU blocks",
        "tight+cpu": f"8 aggregated, {TIGHT_BLOCKS} GPU blocks + CPU tier {CPU_BLOCKS}",
    }
    for scenario, s in rows.items():
        plans = ", ".join(f"{k} {v:.0f}" for k, v in sorted(s["plans"].items())) or "-"
        lines.append(
            f"| {names[scenario]} | {fmt(s['ttft_p50'], 0)} / {fmt(s['ttft_p90'], 0)} | {fmt(s['itl_p50'])} / "
            f"{fmt(s['itl_p90'])} | {fmt(s['rps'])} | {fmt(s['otps'], 0)} | {s['hit_share']:.1%} | {plans} | "
            f"{s['errors']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    h.run(main)
