"""The status page on the metrics port, rendered by a real headless browser (Debian's chromium)
against a live server with two stalled trainers: its DOM shows each trainer's stall and stage;
`/status.json` holds the same snapshot, and `/` still answers scrapers with the metrics."""

from __future__ import annotations

import html.parser
import json
import os
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator

import pytest

from remote_loader.server.api.server import Server
from tests import stalls

# Set by .ci/run, which installs chromium: there a missing browser fails the test, not skips it.
REQUIRE_ENV = "REMOTE_LOADER_REQUIRE_CHROMIUM"
BROWSER_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path is not None:
            return path
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{REQUIRE_ENV} is set but no chromium is installed (apt-get install chromium)")
    pytest.skip("needs a headless chromium (Debian: apt-get install -y chromium)")


def browse(url: str, *flags: str) -> str:
    """What chromium makes of `url` after 5 s of virtual time (with --dump-dom: the DOM)."""
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run(
            [
                chromium(),
                *BROWSER_FLAGS,
                f"--user-data-dir={profile}",
                "--virtual-time-budget=5000",
                *flags,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=90,
        )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


class Rows(html.parser.HTMLParser):
    """The page's consumer rows: their data- attributes and the text of their stall cell."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self._in_stall = False
        self.plots = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {k: v or "" for k, v in attrs}
        if tag == "tr" and found.get("class") == "consumer":
            self.rows.append(found)
        self._in_stall = tag == "td" and found.get("class") == "stall"
        self.plots += tag == "polyline"

    def handle_data(self, data: str) -> None:
        if self._in_stall and self.rows:
            self.rows[-1]["stall_text"] = data
            self._in_stall = False


@pytest.fixture(scope="module")
def stalled_job() -> Iterator[Server]:
    with stalls.stalled_job() as server:
        yield server


@pytest.mark.timeout(120)
def test_the_page_in_a_headless_browser_shows_each_trainers_stall(stalled_job: Server) -> None:
    chromium()  # skips (or fails under .ci/run) before anything else
    dom = browse(f"http://127.0.0.1:{stalled_job.metrics_port}/", "--dump-dom")
    rows = Rows()
    rows.feed(dom)
    by_rank = {row["data-rank"]: row for row in rows.rows if row.get("data-job") == "train"}
    assert set(by_rank) == {"0", "1"}, dom[-3000:]
    for row in by_rank.values():
        assert float(row["data-stall"]) > 0.5 and row["data-stage"] == "workers", row
        assert row["stall_text"].endswith("%") and int(row["stall_text"][:-1]) > 50, row
    assert rows.plots >= 4  # each trainer's stall and rate over the last minute, as SVG


@pytest.mark.timeout(60)
def test_the_port_serves_the_snapshot_the_page_and_still_the_metrics(
    stalled_job: Server,
) -> None:
    base = f"http://127.0.0.1:{stalled_job.metrics_port}"
    with urllib.request.urlopen(f"{base}/status.json", timeout=10) as reply:
        snapshot = json.load(reply)
    (loader,) = snapshot["loaders"]
    stalls = {c["consumer"]["rank"]: c["wait_fraction"] for c in loader["consumers"]}
    assert set(stalls) == {0, 1} and min(stalls.values()) > 0.5
    with urllib.request.urlopen(base + "/", timeout=10) as reply:  # a scraper, curl
        assert b"remote_loader_consumer_stall{" in reply.read()
    browser = urllib.request.Request(base + "/", headers={"Accept": "text/html,*/*;q=0.8"})
    with urllib.request.urlopen(browser, timeout=10) as reply:
        page = reply.read()
        assert page.startswith(b"<!DOCTYPE html>") and b"/status.json" in page
        assert "default-src 'none'" in reply.headers["Content-Security-Policy"]
