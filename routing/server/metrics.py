"""The router's own Prometheus metrics. Labels: model, endpoint and status only, never a key."""

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, ProcessCollector

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)
ADDED_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)

registry = CollectorRegistry()
# The process's CPU and memory, and its garbage collections: objects the collector has to free are request
# objects caught in reference cycles, and each collection pauses every stream in flight.
ProcessCollector(registry=registry)
GCCollector(registry=registry)
requests = Counter(
    "router_requests",
    "Requests by model, endpoint and HTTP status.",
    ["model", "endpoint", "status"],
    registry=registry,
)
errors = Counter(
    "router_errors", "Requests that ended in an error, by kind.", ["model", "kind"], registry=registry
)
dropped_fields = Counter(
    "router_dropped_request_fields",
    "Request fields the public APIs do not define, dropped before the request reached an engine.",
    registry=registry,
)
ttft = Histogram(
    "router_time_to_first_token_seconds",
    "Time from request to the first byte of the answer.",
    ["model", "endpoint"],
    buckets=LATENCY_BUCKETS,
    registry=registry,
)
latency = Histogram(
    "router_request_latency_seconds",
    "Time from request to the end of the answer.",
    ["model", "endpoint"],
    buckets=LATENCY_BUCKETS,
    registry=registry,
)
added = Histogram(
    "router_added_latency_seconds",
    "Time the router adds before the request reaches an engine.",
    ["model"],
    buckets=ADDED_BUCKETS,
    registry=registry,
)
loop_lag = Histogram(
    "router_event_loop_lag_seconds",
    "How late the event loop ran a 20 ms probe timer (routing/server/loop_lag.py): what every request waited then.",
    buckets=ADDED_BUCKETS + (0.5, 1, 2.5),
    registry=registry,
)
loop_lag_worst = Gauge(
    "router_event_loop_lag_worst_seconds",
    "The largest event loop lag since the replica started.",
    registry=registry,
)
index_lookup = Histogram(
    "router_prefix_index_lookup_seconds",
    "Round trip of the precise prefix index lookup in Redis, one per request routed by it.",
    ["model"],
    buckets=ADDED_BUCKETS,
    registry=registry,
)
index_late_loop = Counter(
    "router_prefix_index_late_loop",
    "Precise lookups whose timeout fired late (the event loop was busy) and that were given one more period.",
    ["model"],
    registry=registry,
)
index_fallbacks = Counter(
    "router_prefix_index_fallbacks",
    "Precise lookups Redis did not answer in time (timeout) or at all (error), routed on the replica's own record.",
    ["model", "reason"],
    registry=registry,
)
index_vs_record = Counter(
    "router_prefix_index_vs_record",
    "Sampled precise decisions (ROUTER_DECISION_LOG_SAMPLE): whether the index (what the engines hold) and this "
    "replica's own record of what it sent agree on each endpoint's leading blocks of the prompt: same, "
    "engines_hold_more (other replicas' traffic), engines_hold_less (evicted, restarted), both.",
    ["model", "answer"],
    registry=registry,
)
tokens = Counter(
    "router_tokens",
    "Tokens by model, endpoint and kind (prompt, cached_prompt, output).",
    ["model", "endpoint", "kind"],
    registry=registry,
)
plans = Counter(
    "router_plans",
    "Routing plans by kind: aggregated, disaggregated (P/D) or peer_pull.",
    ["model", "kind"],
    registry=registry,
)
prefix_prompt_tokens = Counter(
    "router_prefix_prompt_tokens",
    "Prompt tokens of requests routed by prefix.",
    ["model", "endpoint"],
    registry=registry,
)
prefix_predicted_tokens = Counter(
    "router_prefix_predicted_cached_tokens",
    "Prompt tokens the router predicted the engine had cached.",
    ["model", "endpoint"],
    registry=registry,
)
prefix_reported_tokens = Counter(
    "router_prefix_reported_cached_tokens",
    "Prompt tokens the engine reported as cached.",
    ["model", "endpoint"],
    registry=registry,
)

render_failures = Counter(
    "router_prefix_render_failures",
    "Requests whose prompt the router could not render as the engine does, by reason; they are routed without "
    "prefix scores.",
    ["model", "reason"],
    registry=registry,
)
prediction_ratio = Gauge(
    "router_prefix_prediction_ratio",
    "Predicted over engine-reported cached prompt tokens across all router replicas over the last "
    "PREFIX_HEALTH_WINDOW_MINUTES (1.0 when routing sees what the engines hold; well below 1 when it is blind).",
    ["model"],
    registry=registry,
)


@functools.lru_cache(maxsize=8192)
def of(metric, *labels: str):
    """A metric's child for these label values, looked up once (labels() takes a lock and builds a tuple)."""
    return metric.labels(*labels)


# Flow control (routing/scheduling/flow.py): by model, priority class and tenant id.
flow_queued = Gauge(
    "router_flow_queued_requests",
    "Requests waiting in this router for a saturated deployment.",
    ["model", "priority_class", "tenant"],
    registry=registry,
)
flow_dispatched = Counter(
    "router_flow_dispatched",
    "Requests let through to the engines.",
    ["model", "priority_class", "tenant"],
    registry=registry,
)
flow_rejected = Counter(
    "router_flow_rejected",
    "Requests refused after waiting past their class's limit.",
    ["model", "priority_class", "tenant"],
    registry=registry,
)
flow_wait = Histogram(
    "router_flow_wait_seconds",
    "Time requests waited in this router for a saturated deployment (those that waited).",
    ["model", "priority_class"],
    buckets=LATENCY_BUCKETS,
    registry=registry,
)
flow_saturated = Gauge(
    "router_flow_saturated",
    "1 while the deployment is saturated, as this router sees it.",
    ["model"],
    registry=registry,
)
