"""Measure a running engine and store the fitted profile: what `manage.py profile_engine DEPLOYMENT` runs on one of
the deployment's engines, and, for an engine no deployment lists, `python -m planner.profile_engine URL --model NAME`.

The profile is written as JSON (planner/profiles/NAME.json unless told otherwise) with the measurements it was
fitted from and how well it fits them, so that it can be refitted or checked later; `python -m planner --profile
NAME` loads it by name.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import httpx

from .fit import fit_profile
from .measure import Measurements, Plan, measure
from .profile import NOT_PARAMETERS, PROFILES_DIR, Profile


def engine_version(url: str) -> str:
    try:
        return str(httpx.get(f"{url.rstrip('/')}/version", timeout=5).json().get("version", ""))
    except (httpx.HTTPError, ValueError, AttributeError):
        return ""


def profile_engine(
    url: str,
    model: str,
    *,
    name: str,
    block_size: int,
    max_model_len: int,
    base: Profile | None = None,
    plan: Plan | None = None,
    described_as: str = "",
) -> dict:
    """Measure the engine, fit `base`'s timing and KV capacity to it, and return the profile file's content."""
    base = (base or Profile()).with_(name=name)
    measurements = measure(url, model, block_size=block_size, max_model_len=max_model_len, plan=plan)
    return profile_document(measurements, base, described_as=described_as or f"{model} at {url}")


def profile_document(measurements: Measurements, base: Profile, *, described_as: str) -> dict:
    fit = fit_profile(measurements, base)
    at = datetime.now(UTC).replace(microsecond=0).isoformat()
    version = engine_version(measurements.url)
    profile = fit.profile.with_(
        source=(
            f"measured here on {at[:10]} by planner.profile_engine: {described_as}"
            f"{f' (engine {version})' if version else ''}, {os.cpu_count()} CPUs on the measuring machine; "
            "parameters fitted by least squares to the measurements below"
        )
    )
    return {
        **asdict(profile),
        "measured": {"at": at, "engine_version": version, "kv_blocks_from": measurements.kv_blocks_from},
        "fit": fit.summary(),
        "measurements": measurements.as_dict(),
    }


def write_profile(document: dict, path: str | Path | None = None) -> Path:
    """Write the document to `path`, or to planner/profiles/<name>.json."""
    target = Path(path) if path else PROFILES_DIR / f"{document['name']}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(document, indent=2) + "\n")
    return target


def refit(path: str | Path) -> dict:
    """A stored profile fitted again from the measurements it holds (after the fit changes, say)."""
    data = json.loads(Path(path).read_text())
    measurements = Measurements.from_dict(data["measurements"])
    fit = fit_profile(measurements, Profile.from_dict(data))
    kept = {k: v for k, v in data.items() if k in NOT_PARAMETERS}
    return {**asdict(fit.profile), "source": data["source"], **kept, "fit": fit.summary()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m planner.profile_engine", description=__doc__)
    p.add_argument("url", nargs="?", help="the engine's base URL (http://host:port)")
    p.add_argument("--model", help="the served model name")
    p.add_argument("--name", help="the profile's name (default: the model's)")
    p.add_argument("--output", help="where to write it (default: planner/profiles/NAME.json)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="the engine's prefill chunk limit"
    )
    p.add_argument("--gpus", type=int, default=1, help="GPUs per engine")
    p.add_argument("--gpu-price", type=float, default=0.0, help="price per GPU-hour")
    p.add_argument("--quick", action="store_true", help="fewer points (tests)")
    p.add_argument(
        "--up-to",
        type=int,
        metavar="TOKENS",
        help="measure prefills and decodes to this many tokens of context and max_num_seqs sequences at once (the "
        "longest prompts the engine's traffic sends; default: to 3,072 tokens and 16 sequences)",
    )
    p.add_argument(
        "--refit", metavar="PROFILE", help="refit a stored profile from its measurements; nothing measured"
    )
    args = p.parse_args(argv)
    if args.refit:
        print(write_profile(refit(args.refit), args.refit))
        return 0
    if not args.url or not args.model:
        p.error("URL and --model are needed to measure")
    base = Profile(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpus_per_engine=args.gpus,
        gpu_price_per_hour=args.gpu_price,
    )
    document = profile_engine(
        args.url,
        args.model,
        name=args.name or args.model,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        base=base,
        plan=QUICK if args.quick else Plan.up_to(args.up_to, args.max_num_seqs) if args.up_to else None,
    )
    print(write_profile(document, args.output))
    return 0


# Enough points to fit every parameter, in a few seconds on a fast engine.
QUICK = Plan(
    prefill_lengths=(256, 1024, 2048, 3072),
    prefix_lengths=(1024,),
    suffix_lengths=(128, 1024),
    repeats=3,
    decode_seqs=(1, 2, 4),
    decode_contexts=(256, 1024),
    decode_tokens=16,
    decode_repeats=2,
)


if __name__ == "__main__":
    raise SystemExit(main())
