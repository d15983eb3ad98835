"""The chat page at / of `llmsplit serve` (infer/serve/chat_page.py): served without the API key
while /v1 needs it, shut off from every other origin; and in headless Chromium, against a real
server: the key asked for, an API error and a lost server shown, a streamed answer equal to
the API's own with its tokens/s. The browser is driven through chromedriver's W3C WebDriver
protocol, spoken with httpx, so the test needs no Python package of its own."""

import base64
import hashlib
import re
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from hf_models import make_hf_folder  # noqa: E402
from llmsplit.launch import free_port  # noqa: E402

KEY = "sk-chat-page-key"
# Chromium headless with nothing of its own on the network: this machine's is closed, and the
# page must not need one.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1100,720"]
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key under which an element's id comes back


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_folder(tmp_path_factory.mktemp("chat_page") / "llama", num_hidden_layers=2)


def sha256(text: str) -> str:
    return f"'sha256-{base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()}'"


def test_the_page_is_served_without_the_key_and_reaches_no_other_origin(folder):
    from starlette.testclient import TestClient

    import llmsplit
    from llmsplit.infer.serve.server import Server

    model = llmsplit.load(folder, max_batch=2, max_context=64)
    try:
        with TestClient(Server(model, "llama", api_key=KEY).app) as c:
            page = c.get("/")
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    finally:
        model.close()
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    # The browser runs the page's script and style only if their hashes are the ones the policy names.
    for tag, directive in (("script", "script-src"), ("style", "style-src")):
        block = re.search(rf"<{tag}>(.*?)</{tag}>", page.text, re.S).group(1)
        assert f"{directive} {sha256(block)};" in csp
    # Offline: nothing to fetch from anywhere, this server's routes only.
    assert not re.search(r"https?://|//[a-z]|@import|url\(", page.text, re.I)
    assert re.findall(r"\b(?:src|href)=\"([^\"]*)\"", page.text) == ["data:,"]
    assert "innerHTML" not in page.text and "insertAdjacentHTML" not in page.text  # model text stays text


class Browser:
    """One WebDriver session: just the commands the test uses."""

    def __init__(self, http: httpx.Client, session: str):
        self.http, self.base = http, f"/session/{session}"

    def _call(self, method: str, path: str, body: dict | None = None):
        r = self.http.request(method, self.base + path, json=body)
        assert r.status_code == 200, r.text
        return r.json()["value"]

    def go(self, url: str) -> None:
        self._call("POST", "/url", {"url": url})

    def js(self, script: str, *args):
        return self._call("POST", "/execute/sync", {"script": script, "args": list(args)})

    def _element(self, css: str) -> str:
        return self._call("POST", "/element", {"using": "css selector", "value": css})[ELEMENT]

    def type(self, css: str, text: str, clear: bool = False) -> None:
        element = self._element(css)
        if clear:
            self._call("POST", f"/element/{element}/clear", {})
        self._call("POST", f"/element/{element}/value", {"text": text})

    def click(self, css: str) -> None:
        self._call("POST", f"/element/{self._element(css)}/click", {})

    def wait(self, script: str, *args, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while not (value := self.js(script, *args)):
            assert time.monotonic() < deadline, f"timed out waiting for: {script}"
            time.sleep(0.05)
        return value

    def screenshot(self, path) -> None:
        path.write_bytes(base64.b64decode(self._call("GET", "/screenshot")))


@pytest.fixture(scope="module")
def chromium_paths():
    """Chromium and its driver, or a skip where either is missing (asked before the model is made)."""
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (binary and driver):
        pytest.skip("no chromium and chromedriver on PATH; Debian: apt-get install chromium chromium-driver")
    return binary, driver


@contextmanager
def chromium(binary: str, driver: str):
    """A WebDriver session in headless Chromium."""
    port = free_port()
    proc = subprocess.Popen([driver, f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http, \
                tempfile.TemporaryDirectory() as profile:
            deadline = time.monotonic() + 10
            while not _ready(http):
                assert proc.poll() is None and time.monotonic() < deadline, "chromedriver did not start"
                time.sleep(0.05)
            options = {"binary": binary, "args": [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]}
            r = http.post("/session", json={"capabilities": {"alwaysMatch": {"goog:chromeOptions": options}}})
            assert r.status_code == 200, r.text
            session = r.json()["value"]["sessionId"]
            try:
                yield Browser(http, session)
            finally:
                http.delete(f"/session/{session}")
    finally:
        proc.terminate()
        proc.wait(10)


def _ready(http: httpx.Client) -> bool:
    try:
        return http.get("/status").json()["value"]["ready"]
    except httpx.TransportError:
        return False


def text_of(css: str) -> str:
    return f"return [...document.querySelectorAll({css!r})].map(e => e.textContent).join('\\n');"


def test_a_chat_in_the_browser_streams_an_answer_with_its_tokens_per_second(chromium_paths, folder, tmp_path):
    from test_serve import live_server

    with chromium(*chromium_paths) as browser, live_server(folder, tmp_path, "--api-key", KEY) as (url, proc, log):
        browser.go(url + "/")
        # No key yet: the page asks for it; a wrong one is refused with 401, the right one lists the models.
        assert "needs its API key" in browser.wait(text_of("#key-form:not([hidden]) #key-note"))
        browser.type("#key", "wrong")
        browser.click("#key-form button")
        browser.wait("return document.getElementById('key-note').textContent.includes('refused this API key (401)');")
        browser.type("#key", KEY)
        browser.click("#key-form button")
        assert browser.wait("return document.getElementById('key-form').hidden && "
                            "[...document.getElementById('model').options].map(o => o.value).join();") == "llama"

        # An API error (here a 400: more tokens than the context holds) is shown, and the message
        # goes back into the box to be sent again.
        browser.type("#system", "Be brief.")
        browser.type("#temperature", "0", clear=True)
        browser.type("#max-tokens", "100000")
        browser.type("#prompt", "Hello\ue007")  # Enter sends
        assert "context" in browser.wait(text_of(".message.error"))
        assert browser.js("return document.getElementById('prompt').value;") == "Hello"

        browser.type("#max-tokens", "12", clear=True)
        browser.click("#send")
        stats = browser.wait(text_of(".message.assistant .stats"), timeout=20)
        answer = browser.js(text_of(".message.assistant .text"))
        direct = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30, json={
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
            "temperature": 0, "max_tokens": 12}).json()
        assert answer and answer == direct["choices"][0]["message"]["content"]
        tokens = direct["usage"]["completion_tokens"]
        assert re.fullmatch(rf"{tokens} tokens in \d+\.\d\d s, \d+\.\d tokens/s", stats), stats
        assert browser.js(text_of(".message.user .text")) == "Hello"

        # A server that is gone is said to be gone.
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        browser.type("#prompt", "Still there?")
        browser.click("#send")
        assert "connection to the server was lost" in browser.wait(text_of(".message.error:last-child"))
