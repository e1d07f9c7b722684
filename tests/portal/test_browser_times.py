"""In a browser, the portal's times read in the viewer's timezone, with UTC on hover (static/portal/figures.js)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from tests import costs

from .test_browser import CHROMIUM, server, sign_in  # noqa: F401  (server: a fixture)

pytestmark = pytest.mark.browser


def test_times_read_in_the_viewers_timezone_with_utc_on_hover(world, server):  # noqa: F811
    from playwright.sync_api import sync_playwright

    key = world.key_a1.api_key
    key.last_used_at = datetime(2026, 11, 30, 8, 5, 9, tzinfo=UTC)
    key.save(update_fields=["last_used_at"])
    with sync_playwright() as p:
        with costs.timed("Chromium"):
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        context = browser.new_context(timezone_id="Asia/Kolkata", locale="en-US")  # UTC+5:30, all year
        page = context.new_page()
        page.set_default_timeout(15_000)
        sign_in(page, server, "olive")
        page.goto(f"{server}/portal/teams/{world.team_a1.pk}/")
        used = page.locator('#keys time[datetime="2026-11-30T08:05:09Z"]')
        assert used.inner_text() == "2026-11-30 13:35 GMT+5:30"
        assert used.get_attribute("title") == "2026-11-30 08:05:09 UTC"
        context.close()
        browser.close()
