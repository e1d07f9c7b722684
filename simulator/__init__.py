"""An engine simulator that speaks vLLM's interfaces: OpenAI-compatible HTTP, /metrics with vLLM's names,
KV-cache events in vLLM's msgpack-over-ZMQ format, and NIXL-style prefill/decode hand-off.

Start it with `python -m simulator --model DIR --port 8100 ...` (vLLM's flag names).
"""
