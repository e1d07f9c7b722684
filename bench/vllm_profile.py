"""The vLLM-CPU profile the planner's validation simulates with (planner/profiles/vllm-cpu-tiny-qwen.json),
measured on engines started exactly as the routing benchmark starts them (`bench/prefix_routing.py
--engine-kind vllm`: the tiny model with dummy weights, 128-token blocks, 2,048 KV blocks, max_num_seqs 32, 8,192
batched tokens, one OpenMP core each at nice 10), all of them up while the first is measured, as they share the
machine in the benchmark, and to the context lengths its agentic workload sends.

    .venv/bin/python -m bench.vllm_profile [--engines 2] [--up-to 12288] [--output FILE]

Takes some minutes: vLLM-CPU starts in about a minute, and the longest points prefill 12,288 tokens.
"""

from __future__ import annotations

import argparse
import sys

from bench import harness as h
from bench import prefix_routing as pr
from planner.measure import Plan
from planner.profile import Profile
from planner.profile_engine import profile_engine, write_profile

NAME = "vllm-cpu-tiny-qwen"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=2, help="engines up while the first is measured (2)")
    p.add_argument("--up-to", type=int, default=12288, help="the longest context measured, in tokens (12288)")
    p.add_argument("--output", default=None, help=f"where to write it (default planner/profiles/{NAME}.json)")
    args = p.parse_args(argv)
    max_num_seqs = int(pr.SIM_TIMING["--max-num-seqs"])
    with h.Processes() as procs:
        engines = [pr.VllmEngine(i) for i in range(args.engines)]
        for engine in engines:
            engine.start(procs)
        for engine in engines:
            engine.wait()
        h.log(f"{len(engines)} vLLM-CPU engines up; measuring {engines[0].url}")
        base = Profile(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=pr.VLLM_MAX_NUM_BATCHED_TOKENS,
            gpu_price_per_hour=0.0,
        )
        document = profile_engine(
            engines[0].url,
            pr.MODEL,
            name=NAME,
            block_size=pr.BLOCK,
            max_model_len=pr.VLLM_MAX_MODEL_LEN,
            base=base,
            plan=Plan.up_to(args.up_to, max_num_seqs),
            described_as=(
                "vLLM-CPU serving the tiny dummy-weight model (models/tiny-qwen) as bench/prefix_routing.py "
                f"--engine-kind vllm starts it (--load-format dummy --block-size {pr.BLOCK} "
                f"--num-gpu-blocks-override {engines[0].kv_blocks} --max-model-len {pr.VLLM_MAX_MODEL_LEN} "
                f"--max-num-seqs {max_num_seqs} --max-num-batched-tokens {pr.VLLM_MAX_NUM_BATCHED_TOKENS}, one "
                f"OpenMP core each, nice 10), {len(engines)} engines up, measured to {args.up_to} tokens by "
                "bench/vllm_profile.py"
            ),
        )
    h.log(f"fit: {document['fit']}")
    print(write_profile(document, args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
