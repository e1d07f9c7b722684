"""Prefill/decode disaggregation and peer KV pulls, decided per request.

- P/D: in a deployment with prefill and decode pools, a request whose uncached prompt on the chosen decode
  endpoint reaches the policy's threshold is prefilled on a prefill endpoint (chosen by the same scorers over the
  prefill pool, so its prefix cache counts), then decoded on the decode endpoint, which pulls the KV blocks over
  NIXL with the `kv_transfer_params` the prefill leg returned. Below the threshold the decode endpoint does it all.
- Peer pull: among aggregated engines that both produce and consume KV (NIXL `kv_both`), when the engine holding
  the longest prefix is too busy and another was chosen, the holder runs the prefill leg (a cache hit there, so
  cheap) and the chosen engine pulls the blocks instead of recomputing them, when what it would recompute reaches
  the threshold.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from .pipeline import Candidate, RequestContext
from .state import DeploymentInfo, EndpointInfo

PREFILL_ROLES = ("prefill",)
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True)
class Plan:
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
) -> Plan:
    """Split when the decode endpoint would recompute at least the threshold; `prefill_choice()` picks the
    prefill endpoint with the prefill pool's scorers, or returns None when none is available."""
    if not ctx.prompt_tokens_estimate or not any(e.role in PREFILL_ROLES for e in deployment.endpoints):
        return Plan("aggregated")
    uncached = uncached_tokens(deployment, ctx, decode.endpoint.id)
    if uncached < deployment.policy.pd_split_threshold_tokens:
        return Plan("aggregated", uncached_tokens=uncached)
    prefill = prefill_choice()
    if prefill is None:
        return Plan("aggregated", uncached_tokens=uncached)
    return Plan("disaggregated", prefill.endpoint, uncached)


def plan_peer_pull(
    deployment: DeploymentInfo, ctx: RequestContext, chosen: Candidate, candidates: list[Candidate]
) -> Plan:
    """Pull from the longest-prefix holder when load moved the request elsewhere and pulling saves enough."""
    holders = set(ctx.held) | set(ctx.approx_held)
    if not chosen.endpoint.kv_both or not holders:
        return Plan("aggregated")
    by_id = {c.endpoint.id: c for c in candidates}
    holder_id = max(holders, key=lambda e: blocks_held(ctx, e))
    holder = by_id.get(holder_id)
    if holder is None or holder_id == chosen.endpoint.id or not holder.endpoint.kv_both:
        return Plan("aggregated")
    saved = (blocks_held(ctx, holder_id) - blocks_held(ctx, chosen.endpoint.id)) * deployment.block_size
    if saved < deployment.policy.pd_split_threshold_tokens:
        return Plan("aggregated")
    # Waiting for the holder is the other option: take it when the holder is not actually busier.
    if holder.load.active + holder.load.waiting <= chosen.load.active + chosen.load.waiting:
        return Plan("aggregated")
    return Plan("peer_pull", holder.endpoint, uncached_tokens(deployment, ctx, chosen.endpoint.id))


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
