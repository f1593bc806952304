"""The dashboard in a real headless Chromium against a running mesh and mock fleet."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=6000", "--window-size=1280,900"]


def test_dashboard_shows_the_fleet(proc_pd, tmp_path):
    assert CHROMIUM, "chromium is not installed: `make test` installs Debian's chromium"
    for i in range(5):  # some traffic, so the numbers move
        httpx.post(proc_pd["url"] + "/v1/completions", json={"model": "mock-model", "prompt": f"dash {i}",
                                                              "max_tokens": 4})
    page = httpx.get(proc_pd["url"] + "/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "http" not in page.text.split("<script>")[1].replace("http-equiv", "")  # nothing from elsewhere
    profile = tmp_path / "profile"
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", proc_pd["url"] + "/dashboard"],
                         capture_output=True, text=True, timeout=90)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    ids = [w["id"] for w in httpx.get(proc_pd["url"] + "/workers").json()["workers"]]
    assert len(ids) == 4
    for wid in ids:
        assert f"<td>{wid}</td>" in html, f"{wid} not on the page"
    assert "healthy" in html and "PD mode" in html
    shot = tmp_path / "dashboard.png"
    r = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", f"--screenshot={shot}",
                        proc_pd["url"] + "/dashboard"], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0 and shot.stat().st_size > 5000
    keep = Path(__file__).resolve().parent.parent / "docs" / "dashboard.png"
    if not keep.exists():  # the screenshot kept in docs/ was made by this test
        shutil.copy(shot, keep)
