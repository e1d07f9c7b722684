"""The router's record of where it sent prompts (ApproximateIndex), held to its definition over random use: per
endpoint, the leading keys of a prompt it was sent (since a time, when asked), each endpoint keeping its most
recently sent keys up to its capacity."""

import random

import pytest

from routing.scheduling.affinity import ApproximateIndex

pytestmark = pytest.mark.unit


def by_definition(sent: dict[int, dict[str, float]], keys: list[str], since: float | None) -> dict[int, int]:
    held = {}
    for endpoint, times in sent.items():
        n = 0
        for key in keys:
            if key not in times or (since is not None and times[key] < since):
                break
            n += 1
        if n:
            held[endpoint] = n
    return held


@pytest.mark.parametrize("seed", range(6))
def test_lookups_and_evictions_match_the_definition_over_random_use(seed):
    rng = random.Random(seed)
    capacity = rng.choice([8, 30, 1000])
    index = ApproximateIndex(capacity)
    # Prompts share prefixes: each is a chain of keys through a small tree, as chained block hashes are.
    prompts = []
    for p in range(25):
        base = rng.choice(prompts) if prompts and rng.random() < 0.7 else []
        cut = rng.randrange(len(base) + 1) if base else 0
        prompts.append([*base[:cut], *(f"p{p}-{i}" for i in range(rng.randrange(1, 12)))])
    sent: dict[int, dict[str, float]] = {}  # endpoint -> key -> when last sent, in the order last sent
    for step in range(300):
        now = float(step)
        keys = rng.choice(prompts)
        if rng.random() < 0.5:
            endpoint = rng.randrange(5)
            index.record(endpoint, keys, now=now)
            times = sent.setdefault(endpoint, {})
            for key in keys:
                times.pop(key, None)
                times[key] = now
            while len(times) > capacity:
                del times[next(iter(times))]
        elif rng.random() < 0.1 and sent:
            endpoint = rng.choice(sorted(sent))
            index.forget(endpoint)
            del sent[endpoint]
        since = rng.choice([None, now - rng.randrange(1, 60)])
        probe = rng.choice(prompts)[: rng.randrange(1, 15)] + ([f"x{step}"] if rng.random() < 0.2 else [])
        expected = by_definition(sent, probe, since)
        assert index.lookup(probe, since=since) == expected, (step, probe, since)
        # Given counts already known, only the endpoints that pass them.
        known = {endpoint: rng.randrange(0, 8) for endpoint in range(5) if rng.random() < 0.6}
        passing = {e: n for e, n in expected.items() if n > known.get(e, 0)}
        assert index.lookup(probe, since=since, beyond=known) == passing, (step, probe, since, known)
    # The reverse map holds exactly the keys the endpoints hold.
    owners: dict[str, set[int]] = {}
    for endpoint, times in sent.items():
        for key in times:
            owners.setdefault(key, set()).add(endpoint)
    assert index._where == owners


def test_a_lookup_of_no_keys_or_an_unknown_first_key_finds_nothing():
    index = ApproximateIndex(10)
    index.record(1, ["a", "b"], now=1.0)
    assert index.lookup([]) == {}
    assert index.lookup(["z", "a"]) == {}
    assert index.lookup(["a", "b", "c"]) == {1: 2}
    assert index.lookup(["a", "b"], since=1) == {1: 2}  # an int time reads as the float it stands for
    assert index.lookup(["a", "b"], since=2) == {}
