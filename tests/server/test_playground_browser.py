"""The playground (GET /) and the API docs (GET /docs) in a real headless browser (Debian's
chromium through selenium's chromedriver): a message sent streams an answer that equals the
chat route's answer to the same conversation, the live figures update from /metrics, a
reasoning model's thinking is shown apart and collapsed, tool calls are shown, and the docs
page renders every route of /openapi.json. Skips where no browser can be found."""

from __future__ import annotations

import json
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
from selenium.webdriver.support.select import Select  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="no chromium/chromedriver (apt-get install chromium chromium-driver)",
)
SCREENSHOT = os.environ.get("PAGEDSERVE_PLAYGROUND_SCREENSHOT")  # where to save one (docs)


@pytest.fixture(scope="module")
def engine(roomy_engine):
    """Room for a conversation with tools listed in its system prompt."""
    return roomy_engine


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


QWEN3_LIKE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_server(engine):
    config = ServerConfig(reasoning_parser="qwen3", chat_template=QWEN3_LIKE)
    with uvicorn_in_thread(build_app(engine, config, MODEL)) as url:
        yield url


def _ask(browser, url: str, question: str, **settings):
    browser.get(url + "/")
    WebDriverWait(browser, 30).until(
        lambda b: b.find_element(By.ID, "model").get_attribute("value") == MODEL
    )
    for element_id, value in settings.items():
        set_value(browser, element_id.replace("_", "-"), value)
    return _ask_here(browser, question)


def test_the_thinking_is_shown_apart_and_collapsed(browser, thinking_server):
    """The tiny model never closes its thinking: the whole reply goes to the collapsed
    Thinking section, and it is the API's reasoning_content for the same conversation."""
    turn = _ask(browser, thinking_server, "Is 221 prime?", max_tokens="16")
    system = browser.find_element(By.ID, "system").get_attribute("value")
    expected = httpx.post(
        thinking_server + "/v1/chat/completions",
        json={
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": "Is 221 prime?"},
            ],
            "temperature": 0,
            "top_p": 1,
            "max_tokens": 16,
        },
        timeout=60,
    ).json()["choices"][0]["message"]
    details = turn.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert details.get_attribute("open") is None  # collapsed
    shown = browser.execute_script(
        "return arguments[0].querySelector('.reasoning-text').textContent", turn
    )
    assert shown == expected["reasoning_content"] and shown
    assert turn.find_element(By.CSS_SELECTOR, ".answer").text == ""


def test_tool_calls_are_shown(browser, served):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    tools[0]["function"]["parameters"] = {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
    }
    browser.get(served + "/")
    WebDriverWait(browser, 30).until(
        lambda b: b.find_element(By.ID, "model").get_attribute("value") == MODEL
    )
    Select(browser.find_element(By.ID, "tool-choice")).select_by_visible_text("required")
    set_value(browser, "tools", json.dumps(tools))
    turn = _ask_here(browser, "What time is it?")
    system = browser.find_element(By.ID, "system").get_attribute("value")
    expected = httpx.post(
        served + "/v1/chat/completions",
        json={
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": "What time is it?"},
            ],
            "tools": tools,
            "tool_choice": "required",
            "temperature": 0,
            "top_p": 1,
            "max_tokens": 128,
        },
        timeout=60,
    ).json()["choices"][0]["message"]["tool_calls"]
    shown = [e.text for e in turn.find_elements(By.CSS_SELECTOR, "pre.tool-call")]
    assert shown == [f"{c['function']['name']}({c['function']['arguments']})" for c in expected]


def _ask_here(browser, question: str):
    set_value(browser, "temperature", "0")
    browser.find_element(By.ID, "message").send_keys(question)
    browser.find_element(By.ID, "send").click()
    return WebDriverWait(browser, 30).until(
        lambda b: b.find_element(By.CSS_SELECTOR, ".turn.assistant[data-done='true']")
    )


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory):
    """A server on a tiny LLaVA, and a PNG on disk for the page's file input."""
    import asyncio

    from PIL import Image

    from pagedserve.models.testing_multimodal import make_tiny_llava_checkpoint, tiny_test_images
    from pagedserve.server.testing import make_engine

    folder = tmp_path_factory.mktemp("llava")
    engine = make_engine(str(make_tiny_llava_checkpoint(folder / "model")), dtype="float32")
    picture = folder / "picture.png"
    Image.Image.save(tiny_test_images()[1], picture)
    with uvicorn_in_thread(build_app(engine, ServerConfig(), MODEL)) as url:
        yield url, picture
    asyncio.run(engine.shutdown())


def test_an_attached_image_goes_with_the_message(browser, llava_server):
    """The page sends the attached file as an image_url part: its answer is the chat route's
    for the same conversation with that image, and the figures count the image encoded."""
    import base64

    url, picture = llava_server
    browser.get(url + "/")
    WebDriverWait(browser, 30).until(
        lambda b: b.find_element(By.ID, "model").get_attribute("value") == MODEL
    )
    set_value(browser, "max-tokens", "12")
    browser.find_element(By.ID, "image").send_keys(str(picture))
    turn = _ask_here(browser, "What is in the picture?")
    assert (
        browser.find_element(By.CSS_SELECTOR, ".turn.user img")
        .get_attribute("src")
        .startswith("data:image/png;base64,")
    )
    system = browser.find_element(By.ID, "system").get_attribute("value")
    image_url = "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode()
    question = [
        {"type": "text", "text": "What is in the picture?"},
        {"type": "image_url", "image_url": {"url": image_url}},
    ]
    expected = httpx.post(
        url + "/v1/chat/completions",
        json={
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "temperature": 0,
            "top_p": 1,
            "max_tokens": 12,
        },
        timeout=60,
    ).json()["choices"][0]["message"]["content"]
    assert turn.find_element(By.CSS_SELECTOR, ".answer").text == expected.strip() != ""
    assert "error" not in turn.get_attribute("class")
    WebDriverWait(browser, 10).until(
        lambda b: b.find_element(By.ID, "images").text.split(" / ")[0] == "1"
    )
