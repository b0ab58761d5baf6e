"""The docs' diagrams render with no network: mermaid's bundle, vendored in docs/javascripts,
draws a diagram in a headless chromium from a file page (skips without a browser)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "docs" / "javascripts" / "mermaid.min.js"
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.mark.skipif(CHROMIUM is None or DRIVER is None, reason="no chromium/chromedriver")
def test_the_vendored_mermaid_renders_a_diagram_offline(tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    page = tmp_path / "diagram.html"
    page.write_text(
        f'<!doctype html><html><body><pre class="mermaid">graph LR\n  engine --> scheduler</pre>'
        f'<script src="{BUNDLE.as_uri()}"></script>'
        "<script>mermaid.initialize({startOnLoad: false});"
        "mermaid.run().then(() => document.body.dataset.done = 'yes')</script></body></html>"
    )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(DRIVER))
    try:
        driver.get(page.as_uri())
        WebDriverWait(driver, 30).until(
            lambda d: d.execute_script("return document.body.dataset.done") == "yes"
        )
        labels = driver.execute_script(
            "return [...document.querySelectorAll('pre.mermaid svg .nodeLabel')]"
            ".map(e => e.textContent)"
        )
        assert sorted(labels) == ["engine", "scheduler"]
    finally:
        driver.quit()
