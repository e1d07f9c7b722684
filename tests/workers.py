"""A real Celery worker process for the tests that need one, on the test database."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from django.conf import settings

from tests.routing.conftest import database_url


@contextlib.contextmanager
def celery_worker_process(log_name: str, queues: list[str] | None = None) -> Iterator[Path]:
    """A solo-pool worker on `queues` (the default queue when None), its log in the state folder; stopped after."""
    from inference_platform.celery import app

    app.control.purge()
    log_file = Path(settings.STATE_DIR) / log_name
    argv = [sys.executable, "-m", "celery", "-A", "inference_platform", "worker", "--pool", "solo"]
    if queues:
        argv += ["-Q", ",".join(sorted(set(queues)))]
    argv += ["--without-heartbeat", "--without-gossip", "--without-mingle", "--loglevel", "INFO"]
    with log_file.open("wb") as log:
        worker = subprocess.Popen(
            argv,
            env={**os.environ, "DATABASE_URL": database_url()},
            cwd=settings.BASE_DIR,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield log_file
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
