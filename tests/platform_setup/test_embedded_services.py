"""With no DATABASE_URL or REDIS_URL, the dev stack starts a real PostgreSQL and Redis and stops them after."""

import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, os, psycopg, redis, dj_database_url
db = dj_database_url.parse(os.environ["DATABASE_URL"])
with psycopg.connect(host=db["HOST"], port=db["PORT"], user=db["USER"], dbname=db["NAME"]) as conn:
    version = conn.execute("SHOW server_version").fetchone()[0]
    data_dir = conn.execute("SHOW data_directory").fetchone()[0]
r = redis.Redis.from_url(os.environ["REDIS_URL"])
r.set("probe", "1")
print(json.dumps({"pg": version, "pgdata": data_dir, "redis": os.environ["REDIS_URL"], "ping": r.ping()}))
"""


def devstack_exec(code: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`python -m inference_platform.devstack exec -- python -c CODE`, as `make run` and `make test` use it."""
    return subprocess.run(
        [sys.executable, "-m", "inference_platform.devstack", "exec", "--", sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_it_starts_real_postgres_and_redis_and_stops_them_after():
    # Under the project (not /tmp/pytest-of-root, which the PostgreSQL system user cannot enter).
    state = ROOT / ".local" / f"test-embedded-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env["PLATFORM_STATE_DIR"] = str(state)
    try:
        result = devstack_exec(PROBE, env, timeout=180)
        assert result.returncode == 0, result.stderr
        seen = json.loads(result.stdout.strip().splitlines()[-1])
        assert seen["pg"].startswith("16") and seen["ping"] is True
        assert Path(seen["pgdata"]).resolve() == (state / "pgdata").resolve()
        # Both servers are gone once the command has finished.
        assert not (state / "pgdata" / "postmaster.pid").exists()
        port = int(seen["redis"].rsplit(":", 1)[1].split("/")[0])
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_it_passes_the_exit_code_of_the_command_through():
    env = {**os.environ, "DATABASE_URL": os.environ["DATABASE_URL"], "REDIS_URL": os.environ["REDIS_URL"]}
    result = devstack_exec("raise SystemExit(7)", env, timeout=60)
    assert result.returncode == 7


REMEMBER = """
import os, redis
r = redis.Redis.from_url(os.environ["REDIS_URL"])
print(r.get("counter"))
r.set("counter", "seen")
"""


def run_embedded_redis_twice(persist: str) -> list[str]:
    state = ROOT / ".local" / f"test-embedded-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the PostgreSQL in DATABASE_URL is kept
    env["PLATFORM_STATE_DIR"] = str(state)
    env["PLATFORM_REDIS_PERSIST"] = persist
    seen = []
    try:
        for _ in range(2):
            result = devstack_exec(REMEMBER, env, timeout=60)
            assert result.returncode == 0, result.stderr
            seen.append(result.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(state, ignore_errors=True)
    return seen


def test_a_throwaway_redis_starts_empty_on_every_run():
    # The test suite's Redis: the test database is made anew each run and its ids repeat, so nothing kept
    # under them (a team's spend this month, say) may survive into the next run.
    assert run_embedded_redis_twice("0") == ["None", "None"]


def test_the_platforms_own_redis_keeps_its_data_across_restarts():
    assert run_embedded_redis_twice("1") == ["None", "b'seen'"]
