"""Headless Chromium driven over the DevTools protocol, and a local `mlflow server` to point it at.

Shared by the MLflow UI test (tests/sweeps/test_mlflow_ui.py) and the README's screenshot script
(scripts/screenshots.py). The MLflow UI is a React single-page app that fills itself in with REST
calls after the page loads, and nests a study's trials behind an expander that must be clicked:
`chromium --dump-dom` sees neither reliably, so this talks to Chromium over
`--remote-debugging-pipe` (JSON messages ended by a NUL byte on file descriptors 3 and 4; only the
standard library, no websocket client or browser-automation package). Every wait polls for a
condition with a generous limit (a failure detector, not a pace): a machine 5x slower still passes.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

# Generous limits, all of them only there so that a broken browser or server fails instead of hanging.
START_LIMIT_S = 300.0  # the server's first start migrates nothing but imports a lot of Python
WAIT_LIMIT_S = 300.0  # a page's content (REST calls, React rendering) on a slow machine
CALL_LIMIT_S = 120.0  # one DevTools command
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                  "--disable-dev-shm-usage", "--remote-debugging-pipe")
INSTALL_HINT = ("headless Chromium is not installed: run `.ci/run` (it installs it), or "
                "`apt-get install -y chromium`")


class BrowserError(RuntimeError):
    """The browser or the page did not do what was asked (the message says what it last saw)."""


def find_chromium() -> str | None:
    """The Chromium executable, or None when it is not installed."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").is_file() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen | None = None, log: Path | None = None,
              limit_s: float = START_LIMIT_S) -> None:
    """Poll ``url`` until it answers 200; fail at once if ``proc`` exits, with its log's tail."""
    def tail() -> str:
        return log.read_text(errors="replace")[-3000:] if log is not None else ""

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BrowserError(f"{' '.join(map(str, proc.args[:2]))} exited with {proc.returncode}:\n{tail()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise BrowserError(f"{url} did not answer within {limit_s:.0f} s:\n{tail()}")


class MlflowServer:
    """``mlflow server`` on a free loopback port over an existing store; a context manager.

    One worker and no job runner: it serves one browser. It runs in its own process group so
    that stopping it also stops the uvicorn worker it starts."""

    def __init__(self, backend_uri: str, artifacts: Path, log: Path) -> None:
        self.backend_uri, self.artifacts, self.log = backend_uri, artifacts, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> MlflowServer:
        exe = Path(sys.executable).parent / "mlflow"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mlflow"]
        cmd += ["server", "--backend-store-uri", self.backend_uri, "--artifacts-destination", str(self.artifacts),
                "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        # The job runner is a pool of extra processes that serving a UI never uses.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        try:
            wait_http(self.url + "/health", self.proc, self.log)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None:
            return
        _stop_group(self.proc)
        self.proc = None


def _stop_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the process group ``proc`` leads, then SIGKILL what is left of it (children of the
    leader that outlived it, or all of it after ``grace_s``)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        if sig == signal.SIGTERM:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
    proc.wait(timeout=60)


class Chromium:
    """One headless Chromium and one page in it, driven over the DevTools pipe; a context manager.

    ``width`` x ``height`` is the viewport (CSS pixels) that pages are laid out in and screenshots
    taken at."""

    def __init__(self, width: int = 1400, height: int = 900, profile: Path | None = None) -> None:
        exe = find_chromium()
        if exe is None:
            raise BrowserError(INSTALL_HINT)
        self.exe, self.width, self.height = exe, width, height
        self._own_profile = profile is None
        self.profile = Path(tempfile.mkdtemp(prefix="sweeps-chromium-")) if profile is None else profile
        self.proc: subprocess.Popen | None = None
        self._ids = iter(range(1, 1 << 62))
        self._replies: dict[int, dict] = {}
        self._cond = threading.Condition()
        self.session = ""

    # ---- the process and the pipe -------------------------------------------------------------------
    def __enter__(self) -> Chromium:
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        # Chromium reads commands on fd 3 and writes on fd 4. Popen only places fds 0-2, so a bare
        # Python moves the pipes from 0 and 1 to 3 and 4, points 0 and 1 elsewhere, and execs
        # Chromium (no preexec_fn: that is unsafe in a process with threads, e.g. pytest-xdist's).
        shim = ("import os, sys; os.dup2(0, 3); os.dup2(1, 4); os.dup2(os.open(os.devnull, os.O_RDONLY), 0); "
                "os.dup2(2, 1); os.execv(sys.argv[1], sys.argv[1:])")
        cmd = [sys.executable, "-I", "-S", "-c", shim, self.exe, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}",
               f"--window-size={self.width},{self.height}", "about:blank"]
        self.profile.mkdir(parents=True, exist_ok=True)
        self._log = open(self.profile / "chromium.log", "wb")
        self.proc = subprocess.Popen(cmd, stdin=to_child_r, stdout=from_child_w, stderr=self._log,
                                     start_new_session=True)
        os.close(to_child_r)
        os.close(from_child_w)
        threading.Thread(target=self._read, daemon=True).start()
        try:
            target = self.call("Target.createTarget", url="about:blank", session=None)["targetId"]
            self.session = self.call("Target.attachToTarget", targetId=target, flatten=True,
                                     session=None)["sessionId"]
            self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                      deviceScaleFactor=1, mobile=False)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.call("Browser.close", session=None, limit_s=30)
                self.proc.wait(timeout=30)
            except (BrowserError, OSError, subprocess.TimeoutExpired):
                pass
            _stop_group(self.proc)
            self.proc = None
            os.close(self._to_child)
            self._log.close()
        if self._own_profile:
            shutil.rmtree(self.profile, ignore_errors=True)

    def _read(self) -> None:
        """The reader thread: splits Chromium's output into messages and keeps the replies, by id (events
        are dropped: nothing here waits on one; waits poll the page instead)."""
        buf = b""
        with os.fdopen(self._from_child, "rb", buffering=0) as pipe:
            while chunk := pipe.read(1 << 20):
                buf += chunk
                *messages, buf = buf.split(b"\0")
                for raw in messages:
                    msg = json.loads(raw)
                    if "id" in msg:
                        with self._cond:
                            self._replies[msg["id"]] = msg
                            self._cond.notify_all()
        with self._cond:  # the pipe closed: Chromium is gone; wake whoever waits
            self._replies[-1] = {}
            self._cond.notify_all()

    def call(self, method: str, session: str | None = "", limit_s: float = CALL_LIMIT_S, **params: Any) -> dict:
        """Send one DevTools command (to the page's session unless ``session`` is None: the browser)
        and return its result."""
        msg_id = next(self._ids)
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params}
        if session is not None:
            msg["sessionId"] = session or self.session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + limit_s
        with self._cond:
            while msg_id not in self._replies:
                if -1 in self._replies:
                    raise BrowserError(f"Chromium exited during {method}: {self.log_tail()}")
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise BrowserError(f"{method} got no answer within {limit_s:.0f} s")
            reply = self._replies.pop(msg_id)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def log_tail(self) -> str:
        path = self.profile / "chromium.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    # ---- pages ------------------------------------------------------------------------------------------
    def open(self, url: str) -> None:
        """Navigate the page to ``url`` (a hash route of a single-page app counts as a navigation too)."""
        reply = self.call("Page.navigate", url=url)
        if reply.get("errorText"):
            raise BrowserError(f"{url}: {reply['errorText']}")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        reply = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in reply:
            raise BrowserError(f"{expression[:80]}...: {reply['exceptionDetails'].get('exception', reply)}")
        return reply["result"].get("value")

    def text(self) -> str:
        """The page's visible text (what a reader sees: no script or style contents)."""
        return self.evaluate("document.body ? document.body.innerText : ''") or ""

    def wait_for(self, expression: str, what: str, limit_s: float = WAIT_LIMIT_S) -> Any:
        """Poll a JavaScript expression until it is truthy; its value. Fails after ``limit_s`` with the
        page's text, so that a failure shows what was there instead."""
        deadline = time.monotonic() + limit_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"waited {limit_s:.0f} s for {what}; the page shows:\n{self.text()[:3000]}")
            time.sleep(0.25)

    def wait_for_text(self, *needles: str, limit_s: float = WAIT_LIMIT_S) -> str:
        """Wait until every one of ``needles`` is in the page's visible text; that text."""
        probe = " && ".join(f"document.body.innerText.includes({json.dumps(n)})" for n in needles)
        self.wait_for(f"!!document.body && {probe}", f"the text {list(needles)}", limit_s)
        return self.text()

    def settle(self, quiet_s: float = 1.0, limit_s: float = WAIT_LIMIT_S) -> None:
        """Wait until the page's HTML has stopped changing for ``quiet_s`` (charts drawn, spinners
        gone) before a screenshot. Only a pause between two looks: correctness never depends on it."""
        deadline, last, since = time.monotonic() + limit_s, None, time.monotonic()
        while time.monotonic() < deadline:
            now = self.evaluate("document.body ? document.body.innerHTML.length : 0")
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            time.sleep(0.2)

    def mouse_click(self, element_js: str, what: str) -> None:
        """Click, with real mouse events at its centre, the element a JavaScript expression finds
        (some widgets, e.g. the UI's drop-down selects, react to the mouse, not to ``el.click()``)."""
        box = self.evaluate(f"(() => {{ const el = {element_js}; if (!el) return null; el.scrollIntoView({{block: "
                            "'center'}); const r = el.getBoundingClientRect(); return [r.x + r.width / 2, "
                            "r.y + r.height / 2]; })()")
        if not box:
            raise BrowserError(f"nothing to click: {what}; the page shows:\n{self.text()[:2000]}")
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def type_text(self, text: str) -> None:
        """Type ``text`` into whatever has the keyboard focus."""
        self.call("Input.insertText", text=text)

    def press(self, key: str, code: int) -> None:
        """Press and release one key (``key`` as in KeyboardEvent.key, ``code`` its Windows key code)."""
        for kind in ("rawKeyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=key, windowsVirtualKeyCode=code)

    def screenshot(self, path: Path, full_page: bool = False) -> Path:
        """Save the page as a PNG at ``path`` (the viewport, or the whole page's height)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.call("Page.getLayoutMetrics")["cssContentSize"]
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": self.width, "height": size["height"], "scale": 1})
        data = base64.b64decode(self.call("Page.captureScreenshot", **params)["data"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path


def check_png(path: Path, width: int, height: int) -> None:
    """Fail unless ``path`` is a ``width`` x ``height`` PNG with something drawn on it: more than a
    handful of colours, and no single colour covering almost all of it (a blank or error page)."""
    from PIL import Image  # Pillow comes with torchvision, a dependency of the project

    with Image.open(path) as img:
        if img.format != "PNG" or img.size != (width, height):
            raise BrowserError(f"{path}: {img.format} {img.size}, expected a {width}x{height} PNG")
        colours = img.convert("RGB").getcolors(maxcolors=width * height) or []
    top = max(count for count, _ in colours)
    if len(colours) < 16 or top > 0.98 * width * height:
        raise BrowserError(f"{path} looks blank: {len(colours)} colours, the commonest covers "
                           f"{top / (width * height):.0%} of it")


def click(browser: Chromium, selector: str, text: str | None = None) -> bool:
    """Click the first element matching the CSS ``selector`` (and, if given, whose visible text is
    ``text``); whether there was one."""
    return bool(browser.evaluate(
        f"(() => {{ const el = [...document.querySelectorAll({json.dumps(selector)})]"
        f".find(e => {json.dumps(text)} === null || e.innerText.trim() === {json.dumps(text)});"
        " if (el) el.click(); return !!el; })()"))
