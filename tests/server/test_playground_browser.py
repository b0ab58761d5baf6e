"""The playground (GET /) and the API docs (GET /docs) in a real headless browser (Debian's
chromium through selenium's chromedriver): a message sent streams an answer that equals the
chat route's answer to the same conversation, the live figures update from /metrics, and the
docs page renders every route of /openapi.json. Skips where no browser can be found."""

from __future__ import annotations

import os
import shutil
import time

import httpx
import pytest

from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL
from pagedserve.server.testing import uvicorn_in_thread

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="no chromium/chromedriver (apt-get install chromium chromium-driver)",
)
SCREENSHOT = os.environ.get("PAGEDSERVE_PLAYGROUND_SCREENSHOT")  # where to save one (docs)


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.add_argument("--window-size=1200,800")
    service = webdriver.ChromeService(executable_path=DRIVER)
    driver = webdriver.Chrome(options=options, service=service)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def served(engine):
    with uvicorn_in_thread(build_app(engine, ServerConfig(), MODEL)) as url:
        yield url


def set_value(browser, element_id: str, value: str) -> None:
    field = browser.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def _paced(engine, monkeypatch, seconds: float = 0.005) -> None:
    """Each engine step at least ``seconds`` long. The tiny model's step takes well under a
    millisecond on CPU, faster than a browser takes in a streamed chunk, and an answer whose
    tokens all exist before the first chunk is read arrives merged into one write; paced like a
    real model, the test sees what streaming does with tokens that arrive over time."""
    step = engine.engine.step

    def paced_step():
        start = time.perf_counter()
        outputs = step()
        time.sleep(max(0.0, seconds - (time.perf_counter() - start)))
        return outputs

    monkeypatch.setattr(engine.engine, "step", paced_step)


def test_a_message_streams_the_chat_answer_and_figures_update(browser, served, engine, monkeypatch):
    _paced(engine, monkeypatch)
    browser.get(served + "/")
    wait = WebDriverWait(browser, 30)
    wait.until(lambda b: b.find_element(By.ID, "model").get_attribute("value") == MODEL)
    set_value(browser, "temperature", "0")
    set_value(browser, "max-tokens", "24")
    system = browser.find_element(By.ID, "system").get_attribute("value")
    # count the text changes of the answer as they happen: a streamed answer changes often
    browser.execute_script(
        "window.updates = 0; new MutationObserver(() => window.updates++)"
        ".observe(document.getElementById('conversation'),"
        " {subtree: true, childList: true, characterData: true});"
    )
    figures_before = int(browser.find_element(By.TAG_NAME, "body").get_attribute("data-figures"))
    browser.find_element(By.ID, "message").send_keys("What is a KV cache?")
    browser.find_element(By.ID, "send").click()
    answer = wait.until(
        lambda b: b.find_element(By.CSS_SELECTOR, ".turn.assistant[data-done='true']")
    )
    expected = httpx.post(
        served + "/v1/chat/completions",
        json={
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": "What is a KV cache?"},
            ],
            "temperature": 0,
            "top_p": 1,
            "max_tokens": 24,
        },
        timeout=60,
    ).json()["choices"][0]["message"]["content"]
    assert answer.text == expected.strip() and expected  # innerText drops edge whitespace
    assert "error" not in answer.get_attribute("class")
    assert browser.execute_script("return window.updates") > 3  # streamed, not one write
    assert browser.find_element(By.ID, "ttft").text.endswith(" s")
    wait.until(
        lambda b: (
            int(b.find_element(By.TAG_NAME, "body").get_attribute("data-figures"))
            > figures_before + 1
        )
    )
    generated = browser.find_element(By.ID, "generated").text
    assert generated.isdigit() and int(generated) >= 24
    assert browser.find_element(By.ID, "kv-cache").text.endswith("%")
    if SCREENSHOT:
        browser.save_screenshot(SCREENSHOT)


def test_the_docs_page_renders_every_route(browser, served):
    browser.get(served + "/docs")
    WebDriverWait(browser, 30).until(
        lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-rendered") == "true"
    )
    spec = httpx.get(served + "/openapi.json").json()
    shown = {e.text for e in browser.find_elements(By.CSS_SELECTOR, "#toc a")}
    wanted = {f"{m.upper()} {path}" for path, methods in spec["paths"].items() for m in methods}
    assert shown == wanted
    schemas = browser.find_elements(By.CSS_SELECTOR, "#schemas .schema")
    assert len(schemas) == len(spec["components"]["schemas"])
