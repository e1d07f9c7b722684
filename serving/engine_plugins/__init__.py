"""Code that runs inside a vLLM engine process (from the engine's own environment, the repository root on its
PYTHONPATH): it imports vLLM and torch, never Django or the platform's apps."""
