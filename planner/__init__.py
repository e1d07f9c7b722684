"""A discrete-event fleet simulator: recorded traffic replayed in virtual time through the platform's own routing
pipeline onto simulated engines, for latency, cache reuse and cost before buying GPUs. See docs/planner.md."""
