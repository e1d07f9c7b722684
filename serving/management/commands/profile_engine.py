"""Measure one engine of a running deployment and store its performance profile for the planner.

    manage.py profile_engine DEPLOYMENT [--pool NAME] [--endpoint NAME] [--name NAME] [--output PATH]

The planner (planner/, not a Django app) does the measuring and the fitting; this command finds the engine and
what the deployment says about it (model name, block size, max model length, max_num_seqs, GPUs, chunk size), and
writes planner/profiles/NAME.json (NAME: the deployment's name unless given), which `python -m planner --profile
NAME` loads. Measure a deployment that serves nothing else meanwhile: other traffic lands in the timings.
See docs/planner.md#measured-profiles.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from planner.measure import Plan
from planner.profile import Profile
from planner.profile_engine import QUICK, profile_engine, write_profile
from serving.models import Endpoint, Health, ModelDeployment, Pool, PoolRole

# vLLM's --max-num-batched-tokens for an online server when a pool's extra arguments do not set it.
DEFAULT_BATCHED_TOKENS = 8192


def flag_value(args: list, flag: str) -> str | None:
    """The value of `--flag VALUE` or `--flag=VALUE` in an argument list."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return str(args[i + 1])
        if isinstance(arg, str) and arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


class Command(BaseCommand):
    help = "Measure one engine of a running deployment and write its profile for the planner."

    def add_arguments(self, parser):
        parser.add_argument("deployment", help="the deployment's name")
        parser.add_argument(
            "--pool", help="the pool to measure (default: the first that prefills and decodes)"
        )
        parser.add_argument("--endpoint", help="the endpoint's name (default: the pool's first healthy one)")
        parser.add_argument("--name", help="the profile's name (default: the deployment's)")
        parser.add_argument("--output", help="the file to write (default: planner/profiles/NAME.json)")
        parser.add_argument("--gpu-price", type=float, default=0.0, help="price per GPU-hour for the planner")
        parser.add_argument("--quick", action="store_true", help="fewer points: seconds on a fast engine")
        parser.add_argument(
            "--up-to",
            type=int,
            metavar="TOKENS",
            help="measure to this many tokens of context and the pool's max_num_seqs sequences at once (the "
            "longest prompts its traffic sends; default: to 3,072 tokens and 16 sequences)",
        )

    def handle(self, *args, **options):
        try:
            deployment = ModelDeployment.objects.get(name=options["deployment"])
        except ModelDeployment.DoesNotExist as exc:
            raise CommandError(f"no deployment {options['deployment']}") from exc
        pool = self._pool(deployment, options["pool"])
        endpoint = self._endpoint(pool, options["endpoint"])
        batched = flag_value(pool.extra_engine_args or [], "--max-num-batched-tokens")
        base = Profile(
            max_num_seqs=pool.max_num_seqs,
            max_num_batched_tokens=int(batched) if batched else DEFAULT_BATCHED_TOKENS,
            gpus_per_engine=pool.gpus_per_replica,
            gpu_price_per_hour=options["gpu_price"],
        )
        plan: Plan | None = QUICK if options["quick"] else None
        if options["up_to"] and not options["quick"]:
            if options["up_to"] >= deployment.max_model_len:
                raise CommandError(
                    f"--up-to {options['up_to']} is not below the deployment's max_model_len "
                    f"({deployment.max_model_len}): a prompt that long cannot be answered"
                )
            plan = Plan.up_to(options["up_to"], pool.max_num_seqs)
        self.stdout.write(f"measuring {endpoint.name} ({endpoint.url}) of {deployment.name}/{pool.name}")
        document = profile_engine(
            endpoint.url,
            deployment.served_model_name or deployment.name,
            name=options["name"] or deployment.name,
            block_size=deployment.block_size,
            max_model_len=deployment.max_model_len,
            base=base,
            plan=plan,
            described_as=(
                f"deployment {deployment.name} ({deployment.engine_kind}, {deployment.model_source}), "
                f"endpoint {endpoint.name} of pool {pool.name}"
                f"{f', {pool.accelerator}' if pool.accelerator else ''}"
            ),
        )
        path = write_profile(document, options["output"])
        fit = document["fit"]
        self.stdout.write(
            f"wrote {path}: step {document['step_fixed_s']} s + {document['decode_per_seq_s']} s/seq, "
            f"prefill {document['prefill_per_token_s']} s/token, KV {document['kv_capacity_tokens']} tokens; "
            f"median error prefill {fit['prefill_median_abs_error']:.1%}, decode {fit['decode_median_abs_error']:.1%}"
        )

    def _pool(self, deployment: ModelDeployment, name: str | None) -> Pool:
        pools = deployment.pools.all()
        if name:
            pool = pools.filter(name=name).first()
        else:
            pool = pools.filter(role=PoolRole.BOTH).first() or pools.first()
        if pool is None:
            raise CommandError(f"{deployment.name} has no pool {name or ''}".strip())
        return pool

    def _endpoint(self, pool: Pool, name: str | None) -> Endpoint:
        endpoints = pool.endpoints.filter(draining_since__isnull=True)
        if name:
            endpoint = endpoints.filter(name=name).first()
        else:
            endpoint = endpoints.filter(health=Health.HEALTHY).first()
        if endpoint is None:
            raise CommandError(f"{pool}: no {'endpoint ' + name if name else 'healthy endpoint'} to measure")
        return endpoint
