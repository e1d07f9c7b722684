"""The soak's look inside the router's memory (bench/soak.py --trace-memory), loaded by Python at start-up from
PYTHONPATH. It does nothing unless SOAK_MEMWATCH_DIR is set and this process is the router (uvicorn) or one of
its tokenizing workers; then it starts tracemalloc (one frame) and, every SOAK_MEMWATCH_EVERY seconds, appends to
SOAK_MEMWATCH_DIR/router.jsonl (router-worker-<pid>.jsonl in a worker):
the memory Python's allocators trace, the 300 source lines holding most of it, and what each of the router's
bounded caches holds against its bound (entries, and bytes estimated from a sample of its entries). The router's
code is not changed for it; the caches are found by their class names among the live objects."""

from __future__ import annotations

import os
import sys

WATCH_DIR = os.environ.get("SOAK_MEMWATCH_DIR")


def _size_of_items(items, sample: int = 2000) -> tuple[int, float]:
    """(entries, estimated bytes) of a mapping's items: keys and values measured on a sample, scaled."""
    n = len(items)
    if not n:
        return 0, 0.0
    step = max(1, n // sample)
    chosen = list(items.items())[::step][:sample]
    measured = sum(_deep(key) + _deep(value) for key, value in chosen)
    return n, measured / len(chosen) * n + sys.getsizeof(items)


def _deep(value, budget: int = 200_000) -> int:
    """Bytes of a value and of everything it refers to (not classes, modules or functions), up to `budget`
    objects."""
    import gc
    import types

    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    seen: set[int] = set()
    todo = [value]
    size = 0
    while todo and len(seen) < budget:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        size += sys.getsizeof(obj)
        todo.extend(gc.get_referents(obj))
    return size


CACHES = {
    "SegmentCache",
    "PromptKeyCache",
    "ApproximateIndex",
    "SessionMap",
    "RouterTokenizer",
    "Conversations",
    "Finisher",
}


def _find(wanted: set[str], depth: int = 10) -> list:
    """Instances of the `wanted` classes reachable from the router's modules, by their references. Not
    gc.get_objects(): the router freezes what it built at start-up (gc.freeze), which hides it from that."""
    import gc
    import types

    roots = [m for name, m in list(sys.modules.items()) if name.startswith(("routing", "inference_platform"))]
    module_dicts = {id(vars(m)) for m in list(sys.modules.values()) if m is not None}
    seen: set[int] = set()
    found = []
    layer = [vars(m) for m in roots]
    for _ in range(depth):
        following = []
        for obj in layer:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if type(obj).__name__ in wanted:
                found.append(obj)
                continue
            if (
                isinstance(obj, (str, bytes, int, float, type, types.ModuleType))
                or type(obj).__name__ == "array"
            ):
                continue
            if isinstance(obj, (dict, list, tuple, set)) and len(obj) > 10_000:
                continue  # a cache's own items, or data: what is wanted is not in there
            for ref in gc.get_referents(obj):
                if id(ref) not in seen and not (isinstance(ref, dict) and id(ref) in module_dicts):
                    following.append(ref)
        layer = following
        if not layer:
            break
    return found


def _caches() -> list[dict]:
    """The router's bounded caches, found by class name (`_find`)."""
    out = []
    for obj in _find(CACHES):
        kind = type(obj).__name__
        try:
            if kind == "SegmentCache":
                entries, size = _size_of_items(obj._items)
                bound = f"{obj._size:,} of {obj.max_tokens:,} token ids"
            elif kind == "PromptKeyCache":
                entries, size = _size_of_items(obj._groups, sample=200)
                bound = f"{obj._bytes:,} of {obj.max_bytes:,} prompt bytes"
            elif kind == "ApproximateIndex":
                entries = sum(len(lru) for lru in obj._lru.values())
                size = sum(_size_of_items(lru)[1] for lru in obj._lru.values())
                size += _size_of_items(getattr(obj, "_where", {}))[1]
                bound = f"{obj.capacity:,} blocks per endpoint"
            elif kind == "SessionMap":
                entries, size = _size_of_items(obj._items)
                bound = f"{obj.max_sessions:,} sessions, {obj.ttl_s:g} s each"
            elif kind == "RouterTokenizer":
                entries, size = _size_of_items(obj._recent, sample=200)
                bound = f"{obj._recent_chars:,} characters of recent prompts"
            elif kind == "Conversations":
                conversations = [c for group in obj._groups.values() for c in group]
                entries = len(conversations)
                chosen = conversations[:: max(1, entries // 50)][:50]
                size = sum(_deep(c) for c in chosen) / len(chosen) * entries if chosen else 0.0
                bound = (
                    f"{obj._chars:,} of {obj.max_chars:,} characters, {len(obj._groups):,} of "
                    f"{obj.max_groups:,} groups"
                )
            elif kind == "Finisher":
                entries, size = len(obj._recent), sum(sys.getsizeof(e) for _, e in obj._recent)
                bound = "the usage events of the last 120 s"
            else:
                continue
        except Exception as exc:  # noqa: BLE001 - a cache whose shape changed is reported, not fatal
            out.append({"cache": kind, "error": repr(exc)})
            continue
        out.append({"cache": kind, "entries": entries, "mb": round(size / 2**20, 2), "bound": bound})
    return out


def _watch(every: float, name: str) -> None:
    import json
    import time
    import tracemalloc
    from pathlib import Path

    path = Path(WATCH_DIR) / f"{name}.jsonl"
    started = time.monotonic()
    while True:
        time.sleep(every)
        snapshot = tracemalloc.take_snapshot()
        top = snapshot.statistics("lineno")[:300]
        current, peak = tracemalloc.get_traced_memory()
        row = {
            "t": round(time.monotonic() - started, 1),
            "wall": time.time(),
            "traced_mb": round(current / 2**20, 2),
            "peak_mb": round(peak / 2**20, 2),
            "lines": {str(s.traceback[0]): [s.size, s.count] for s in top},
            "caches": _caches(),
        }
        with path.open("a") as out:
            out.write(json.dumps(row) + "\n")


def _start(name: str) -> None:
    import threading
    import tracemalloc

    tracemalloc.start(1)
    every = float(os.environ.get("SOAK_MEMWATCH_EVERY", "60"))
    threading.Thread(target=_watch, args=(every, name), daemon=True, name="soak-memwatch").start()


def _name() -> str | None:
    """router for the router's process, router-worker-<pid> for its tokenizing workers (multiprocessing's spawn:
    the router's environment reaches only them), else None."""
    argv = " ".join(getattr(sys, "orig_argv", []))
    if "uvicorn" in argv:
        return "router"
    if "spawn_main" in argv:
        return f"router-worker-{os.getpid()}"
    return None


if WATCH_DIR and _name():
    _start(_name())
