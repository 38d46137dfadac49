"""A headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`), for the page tests.

No driver library and no network: the browser reads JSON commands on its fd 3 and writes replies and events on
fd 4, each message ending in a NUL byte. `Browser.open(path)` loads a page from disk and gathers what went wrong
(console errors, uncaught exceptions, requests that left the disk); `evaluate` runs JavaScript in it and
`screenshot` returns a PNG. The process is killed on close, whatever happened.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

TIMEOUT = 30.0  # seconds any one command may take (a busy machine, a cold start)


def chromium_binary() -> str | None:
    """Debian's `chromium` (or another name it goes by), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def high_fd(fd: int) -> int:
    """`fd` moved to 10 or above, so the shell's redirections to 3 and 4 never close it by its number."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


class Browser:
    def __init__(self, binary: str, width: int = 1280, height: int = 1600):
        self.profile = tempfile.mkdtemp(prefix="ripplekv-chromium-")
        to_browser, self._write = map(high_fd, os.pipe())
        self._read, from_browser = map(high_fd, os.pipe())
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--mute-audio", f"--user-data-dir={self.profile}",
                f"--window-size={width},{height}", "about:blank"]
        # fd 3 and 4 are the protocol's: bash (dash takes no fd above 9) puts the pipe ends there and closes the originals.
        script = f'exec "$0" "$@" 3<&{to_browser} 4>&{from_browser} {to_browser}<&- {from_browser}>&-'
        self.process = subprocess.Popen(["bash", "-c", script, binary, *args], pass_fds=(to_browser, from_browser),
                                        stdout=subprocess.DEVNULL, stderr=os.environ.get("RKV_CHROMIUM_LOG") and open(os.environ["RKV_CHROMIUM_LOG"], "w") or subprocess.DEVNULL, start_new_session=True)
        os.close(to_browser)
        os.close(from_browser)
        self._next = 0
        self._replies: dict[int, dict] = {}
        self.events: queue.Queue = queue.Queue()
        self._lock = threading.Condition()
        self._reader = threading.Thread(target=self._read_messages, daemon=True)
        self._reader.start()
        self.session = None

    def _read_messages(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._read, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._lock:
                    self._lock.notify_all()
                return
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                if "id" in message:
                    with self._lock:
                        self._replies[message["id"]] = message
                        self._lock.notify_all()
                else:
                    self.events.put(message)

    def send(self, method: str, params: dict | None = None, session: bool = True) -> dict:
        """One command's result; an error reply or no reply within TIMEOUT raises."""
        self._next += 1
        message = {"id": self._next, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT
        with self._lock:
            while self._next not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    raise RuntimeError(f"chromium gave no reply to {method}")
                self._lock.wait(min(left, 0.5))
            reply = self._replies.pop(self._next)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def open(self, path: Path) -> dict:
        """Load `path` in a fresh tab; returns {"errors": [...], "requests": [URLs not from disk]}."""
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.send("Page.navigate", {"url": Path(path).resolve().as_uri()})
        errors, requests, loaded = [], [], False
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=0.5)
            except queue.Empty:
                if loaded:
                    break  # loaded and quiet
                continue
            method, params = event.get("method"), event.get("params", {})
            if method == "Page.loadEventFired":
                loaded = True
            elif method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                errors.append(details.get("exception", {}).get("description") or details.get("text"))
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                errors.append(" ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                errors.append(params["entry"].get("text"))
            elif method == "Network.requestWillBeSent":
                url = params.get("request", {}).get("url", "")
                if not url.startswith(("file:", "data:", "about:")):
                    requests.append(url)
        if not loaded:
            raise RuntimeError(f"{path} did not load within {TIMEOUT:.0f} s")
        return {"errors": errors, "requests": requests}

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (an exception in it raises)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def screenshot(self, full_page: bool = False) -> bytes:
        params = {"format": "png", "captureBeyondViewport": full_page}
        return base64.b64decode(self.send("Page.captureScreenshot", params)["data"])

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                try:
                    self.send("Browser.close", session=False)
                    self.process.wait(timeout=5)
                except (RuntimeError, OSError, subprocess.TimeoutExpired):
                    pass
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(timeout=10)
            try:  # the browser's own children (renderer, zygote) are in the session it was started in
                os.killpg(self.process.pid, signal.SIGKILL)
            except OSError:
                pass
        finally:
            for fd in (self._write, self._read):
                try:
                    os.close(fd)
                except OSError:
                    pass
            shutil.rmtree(self.profile, ignore_errors=True)
