"""The web page at `/`, in a real browser: Debian's headless Chromium, driven by Playwright.

Playwright rather than Selenium: one wheel from PyPI carries its driver, pointed at the system
browser with `executable_path` (its own browser download is never used), so Debian's chromium is
the only system package; it reports console messages and page errors as events and waits on
locators, so the tests assert on what the page shows without sleeps. One server for the module:
2 HTTP workers, room for one more frontend, an API key. Screenshots go to each test's tmp dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from fastapi.testclient import TestClient

from tests import conftest  # pytest's own instance (tests/ is a package: pytest imports it as tests.conftest)
from tests.serving import Server, serve
from tests.utils import wait_until
from unison import Engine
from unison.cli import build_parser, main
from unison.server.app import UI_DIR, create_app
from unison.server.settings import ServeSettings, WorkerSettings
from unison.wire.messages import ServerInfo

KEY = "sk-unison-ui"
MODEL = "SmolLM2-135M-Instruct"
CHROMIUM = "/usr/bin/chromium"
# This machine's network is closed: without these Chromium keeps trying to reach its services.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WIDE, NARROW = {"width": 1180, "height": 900}, {"width": 380, "height": 720}
LAST_REPLY = "#messages .msg.assistant >> nth=-1"
STATS = re.compile(r"^TTFT \d+ ms · [\d.]+ tok/s · \d+ tokens · (\d+) cached")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve("web page", "--extra-frontends", "1", workers=2, api_key=KEY)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Chromium for the module, with a fresh profile (Playwright makes one per launch). Its
    processes carry a mark: renderers come and go with pages, so they are counted once the
    browser has closed, by the module's leak check, not per test."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="Playwright is not installed: pip install -e '.[test]'")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no browser at {CHROMIUM}: `make test` installs Debian's chromium when run as "
                    "root (apt-get install chromium)")
    mark = str(tmp_path_factory.mktemp("chromium"))
    conftest.MODULE_TREES.add(mark)
    try:
        with sync_api.sync_playwright() as playwright:
            chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS,
                                                  env={**os.environ, "UNISON_TEST_MODULE_TREE": mark})
            yield chromium
            chromium.close()
        wait_until(lambda: not _marked(mark), 10, "every Chromium process to exit")
    finally:
        for pid in _marked(mark):  # after a failure: leave nothing for the next module
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        conftest.MODULE_TREES.discard(mark)


def _marked(mark: str) -> list[int]:
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get("UNISON_TEST_MODULE_TREE") == mark:
                found.append(p.pid)
    return found


class Tab:
    """One page in a fresh browser context, with every console error and page error it logs."""

    def __init__(self, browser, server: Server, key: str | None = KEY, viewport: dict = WIDE) -> None:
        self.context = browser.new_context(viewport=viewport)
        if key:  # as if entered earlier in this tab: the page keeps it in sessionStorage
            self.context.add_init_script(f"sessionStorage.setItem('unison.apiKey', {json.dumps(key)})")
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.url = server.url

    def open(self, view: str = "chat") -> None:
        self.page.goto(f"{self.url}/#{view}")
        if view == "chat":  # the page has asked /v1/models and is ready to send
            expect(self.page.locator("#model option")).to_have_text([MODEL])

    def ask(self, text: str, temperature: float = 0, max_tokens: int = 40) -> None:
        self.page.fill("#temperature", str(temperature))
        self.page.fill("#max-tokens", str(max_tokens))
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")

    def screenshot(self, path: Path) -> None:
        self.page.screenshot(path=path)
        assert path.stat().st_size > 10_000, path


@pytest.fixture
def tab(browser, server) -> Iterator[Tab]:
    tab = Tab(browser, server)
    yield tab
    tab.context.close()


def expect(locator):
    from playwright.sync_api import expect

    return expect(locator)


# ---- without a browser ------------------------------------------------------------------------


def test_static_files_open_api_keyed_and_disable_ui():
    """The page's files need no key (they hold no data); the API does; --disable-ui removes them."""
    settings = WorkerSettings(ServeSettings(api_key=KEY), MODEL, registry_path="", owner_pid=0)
    client = TestClient(create_app(settings))  # no lifespan: nothing attaches to a core
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name in re.findall(r'(?:src|href)="/ui/([\w.]+)"', page.text):
        assert client.get(f"/ui/{name}").status_code == 200, name
    script = client.get("/ui/main.js")
    assert "javascript" in script.headers["content-type"] and "import" in script.text
    assert client.get("/v1/models").status_code == 401
    assert client.get("/ui/none.js").status_code == 404

    no_ui = WorkerSettings(ServeSettings(disable_ui=True), MODEL, registry_path="", owner_pid=0)
    off = TestClient(create_app(no_ui))
    assert off.get("/").status_code == 404 and off.get("/ui/main.js").status_code == 404
    assert build_parser().parse_args(["serve", "--no-webui"]).disable_ui
    assert build_parser().parse_args(["serve", "--disable-ui"]).disable_ui
    assert not build_parser().parse_args(["serve"]).disable_ui
    assert main(["serve", "--extra-frontends", "-1"]) == 2


# ---- in the browser ---------------------------------------------------------------------------


def test_ready_message_names_the_page(server):
    wait_until(lambda: f"Chat and watch the engine at {server.url}/" in server.output(), 10,
               "the ready message with the page's address")


def test_engine_view_reads_the_fields_server_info_names(server):
    """The page reads /get_server_info by the names ServerInfo's JSON has (replicas: data parallel
    only; models: several models); the launcher and the benchmarks read the same JSON back as the
    struct."""
    info = server.server_info()
    page = "".join(p.read_text() for p in (UI_DIR).glob("*.js"))
    read = set(re.findall(r"\binfo\.([a-z_]+)", page)) - {"replicas", "models"}
    assert read and read <= set(info), sorted(read - set(info))
    typed = ServerInfo.from_dict(info)
    assert typed.core_pid == info["core_pid"] and typed.core.weights == info["weights"]
    assert len(typed.frontends) == len(info["frontends"]) >= 1


def test_api_key_is_asked_once_and_a_wrong_one_shows_the_401(browser, server):
    tab = Tab(browser, server, key=None)
    try:
        tab.page.goto(server.url)
        dialog = tab.page.locator("#key-dialog")
        expect(dialog).to_be_visible()
        expect(tab.page.locator("#key-error")).to_contain_text("missing or invalid API key")
        tab.page.fill("#key", "not-the-key")
        tab.page.press("#key", "Enter")
        expect(tab.page.locator("#key-error")).to_have_text(
            re.compile("^The server refused this key: missing or invalid API key"))
        expect(dialog).to_be_visible()
        tab.page.fill("#key", KEY)
        tab.page.press("#key", "Enter")
        expect(dialog).to_be_hidden()
        expect(tab.page.locator("#model option")).to_have_text([MODEL])
        assert tab.page.evaluate("sessionStorage.getItem('unison.apiKey')") == KEY
        tab.page.reload()  # kept for the tab: not asked again
        expect(tab.page.locator("#model option")).to_have_text([MODEL])
        expect(dialog).to_be_hidden()
        # The browser logs each refused call; nothing else may be an error.
        assert all("401" in e for e in tab.errors), tab.errors
    finally:
        tab.context.close()


def test_chat_streams_a_reply_with_its_figures(tab, server, tmp_path):
    tab.open()
    prompt = tab.page.locator("#prompt")
    prompt.fill("a")
    prompt.press("Shift+Enter")  # a new line, nothing sent
    assert prompt.input_value() == "a\n" and tab.page.locator(".msg").count() == 0
    # Record the reply's text each time it changes, to see it grow while it streams.
    tab.page.evaluate("""() => {
        window.lengths = [];
        new MutationObserver(() => {
            const reply = document.querySelector('#messages .msg.assistant:last-child .content');
            if (reply) window.lengths.push(reply.textContent.length);
        }).observe(document.getElementById('messages'),
                   {subtree: true, childList: true, characterData: true});
    }""")
    tab.ask("What is the capital of France?")
    reply = tab.page.locator(LAST_REPLY)
    expect(reply).to_have_attribute("data-state", "done", timeout=30_000)
    lengths = [n for n in tab.page.evaluate("window.lengths") if n > 0]
    assert len(set(lengths)) >= 2 and lengths == sorted(lengths), lengths
    assert "Paris" in reply.locator(".content").inner_text()
    assert STATS.match(reply.locator(".stats").inner_text()), reply.locator(".stats").inner_text()
    expect(tab.page.locator("#send")).to_be_visible()
    tab.screenshot(tmp_path / "chat.png")

    # Regenerate: the same conversation again, now mostly from the prefix cache.
    tab.page.click("#regenerate")
    expect(tab.page.locator("#messages .msg.assistant")).to_have_count(1)
    expect(reply).to_have_attribute("data-state", "done", timeout=30_000)
    cached = STATS.match(reply.locator(".stats").inner_text())
    assert cached and int(cached[1]) > 0, reply.locator(".stats").inner_text()

    tab.page.click("#new-chat")
    expect(tab.page.locator(".msg")).to_have_count(0)
    assert not tab.errors, tab.errors


def test_server_errors_show_the_servers_message(tab):
    tab.open()
    tab.page.fill("#top-p", "7")
    tab.ask("Hi")
    error = tab.page.locator(LAST_REPLY).locator(".error")
    expect(error).to_contain_text("top_p")  # the 400's message, naming the field
    expect(tab.page.locator(LAST_REPLY)).to_have_attribute("data-state", "error")


def test_code_blocks_are_shown_as_code(tab):
    tab.open()
    html = tab.page.evaluate("""async () => {
        const { render } = await import('/ui/chat.js');
        const node = document.createElement('div');
        render(node, 'Run <b>this</b>:\\n```python\\nprint(1 < 2)\\n```\\nthen `x`, and\\n```sh\\nls');
        return node.innerHTML;
    }""")
    assert '<pre><code data-lang="python">print(1 &lt; 2)\n</code></pre>' in html
    assert "<code>x</code>" in html and "&lt;b&gt;this&lt;/b&gt;" in html
    assert html.endswith('<pre><code data-lang="sh">ls</code></pre>')  # still open: code so far


def test_stop_ends_a_long_reply_and_the_engine_frees_it(tab, server):
    tab.open()
    # A prompt whose greedy reply runs to max_tokens (about 12 s): "Count from 1 to 1000" ends
    # by itself after 122 tokens, under a second, and a stop clicked later than that raced it.
    tab.ask("Write a table of the squares of the numbers from 1 to 500.", max_tokens=1500)
    reply = tab.page.locator(LAST_REPLY)
    expect(reply.locator(".content")).to_contain_text("10")
    server.wait_running(1)
    # The composer's buttons move while the reply grows the list: a click that waits for them to
    # stand still can outlast the reply on a slow machine. The press itself is what is tested.
    expect(tab.page.locator("#stop")).to_be_visible()
    tab.page.locator("#stop").dispatch_event("click")
    expect(reply).to_have_attribute("data-state", "stopped")
    expect(reply.locator(".stats")).to_contain_text("stopped")
    server.wait_freed(timeout=5)
    tab.page.click("#tab-engine")
    expect(tab.page.locator("#load dd").first).to_have_text("0")  # running
    assert not tab.errors, tab.errors


def test_engine_view_follows_frontends_and_controls(tab, server, tmp_path):
    tab.open("engine")
    rows = tab.page.locator("#frontends tbody tr")
    expect(rows).to_have_count(2)
    expect(rows.locator("td:nth-child(4)")).to_have_text(["local (IPC)"] * 2)
    expect(tab.page.locator("#core")).to_contain_text(str(server.core_pid))
    attached = Engine.attach_tokenizer_worker(server.proc.pid)
    try:
        expect(rows).to_have_count(3, timeout=3_000)
        expect(tab.page.locator("#frontends")).to_contain_text(str(os.getpid()))
        with ThreadPoolExecutor(3) as pool:  # load for the charts, from the attached frontend
            list(pool.map(lambda i: attached.generate(f"Story {i}: once upon a time",
                                                      {"max_new_tokens": 48}), range(6)))
        expect(tab.page.locator("#tps-chart polyline")).to_have_count(1)
        # attached, not visible: a flat line (equal TTFTs) has an empty box, which counts as hidden
        expect(tab.page.locator("#ttft-chart circle, #ttft-chart polyline").first).to_be_attached()
        tab.screenshot(tmp_path / "engine.png")
    finally:
        attached.shutdown()
    expect(rows).to_have_count(2, timeout=3_000)

    state = tab.page.locator("#core .state")
    tab.page.click("#pause")
    expect(state).to_have_text("paused (abort)")
    assert server.server_info()["paused"]
    tab.page.click("#continue")
    expect(state).to_have_text("serving")
    tab.page.click("#flush")
    expect(tab.page.locator("#control-result")).not_to_be_empty()
    assert not tab.errors, tab.errors


def test_narrow_window(browser, server, tmp_path):
    tab = Tab(browser, server, viewport=NARROW)
    try:
        for view in ("chat", "engine"):
            tab.open(view)
            overflow = tab.page.evaluate("document.documentElement.scrollWidth - innerWidth")
            assert overflow <= 0, f"{view}: {overflow} px wider than the window"
            tab.screenshot(tmp_path / f"{view}-narrow.png")
        tab.open("chat")
        expect(tab.page.locator("#prompt")).to_be_in_viewport()
        assert not tab.errors, tab.errors
    finally:
        tab.context.close()


def test_engine_view_lists_each_models_core(browser, tmp_path_factory, tmp_path):
    """Several models: a row each with its state and core; the loaded one picked is drawn, and the
    controls act on it."""
    from tests.models import minilm_dir
    from tests.serving import models_server
    from unison.model.weights.loader import default_gguf_path

    with models_server(tmp_path_factory, "--model", f"smol={default_gguf_path()}", "--model",
                       f"minilm={minilm_dir()}", "--preload", "smol") as server:
        tab = Tab(browser, server, key=None)
        try:
            tab.page.goto(f"{server.url}/#engine")
            rows = tab.page.locator("#models tbody tr")
            expect(rows).to_have_count(2)
            smol = server.models()["smol"]
            expect(rows.nth(0)).to_contain_text("smol")
            expect(rows.nth(0)).to_contain_text(str(smol["core_pid"]))
            expect(rows.nth(1)).to_contain_text("unloaded")
            expect(tab.page.locator("#core")).to_contain_text(str(smol["core_pid"]))
            tab.page.click("#pause")
            expect(tab.page.locator("#core .state")).to_have_text("paused (abort)")
            tab.page.click("#continue")
            expect(tab.page.locator("#core .state")).to_have_text("serving")
            tab.page.goto(f"{server.url}/#chat")
            expect(tab.page.locator("#model option")).to_have_text(["smol"])  # minilm embeds: no chat
            tab.screenshot(tmp_path / "models.png")
            assert not tab.errors, tab.errors
        finally:
            tab.context.close()


def test_a_picture_goes_with_the_next_message(tab, tmp_path):
    """Attached pictures show above the message, go as image_url parts of the next user turn
    (data: URLs), and leave with it; a text-only model's 400 names the part."""
    import base64

    png = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMI"
                           "QAAAABJRU5ErkJggg==")  # a 1x1 PNG
    picture = tmp_path / "dot.png"
    picture.write_bytes(png)
    tab.open()
    tab.page.set_input_files("#attach", str(picture))
    expect(tab.page.locator("#attached img")).to_have_count(1)
    with tab.page.expect_request("**/v1/chat/completions") as sent:
        tab.ask("What is this?")
    content = sent.value.post_data_json["messages"][-1]["content"]
    assert content[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert content[-1] == {"type": "text", "text": "What is this?"}
    expect(tab.page.locator("#attached")).to_be_hidden()
    expect(tab.page.locator(".msg.user img")).to_have_count(1)
    error = tab.page.locator(LAST_REPLY).locator(".error")
    expect(error).to_contain_text("messages[0].content[0].image_url: this model takes no images")
