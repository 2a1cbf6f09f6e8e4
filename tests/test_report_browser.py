"""The HTML report in a real browser: headless Chromium renders it from the one file, takes a
screenshot, and reports which images decoded. Skipped where no Chromium is installed (CI
installs Debian's `chromium`)."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image
from report_helpers import write_clean, write_profile

from bench.report.build import make_report

BROWSER = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (apt-get install chromium)")

# Appended to a copy of the page only: the report itself carries no script.
PROBE = """<script>
window.addEventListener("load", () => {
  const images = Array.from(document.images);
  const ok = images.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.setAttribute("data-images", ok + "/" + images.length);
});
</script>"""


def chromium(*args: str, home) -> subprocess.CompletedProcess:
    # --no-sandbox: CI and these machines run as root; a fresh profile dir per call keeps
    # runs independent; --virtual-time-budget lets the load event fire before the dump.
    command = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--mute-audio",
               f"--user-data-dir={home}", "--virtual-time-budget=5000", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


def rendered_dom(page, tmp_path) -> str:
    probe = tmp_path / f"probe-{page.stem}.html"
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    result = chromium("--dump-dom", probe.as_uri(), home=tmp_path / "profile-dom")
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def loaded_images(dom: str) -> tuple[int, int]:
    match = re.search(r'<body[^>]*data-images="(\d+)/(\d+)"', dom)
    assert match, "the page's load event never ran"
    return int(match[1]), int(match[2])


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("browser")
    write_clean(folder / "results")
    write_profile(folder / "results")
    make_report(folder / "results", folder / "plots")
    return folder / "plots" / "report.html"


def test_report_renders_in_chromium(report, tmp_path):
    dom = rendered_dom(report, tmp_path)
    ok, total = loaded_images(dom)
    assert total == 6 and ok == total  # every embedded figure decoded
    headings = re.findall(r"<h2[^>]*>(.*?)</h2>", dom)
    assert headings[:3] == ["Overall (all selected tasks pooled)", "Figures", "Per task"]
    assert "Missing and partial records" in headings and "Reported by the papers (not measured here)" in headings
    assert {"The papers' tables beside ours", "The papers' claims, checked here", "Training against serving"} \
        <= set(headings)
    assert dom.count("<table") >= 6 and "2.40x" in dom

    shot = tmp_path / "shot.png"
    result = chromium(f"--screenshot={shot}", "--window-size=1280,1800", report.as_uri(), home=tmp_path / "p2")
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=float)
    assert pixels.shape[:2] == (1800, 1280)
    assert pixels.std() > 20  # not a blank page
    # The first figure (coloured bars) sits in the first screen; tables and text are grey.
    saturation = pixels.max(axis=2) - pixels.min(axis=2)
    assert (saturation > 80).mean() > 0.02  # measured: 5% with the figures, 0.2% (links) without


def test_probe_notices_a_broken_image(report, tmp_path):
    """The check can fail: a page whose image data is corrupt reports it as not loaded."""
    broken = tmp_path / "broken.html"
    page = report.read_text(encoding="utf-8")
    broken.write_text(re.sub(r'(data:image/png;base64,)[^"]{40}', r"\1AAAA", page, count=1), encoding="utf-8")
    ok, total = loaded_images(rendered_dom(broken, tmp_path))
    assert total == 6 and ok == 5
