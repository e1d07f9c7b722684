"""The engine API key: derived from the deployment id and the platform's secret, so the router needs no lookup."""

from __future__ import annotations

import re

from serving.engine_keys import engine_api_key


def test_it_is_a_stable_hex_hmac_per_deployment(settings):
    settings.ENGINE_KEY_SECRET = "one secret"
    key = engine_api_key(7)
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    assert engine_api_key(7) == key and engine_api_key("7") == key
    assert engine_api_key(8) != key
    settings.ENGINE_KEY_SECRET = "another secret"
    assert engine_api_key(7) != key


def test_without_a_dedicated_secret_it_comes_from_secret_key(settings):
    settings.SECRET_KEY = "the secret key"
    settings.ENGINE_KEY_SECRET = "the secret key"
    expected = engine_api_key(7)
    settings.ENGINE_KEY_SECRET = "something else"
    assert engine_api_key(7) != expected
    settings.ENGINE_KEY_SECRET = ""
    assert engine_api_key(7) == expected
    del settings.ENGINE_KEY_SECRET  # a settings module that does not define it at all
    assert engine_api_key(7) == expected
