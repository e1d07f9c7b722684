"""Prefill/decode disaggregation and peer KV pulls, decided per request.

The plans (plan_disaggregated, plan_peer_pull) are pure; the legs below run them for an exchange
(routing/server/exchange.py). See docs/routing.md#pd-disaggregation-and-peer-pulls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from routing.info import PREFILL_ROLES, DeploymentInfo, EndpointInfo
from routing.rendering.dialects import OPENAI, Usage
from routing.rendering.routes import ROUTES
from routing.scheduling.load import EndpointLoad
from routing.scheduling.pipeline import Candidate, RequestContext
from routing.server import metrics
from routing.server.upstream import UpstreamError

if TYPE_CHECKING:
    from routing.server.exchange import Exchange

REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillPlan:
    """Where a request's prompt is prefilled: on its decode engine (aggregated), on a prefill engine whose KV the
    decode engine pulls (disaggregated), or pulled from a peer that holds it (peer_pull)."""

    kind: str  # "aggregated", "disaggregated" or "peer_pull"
    prefill: EndpointInfo | None = None
    uncached_tokens: int = 0


def blocks_held(ctx: RequestContext, endpoint_id: int) -> int:
    held = ctx.held.get(endpoint_id)
    return held.blocks if held else ctx.approx_held.get(endpoint_id, 0)


def uncached_tokens(deployment: DeploymentInfo, ctx: RequestContext, endpoint_id: int) -> int:
    return max(0, ctx.prompt_tokens_estimate - blocks_held(ctx, endpoint_id) * deployment.block_size)


def plan_disaggregated(
    deployment: DeploymentInfo, ctx: RequestContext, decode: Candidate, prefill_choice
) -> PrefillPlan:
    """Split when the decode endpoint would recompute at least the threshold; `prefill_choice()` picks the
    prefill endpoint with the prefill pool's scorers, or returns None when none is available."""
    if not ctx.prompt_tokens_estimate or not any(e.role in PREFILL_ROLES for e in deployment.endpoints):
        return PrefillPlan("aggregated")
    uncached = uncached_tokens(deployment, ctx, decode.endpoint.id)
    if uncached < deployment.policy.pd_split_threshold_tokens:
        return PrefillPlan("aggregated", uncached_tokens=uncached)
    prefill = prefill_choice()
    if prefill is None:
        return PrefillPlan("aggregated", uncached_tokens=uncached)
    return PrefillPlan("disaggregated", prefill.endpoint, uncached)


def plan_peer_pull(
    deployment: DeploymentInfo, ctx: RequestContext, chosen: Candidate, candidates: list[Candidate]
) -> PrefillPlan:
    """Pull from the longest-prefix holder when load moved the request elsewhere and pulling saves enough."""
    holders = set(ctx.held) | set(ctx.approx_held)
    if not chosen.endpoint.kv_both or not holders:
        return PrefillPlan("aggregated")
    by_id = {c.endpoint.id: c for c in candidates}
    holder_id = max(holders, key=lambda e: blocks_held(ctx, e))
    holder = by_id.get(holder_id)
    if holder is None or holder_id == chosen.endpoint.id or not holder.endpoint.kv_both:
        return PrefillPlan("aggregated")
    saved = (blocks_held(ctx, holder_id) - blocks_held(ctx, chosen.endpoint.id)) * deployment.block_size
    if saved < deployment.policy.pd_split_threshold_tokens:
        return PrefillPlan("aggregated")
    # Waiting for the holder is the other option: take it when the holder is not actually busier.
    if holder.load.active + holder.load.waiting <= chosen.load.active + chosen.load.waiting:
        return PrefillPlan("aggregated")
    return PrefillPlan("peer_pull", holder.endpoint, uncached_tokens(deployment, ctx, chosen.endpoint.id))


def prefill_body(payload: dict) -> bytes:
    """The prefill leg: the same prompt, one token, no streaming, asking the engine to keep the KV for a pull."""
    body = {
        k: v
        for k, v in payload.items()
        if k not in ("stream", "stream_options", "max_completion_tokens", "n")
    }
    body.update(max_tokens=1, stream=False, kv_transfer_params=REMOTE_DECODE)
    return orjson.dumps(body)


def decode_body(payload: dict, kv_transfer_params: dict) -> bytes:
    """The decode leg: the client's own request, with the prefill leg's transfer parameters verbatim."""
    return orjson.dumps({**payload, "kv_transfer_params": kv_transfer_params})


# --- the legs ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Prefilled:
    """What the P/D step gives the decode engine's request: the body to send it, and the prefill engine's usage
    when another engine computed the prompt (the decode engine pulls its KV). `tried`: a leg ran, whatever came
    of it (a retry of the decode leg then recomputes rather than prefilling twice)."""

    body: bytes
    tried: bool = False
    usage: Usage | None = None

    @property
    def remotely(self) -> bool:
        return self.usage is not None


async def prefill_elsewhere(
    exchange: Exchange, decode: Candidate, candidates: list[Candidate], tried: bool
) -> Prefilled:
    """Run the prefill leg on another engine when the plan says so, on a route that may be disaggregated
    (routing/rendering/routes.py). `tried`: a leg already ran for this request."""
    request, services = exchange.request, exchange.services
    if not ROUTES[request.scope["path"]].disaggregated or tried:
        return Prefilled(request.body, tried)

    def prefill_choice():
        chosen, _ = services.pipeline.choose(request.deployment, request.ctx, services.loads, PREFILL_ROLES)
        return chosen

    plan = plan_disaggregated(request.deployment, request.ctx, decode, prefill_choice)
    if plan.kind == "aggregated":
        plan = plan_peer_pull(request.deployment, request.ctx, decode, candidates)
    metrics.of(metrics.plans, exchange.model, plan.kind).inc()
    if plan.prefill is None:
        return Prefilled(request.body)
    leg = await prefill_leg(exchange, plan.prefill)
    if leg is None:
        metrics.of(metrics.errors, exchange.model, "prefill_leg").inc()
        return Prefilled(request.body, tried=True)  # the decode engine prefills itself
    params, usage = leg
    return Prefilled(decode_body(request.payload, params), tried=True, usage=usage)


async def prefill_leg(exchange: Exchange, endpoint: EndpointInfo) -> tuple[dict, Usage] | None:
    """The prefill leg on `endpoint`: its `kv_transfer_params` for the decode engine and the leg's usage, or None
    when it failed (then the decode engine prefills itself). Counts in that engine's load and prefill backlog while
    it runs."""
    request, services = exchange.request, exchange.services
    load = services.loads.setdefault(endpoint.id, EndpointLoad())
    load.begin()
    lane = load.prefill_began(
        float(uncached_tokens(request.deployment, request.ctx, endpoint.id)), time.monotonic()
    )
    answered = False
    try:
        async with (
            asyncio.timeout(exchange.first_token_timeout),
            services.upstream.post(
                endpoint.url + request.scope["path"],
                prefill_body(request.payload),
                exchange.upstream_headers(),
            ) as resp,
        ):
            if resp.status != 200:
                await resp.read()
                return None
            answer = orjson.loads(await resp.read())
            answered = True  # the leg's one token: its prefill is over
    except (UpstreamError, TimeoutError, orjson.JSONDecodeError) as exc:
        log.info("prefill leg on %s failed (%s); the decode engine prefills itself", endpoint.name, exc)
        return None
    finally:
        load.end()
        load.prefill_ended(lane, time.monotonic(), answered)
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    return params, OPENAI.usage_from_body(answer)
