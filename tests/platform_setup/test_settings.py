"""Production settings pass Django's deployment checks; missing secrets fail loudly."""

import os
import secrets
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "SECRET_KEY", "API_KEY_PEPPER")}
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def production_env() -> dict[str, str]:
    return {
        "DEBUG": "false",
        "SECRET_KEY": secrets.token_urlsafe(50),
        "API_KEY_PEPPER": secrets.token_urlsafe(32),
        "ALLOWED_HOSTS": "platform.example.com",
    }


def test_it_passes_check_deploy_with_production_settings():
    result = manage("check", "--deploy", "--fail-level", "WARNING", **production_env())
    assert result.returncode == 0, result.stdout + result.stderr


def test_it_refuses_to_start_without_a_secret_key_when_debug_is_off():
    env = production_env()
    del env["SECRET_KEY"]
    result = manage("check", **env)
    assert result.returncode != 0
    assert "Set SECRET_KEY" in result.stderr


def test_it_reads_secrets_from_files(tmp_path):
    env = production_env()
    (tmp_path / "pepper").write_text(env.pop("API_KEY_PEPPER"))
    result = manage(
        "check", "--deploy", "--fail-level", "WARNING", API_KEY_PEPPER_FILE=str(tmp_path / "pepper"), **env
    )
    assert result.returncode == 0, result.stderr


def test_it_says_what_to_do_without_a_database_url():
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "DATABASE_URL is not set" in result.stderr and "make run" in result.stderr
