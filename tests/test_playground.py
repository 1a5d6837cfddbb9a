"""The browser playground (``GET /``), tested in headless Chromium against a live server.

The browser is driven over the Chrome DevTools Protocol with the small client below: Chromium
is started with ``--remote-debugging-pipe`` (CDP messages as NUL-terminated JSON on fds 3 and
4), so no websocket library, no debugging port and no browser download are needed. The server
is the tiny S2 checkpoint on CPU on 127.0.0.1. The browser tests skip when no Chromium binary
is found (``.ci/install-browser.sh`` installs Debian's); the HTTP-level tests always run.

Set ``SHOAL_CHROMIUM`` to pick a browser binary and ``SHOAL_PLAYGROUND_SCREENSHOT`` to keep a
copy of the screenshot somewhere.
"""

from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import live_server
import numpy as np
import pytest
import soundfile as sf
from live_server import LiveServer, engine_idle, service_fixture

from shoal.server.app import create_app
from shoal.server.config import ServerConfig

KEY = "playground-key"
CAP = 400  # frames: the Stop test asks for more and is stopped early
FRAMES = 96  # with latency "low": chunks of 2, 4, 8, 16, 32, 32, 2 frames, ~1 s on CPU
TEXT = "Hello from the playground test."
BROWSERS = ("chromium", "chromium-browser", "google-chrome-stable", "google-chrome", "chrome")


# --------------------------------------------------------------------------- live server
service = service_fixture(max_running=4)


@pytest.fixture(scope="module")
def server(service) -> Iterator[LiveServer]:
    with LiveServer(create_app(service, ServerConfig(api_keys=frozenset({KEY}), max_new_tokens_cap=CAP))) as srv:
        yield srv


def wait_until(cond: Callable[[], Any], timeout: float = 20.0) -> Any:
    return live_server.wait_until(cond, timeout, interval=0.05)


# --------------------------------------------------------------------------- CDP client
def find_chromium() -> str | None:
    env = os.environ.get("SHOAL_CHROMIUM")
    if env:
        return shutil.which(env) or (env if os.access(env, os.X_OK) else None)
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


class CDPError(RuntimeError):
    pass


class Browser:
    """Headless Chromium speaking CDP over ``--remote-debugging-pipe``."""

    def __init__(self, binary: str, profile_dir: str) -> None:
        to_chrome_r, to_chrome_w = os.pipe()
        from_chrome_r, from_chrome_w = os.pipe()
        # the child's ends, moved above 9 so that the shell can map them onto 3 and 4 in any order
        child_r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD_CLOEXEC, 10)
        child_w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        args = [
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--no-default-browser-check", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--disable-extensions", "--disable-dev-shm-usage", "--hide-scrollbars",
            "--autoplay-policy=no-user-gesture-required", f"--user-data-dir={profile_dir}",
            "--remote-debugging-pipe", "about:blank",
        ]
        script = f'exec 3<&{child_r} 4>&{child_w} {child_r}<&- {child_w}>&-; exec "$@"'
        self.log_path = Path(profile_dir) / "chromium.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(["bash", "-c", script, "bash", binary, *args],
                                         pass_fds=(child_r, child_w), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log, start_new_session=True)
        os.close(child_r)
        os.close(child_w)
        self._out, self._in = to_chrome_w, from_chrome_r
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self.events: list[dict] = []
        self._closed = False
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()
        self.version = self.send("Browser.getVersion", timeout=30)["product"]

    def _read_loop(self) -> None:
        buf = b""
        try:
            while True:
                data = os.read(self._in, 1 << 16)
                if not data:
                    break
                buf += data
                while b"\0" in buf:
                    raw, buf = buf.split(b"\0", 1)
                    msg = json.loads(raw)
                    with self._cond:
                        if "id" in msg:
                            self._replies[msg["id"]] = msg
                        else:
                            self.events.append(msg)
                        self._cond.notify_all()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 20.0) -> dict:
        with self._lock:
            self._next_id += 1
            msg_id = self._next_id
            msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
            if session:
                msg["sessionId"] = session
            os.write(self._out, json.dumps(msg).encode() + b"\0")
        with self._cond:
            if not self._cond.wait_for(lambda: msg_id in self._replies or self._closed, timeout):
                raise TimeoutError(f"CDP {method}: no reply in {timeout} s")
            if msg_id not in self._replies:
                raise CDPError(f"CDP {method}: the browser went away")
            reply = self._replies.pop(msg_id)
        if "error" in reply:
            raise CDPError(f"CDP {method}: {reply['error']}")
        return reply.get("result", {})

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except (CDPError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the browser's own process group only
            self.proc.wait(5)
        for fd in (self._out, self._in):
            try:
                os.close(fd)
            except OSError:
                pass


class Page:
    """One tab: evaluate JS, click, type, screenshot; records console errors and exceptions."""

    def __init__(self, browser: Browser) -> None:
        self.browser = browser
        self.target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = browser.send("Target.attachToTarget", {"targetId": self.target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": 1100, "height": 1250, "deviceScaleFactor": 1, "mobile": False})

    def send(self, method: str, params: dict | None = None, timeout: float = 20.0) -> dict:
        return self.browser.send(method, params, self.session, timeout)

    def close(self) -> None:
        try:
            self.browser.send("Target.closeTarget", {"targetId": self.target})
        except (CDPError, TimeoutError):
            pass

    # ---- recorded events
    def _events(self, method: str) -> list[dict]:
        with self.browser._cond:
            return [e["params"] for e in self.browser.events
                    if e.get("sessionId") == self.session and e.get("method") == method]

    def problems(self, allow_network: Callable[[str], bool] = lambda url: False) -> list[str]:
        """JS exceptions, console.error/assert calls, and error log entries (CSP violations,
        failed loads...) except network ones whose URL ``allow_network`` accepts."""
        out = []
        for p in self._events("Runtime.exceptionThrown"):
            d = p["exceptionDetails"]
            out.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
        for p in self._events("Runtime.consoleAPICalled"):
            if p["type"] in ("error", "assert"):
                out.append(f"console.{p['type']}: {[a.get('value', a.get('description')) for a in p['args']]}")
        for p in self._events("Log.entryAdded"):
            e = p["entry"]
            if e["level"] == "error" and not (e.get("source") == "network" and allow_network(e.get("url", ""))):
                out.append(f"log[{e.get('source')}]: {e.get('text')} {e.get('url', '')}")
        return out

    # ---- actions
    def navigate(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})
        if not wait_until(lambda: self.js("document.readyState === 'complete' && !!window.shoalPlayground"), 20):
            raise AssertionError(f"the playground did not load: {self.problems()}")

    def js(self, expression: str, await_promise: bool = False, timeout: float = 20.0) -> Any:
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                           "awaitPromise": await_promise}, timeout)
        if "exceptionDetails" in r:
            raise AssertionError(f"JS failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def state(self) -> dict:
        return self.js("JSON.parse(JSON.stringify(window.shoalPlayground.state))")

    def text_of(self, selector: str) -> str:
        return self.js(f"document.querySelector({json.dumps(selector)}).textContent")

    def click(self, selector: str) -> None:
        """A real mouse click at the element's centre (a user gesture, like a person's)."""
        box = self.js(f"""(() => {{ const el = document.querySelector({json.dumps(selector)});
            el.scrollIntoView({{block: 'center'}}); const r = el.getBoundingClientRect();
            return {{x: r.left + r.width / 2, y: r.top + r.height / 2, disabled: !!el.disabled}}; }})()""")
        assert not box["disabled"], f"{selector} is disabled"
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": box["x"], "y": box["y"],
                                                   "button": "left", "clickCount": 1})

    def type_into(self, selector: str, text: str) -> None:
        """Focus, select all, then type ``text`` over it (Backspace when empty)."""
        self.js(f"(() => {{ const el = document.querySelector({json.dumps(selector)}); el.focus(); el.select(); }})()")
        if text:
            self.send("Input.insertText", {"text": text})
        else:
            for kind in ("keyDown", "keyUp"):
                self.send("Input.dispatchKeyEvent", {"type": kind, "key": "Backspace", "code": "Backspace",
                                                     "windowsVirtualKeyCode": 8})
        assert self.js(f"document.querySelector({json.dumps(selector)}).value") == text

    def choose(self, selector: str, value: str) -> None:
        self.js(f"""(() => {{ const el = document.querySelector({json.dumps(selector)});
            el.value = {json.dumps(value)}; el.dispatchEvent(new Event('change', {{bubbles: true}})); }})()""")

    def set_files(self, selector: str, paths: list[str]) -> None:
        root = self.send("DOM.getDocument")["root"]["nodeId"]
        node = self.send("DOM.querySelector", {"nodeId": root, "selector": selector})["nodeId"]
        self.send("DOM.setFileInputFiles", {"nodeId": node, "files": paths})

    def wait_finished(self, timeout: float = 30.0) -> dict:
        """Waits until the page reports the generation over (done, error or stopped)."""
        st = wait_until(lambda: (s := self.state())["status"] not in ("idle", "running") and s, timeout)
        assert st, f"no result within {timeout} s: {self.state()}"
        return st

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        path.write_bytes(base64.b64decode(data))
        return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no Chromium binary found (run .ci/install-browser.sh, or set SHOAL_CHROMIUM)")
    profile = tempfile.mkdtemp(prefix="shoal-chromium-")
    b = Browser(binary, profile)
    yield b
    b.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def page(browser) -> Iterator[Page]:
    p = Page(browser)
    yield p
    p.close()


def voice_list_404(url: str) -> bool:
    """The page asks for GET /model (the voice library); a server without one answers 501
    (401 before the API key is entered)."""
    return "/model?" in url


def post_pcm(srv: LiveServer, body: dict) -> bytes:
    r = httpx.post(srv.url + "/v1/tts", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.content


def page_download(page: Page) -> bytes:
    b64 = page.js("""window.shoalPlayground.downloadBlob().then(b => b.arrayBuffer()).then(buf => {
        const u = new Uint8Array(buf); let s = '';
        for (let i = 0; i < u.length; i += 0x8000) s += String.fromCharCode.apply(null, u.subarray(i, i + 0x8000));
        return btoa(s); })""", await_promise=True)
    return base64.b64decode(b64)


# --------------------------------------------------------------------------- HTTP level (no browser)
def test_page_and_assets_are_served_with_types_and_cache_headers(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    assert r.headers["cache-control"] == "no-cache" and r.headers["etag"]
    assert r.headers["x-content-type-options"] == "nosniff"
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp
    html = r.text
    assert "{{" not in html and "http://" not in html and "https://" not in html  # all local
    assert httpx.get(server.url + "/", headers={"if-none-match": r.headers["etag"]}).status_code == 304
    assert httpx.head(server.url + "/").status_code == 200

    for name, ctype in (("app.js", "text/javascript; charset=utf-8"), ("style.css", "text/css; charset=utf-8")):
        start = html.index(f"playground/{name}?v=")
        link = html[start:html.index('"', start)]
        a = httpx.get(f"{server.url}/{link}")
        assert a.status_code == 200 and a.headers["content-type"] == ctype and a.content
        assert a.headers["cache-control"] == "public, max-age=31536000, immutable"  # hash-versioned
        assert link.endswith(a.headers["etag"].strip('"'))
        plain = httpx.get(f"{server.url}/playground/{name}")
        assert plain.headers["cache-control"] == "no-cache" and plain.content == a.content
        assert httpx.get(f"{server.url}/playground/{name}",
                         headers={"if-none-match": a.headers["etag"]}).status_code == 304
    assert httpx.get(server.url + "/playground/nope.js").status_code == 404
    # the page is public; the API behind it still wants the key
    assert httpx.post(server.url + "/v1/tts", json={"text": "x"}).status_code == 401


def test_static_files_are_package_data():
    from importlib import resources

    static = resources.files("shoal.server") / "static"
    for name in ("index.html", "app.js", "style.css"):
        assert (static / name).is_file(), name


# --------------------------------------------------------------------------- in the browser
def test_streams_plays_and_downloads(server, page, tmp_path):
    page.navigate(server.url + "/")
    assert wait_until(lambda: page.js("document.getElementById('server').dataset.state") == "ready")
    # the server wants a key: the voice list asks for it, then finds no voice library (501)
    assert wait_until(lambda: "enter the API key" in page.text_of("#voice-note")), page.text_of("#voice-note")
    page.type_into("#text", TEXT)
    page.type_into("#api-key", KEY)
    page.js("window.shoalPlayground.loadVoices()")
    assert wait_until(lambda: "voice library" in page.text_of("#voice-note")), page.text_of("#voice-note")
    assert page.js("[...document.getElementById('voice').options].map(o => o.textContent)") == ["default"]

    page.choose("#latency", "low")
    page.type_into("#max-frames", str(FRAMES))
    page.type_into("#seed", "7")
    page.click("#generate")
    st = page.wait_finished()

    assert st["status"] == "done" and st["error"] is None, st
    assert st["contextState"] == "running"
    # it played while it streamed: first audio scheduled before the stream ended, in several
    # chunks, and the audio clock had passed the first chunk's start when the stream ended
    assert st["firstChunkAt"] < st["doneAt"], st
    assert st["chunks"] >= 2, st
    assert st["playedAtDoneS"] > 0, st
    assert 0 < st["ttfaMs"] < st["elapsedMs"]
    # every byte the server sent was decoded and scheduled, and it is what the server makes
    assert st["sampleRate"] == 44100 and st["seed"] == "7"
    assert st["bytes"] == 2 * st["samples"] > 0
    request = st["request"]
    assert request["format"] == "pcm" and request["streaming"] is True and request["latency"] == "low"
    assert request["max_new_tokens"] == FRAMES and request["seed"] == 7
    pcm = post_pcm(server, request)  # same seed, same request: same audio
    assert len(pcm) == st["bytes"]
    wav = page_download(page)
    audio, rate = sf.read(io.BytesIO(wav), dtype="int16")
    assert rate == 44100 and len(audio) == st["samples"]
    assert wav[44:] == pcm  # the client-side WAV holds exactly the streamed PCM
    assert page.js("document.getElementById('download').download") == "shoal-7.wav"
    assert page.text_of("#stat-ttfa") not in ("", "–") and page.text_of("#stat-chunks") == str(st["chunks"])
    assert wait_until(lambda: not page.state()["playing"], 10)  # playback runs to its end

    shot = page.screenshot(tmp_path / "playground.png")
    assert shot.stat().st_size > 1000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("SHOAL_PLAYGROUND_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["SHOAL_PLAYGROUND_SCREENSHOT"])
    assert page.problems(allow_network=voice_list_404) == []


def test_server_errors_are_shown(server, page):
    page.navigate(server.url + "/")
    page.type_into("#api-key", KEY)
    page.type_into("#text", "")
    page.click("#generate")
    st = page.wait_finished()
    assert st["status"] == "error" and st["error"] == {"status": 400, "message": "text is empty"}, st
    assert page.js("document.getElementById('error').hidden") is False
    assert page.text_of("#error") == "Error 400: text is empty"
    assert st["chunks"] == 0 and page.js("document.getElementById('download').hidden") is True

    page.type_into("#text", TEXT)  # a wrong key: the server's 401 message
    page.type_into("#api-key", "wrong")
    page.click("#generate")
    st = page.wait_finished()
    assert st["status"] == "error" and st["error"]["status"] == 401
    assert page.text_of("#error") == "Error 401: invalid API key"
    # only the failed requests themselves are logged (as network errors); no JS errors
    assert page.problems(allow_network=lambda url: url.endswith("/v1/tts") or voice_list_404(url)) == []


def test_stop_cancels_the_generation(server, service, page):
    page.navigate(server.url + "/")
    page.type_into("#api-key", KEY)
    page.type_into("#text", "A long story that will be interrupted.")
    page.type_into("#max-frames", str(CAP))
    page.click("#generate")
    assert wait_until(lambda: page.state()["chunks"] >= 1), page.state()
    page.click("#stop")
    st = page.wait_finished()
    assert st["status"] == "stopped" and not st["playing"] and st["error"] is None, st
    assert 0 < st["samples"] < CAP * 2048
    assert wait_until(lambda: engine_idle(service), 10)  # the abort reached the engine
    assert page.js("document.getElementById('download').download").endswith("-partial.wav")
    assert page.problems(allow_network=voice_list_404) == []


def test_reference_upload_and_voice_list(service, page, tmp_path):
    """A server with a voice list: the voices are offered; an uploaded reference is sent inline."""
    app = create_app(service, ServerConfig())

    async def models() -> dict:
        return {"total": 1, "items": [{"_id": "alice-1", "title": "Alice"}]}

    app.add_api_route("/model", models, methods=["GET"])
    app.router.routes.insert(0, app.router.routes.pop())  # ahead of the built-in /model routes
    srv = LiveServer(app)
    try:
        page.navigate(srv.url + "/")
        assert wait_until(lambda: page.js("document.getElementById('voice').options.length") == 2)
        assert page.js("document.getElementById('voice').options[1].textContent") == "Alice"

        t = np.arange(22050) / 22050
        ref = tmp_path / "ref.wav"
        sf.write(ref, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 22050)
        page.js("document.querySelector('details.panel').open = true")
        page.set_files("#ref-audio", [str(ref)])
        page.type_into("#ref-text", "A reference recording.")
        page.type_into("#text", "Cloned voice.")
        page.type_into("#max-frames", "8")
        page.click("#generate")
        st = page.wait_finished()
        assert st["status"] == "done" and st["samples"] > 0, st
        assert st["request"]["references"] == [{"audio": f"<ref.wav, {ref.stat().st_size} bytes>",
                                                 "text": "A reference recording."}]

        page.choose("#voice", "alice-1")  # a library voice wins over the upload; this server has none
        page.click("#generate")
        st = page.wait_finished()
        assert st["status"] == "error" and st["error"]["status"] == 404, st
        assert st["request"]["reference_id"] == "alice-1" and "references" not in st["request"]
        assert page.text_of("#error").startswith("Error 404: ")
        assert page.problems(allow_network=lambda url: url.endswith("/v1/tts")) == []
    finally:
        srv.stop()


def test_download_links_save_files(server, page, tmp_path):
    """The WAV link saves the streamed audio; a compressed format is the same request (same
    seed) again in that format."""
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    page.browser.send("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    page.navigate(server.url + "/")
    page.type_into("#api-key", KEY)
    page.type_into("#text", "Save me.")
    page.type_into("#max-frames", "16")
    page.type_into("#seed", "3")
    page.choose("#format", "mp3")
    page.click("#generate")
    st = page.wait_finished()
    assert st["status"] == "done", st

    page.click("#download")
    wav = downloads / "shoal-3.wav"
    assert wait_until(wav.is_file, 10), sorted(downloads.iterdir())
    assert wait_until(lambda: wav.stat().st_size == 44 + st["bytes"], 5)
    assert wav.read_bytes()[44:] == post_pcm(server, st["request"])

    page.click("#download-encoded")
    mp3 = downloads / "shoal-3.mp3"
    assert wait_until(mp3.is_file, 20), sorted(downloads.iterdir())
    body = {**st["request"], "format": "mp3", "seed": 3}
    del body["streaming"]
    expected = httpx.post(server.url + "/v1/tts", json=body, headers={"authorization": f"Bearer {KEY}"},
                          timeout=60).content
    assert wait_until(lambda: mp3.read_bytes() == expected, 5)
    assert page.problems(allow_network=voice_list_404) == []
