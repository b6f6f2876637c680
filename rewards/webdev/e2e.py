"""The webdev grader's end-to-end driver. Pristine: mounted read-only into the judging fork after the build.

It serves the built `dist/` on 127.0.0.1 inside the sandbox (which has no other network), starts Debian's
Chromium headless with the DevTools protocol on a pipe (no websocket, no extra packages), and runs one
grader-owned spec with data drawn at random now: the page cannot have been written for these values.
Clicks and keys are real input events at the element's on-screen position, so an element that is missing,
hidden or zero-sized cannot be "clicked". Uncaught exceptions, console errors and requests to any other
host are recorded. One JSON object goes to stdout; the page's code cannot reach this process.

Run: python3 -I e2e.py <dist_dir> <spec> (stdlib only)
"""

import functools
import http.server
import json
import os
import random
import select
import shutil
import string
import subprocess
import sys
import tempfile
import threading
import time

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",  # the grader's sandbox is the isolation; Chromium's own needs user namespaces
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--disable-extensions",
    "--window-size=1280,900",
    # an ordinary desktop user agent: a page that serves canned content to "HeadlessChrome" sees none
    "--user-agent=Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) "
    "Chrome/124.0.0.0 Safari/537.36",
]


class StepFailed(Exception):
    pass


class CDP:
    """Chrome DevTools protocol over --remote-debugging-pipe (fd 3: commands in, fd 4: replies out)."""

    def __init__(self, binary, user_data_dir):
        cmd_r, self.cmd_w = os.pipe()
        self.res_r, res_w = os.pipe()

        def wire():  # in the child, before exec: put the two pipe ends at fds 3 and 4
            os.dup2(cmd_r, 3)
            os.dup2(res_w, 4)

        argv = [
            binary,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={user_data_dir}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            argv,
            preexec_fn=wire,
            pass_fds=(3, 4),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(cmd_r)
        os.close(res_w)
        self.next_id = 0
        self.buf = b""
        self.events = []
        self.session = None

    def _read_msg(self, timeout):
        deadline = time.monotonic() + timeout
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("browser did not answer")
            r, _, _ = select.select([self.res_r], [], [], left)
            if r:
                chunk = os.read(self.res_r, 1 << 20)
                if not chunk:
                    raise RuntimeError("browser exited")
                self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method, params=None, timeout=15.0, session=True):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self.cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_msg(max(0.01, deadline - time.monotonic()))
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def pump(self, seconds):
        deadline = time.monotonic() + seconds
        while True:
            try:
                self.events.append(self._read_msg(max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                return

    def close(self):
        self.proc.kill()
        self.proc.wait()


class Page:
    def __init__(self, cdp, origin):
        self.cdp = cdp
        self.origin = origin

    def js(self, expr):
        res = self.cdp.call("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in res:
            raise StepFailed(f"page script error while checking: {res['exceptionDetails'].get('text')}")
        return res.get("result", {}).get("value")

    def rect(self, selector):
        r = self.js(
            f"(() => {{ const el = document.querySelector({json.dumps(selector)}); if (!el) return null;"
            " el.scrollIntoView({block: 'center'}); const r = el.getBoundingClientRect();"
            " const s = getComputedStyle(el);"
            " return {x: r.x + r.width / 2, y: r.y + r.height / 2, w: r.width, h: r.height,"
            " visible: s.visibility !== 'hidden' && s.display !== 'none' && Number(s.opacity) > 0}; })()"
        )
        if r is None:
            raise StepFailed(f"element {selector} is missing from the DOM")
        if not r["visible"] or r["w"] < 1 or r["h"] < 1:
            raise StepFailed(f"element {selector} is not visible")
        return r

    def click(self, selector):
        r = self.rect(selector)
        for kind in ("mousePressed", "mouseReleased"):
            self.cdp.call(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": r["x"], "y": r["y"], "button": "left", "clickCount": 1},
            )

    def type(self, selector, text):
        self.click(selector)
        self.cdp.call("Input.insertText", {"text": text})

    def press_enter(self):
        for kind in ("keyDown", "keyUp"):
            params = {"type": kind, "key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13}
            if kind == "keyDown":
                params["text"] = "\r"
            self.cdp.call("Input.dispatchKeyEvent", params)

    def wait_for(self, expr, what, timeout=3.0):
        """Poll a JS predicate: UIs may update a frame or a promise later."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.js(expr)
            if last is True:
                return
            time.sleep(0.03)
        raise StepFailed(f"{what} (state: {self.js(STATE_JS)})")


STATE_JS = (
    "JSON.stringify({items: [...document.querySelectorAll('#todo-list li')].map(li => "
    "[li.querySelector('.text') ? li.querySelector('.text').textContent : li.textContent, "
    "li.classList.contains('done')]), remaining: (document.querySelector('#remaining') || {}).textContent, "
    "input: (document.querySelector('#new-todo') || {}).value})"
)


def _word(rng):
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))


def spec_todo(page, rng, log):
    """The todo spec (the task statement the policy saw describes exactly these elements)."""

    def state():
        return json.loads(page.js(STATE_JS))

    def expect(pred_js, what):
        page.wait_for(pred_js, what)
        log.append(what)

    expect(
        "!!document.querySelector('#new-todo') && !!document.querySelector('#add-todo') && "
        "!!document.querySelector('#todo-list')",
        "initial DOM has #new-todo, #add-todo, #todo-list",
    )
    page.rect("#new-todo")
    page.rect("#add-todo")
    expect(
        "document.querySelectorAll('#todo-list li').length === 0 && "
        "(document.querySelector('#remaining') || {}).textContent.trim() === '0'",
        "starts empty, 0 remaining",
    )
    todos = [f"{_word(rng)} {rng.randint(10, 9999)} {_word(rng)}" for _ in range(rng.randint(3, 5))]
    for i, text in enumerate(todos, 1):
        page.type("#new-todo", "  " + text + " ")
        if rng.random() < 0.5:
            page.click("#add-todo")
        else:
            page.press_enter()
        expect(
            f"(() => {{ const li = [...document.querySelectorAll('#todo-list li')];"
            f" return li.length === {i} && li[{i - 1}].textContent.includes({json.dumps(text)})"
            f" && document.querySelector('#new-todo').value === ''"
            f" && document.querySelector('#remaining').textContent.trim() === '{i}'; }})()",
            f"added todo {i} {text!r}: listed, input cleared, remaining {i}",
        )
    page.type("#new-todo", "   ")
    page.click("#add-todo")
    time.sleep(0.1)
    expect(f"document.querySelectorAll('#todo-list li').length === {len(todos)}", "a blank todo is ignored")
    done = rng.sample(range(len(todos)), rng.randint(1, len(todos) - 1))
    for k, idx in enumerate(done, 1):
        page.click(f"#todo-list li:nth-child({idx + 1}) .toggle")
        expect(
            f"document.querySelector('#todo-list li:nth-child({idx + 1})').classList.contains('done') && "
            f"document.querySelector('#remaining').textContent.trim() === '{len(todos) - k}'",
            f"toggled todo {idx + 1} done, remaining {len(todos) - k}",
        )
    victim = rng.randrange(len(todos))
    page.click(f"#todo-list li:nth-child({victim + 1}) .delete")
    left = [t for i, t in enumerate(todos) if i != victim]
    remaining = sum(1 for i in range(len(todos)) if i != victim and i not in done)
    expect(
        f"(() => {{ const li = [...document.querySelectorAll('#todo-list li')];"
        f" return li.length === {len(left)}"
        f" && !li.some(x => x.textContent.includes({json.dumps(todos[victim])}))"
        f" && document.querySelector('#remaining').textContent.trim() === '{remaining}'; }})()",
        f"deleted todo {victim + 1}, remaining {remaining}",
    )
    final = state()
    if [t for t, _ in final["items"]] and not all(any(t in s for s, _ in final["items"]) for t in left):
        raise StepFailed("final list lost a todo")


SPECS = {"todo": spec_todo}

ERROR_HOOK = """(() => {
  const report = window.__rlk3_report;
  delete window.__rlk3_report;
  window.addEventListener('error', (e) => report('uncaught: ' + (e.message || e.type)), true);
  window.addEventListener('unhandledrejection',
                          (e) => report('unhandled rejection: ' + String(e.reason)), true);
})();"""


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        # browsers ask for /favicon.ico on their own; an app without one is not an app with an error
        if self.path == "/favicon.ico" and not os.path.exists(os.path.join(self.directory, "favicon.ico")):
            self.send_response(204)
            self.end_headers()
            return
        super().do_GET()


def main():
    dist, spec_name = sys.argv[1], sys.argv[2]
    rng = random.Random(int.from_bytes(os.urandom(8), "little"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=dist))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    origin = f"http://127.0.0.1:{server.server_address[1]}"
    result = {"steps": [], "failure": None, "page_errors": [], "console_errors": [], "external_requests": []}
    udd = tempfile.mkdtemp(prefix="chromium-")
    # Debian's /usr/bin/chromium is a shell wrapper that sources /etc/chromium.d/*, which a sandbox with a
    # curated /etc may lack; the binary behind it needs nothing from /etc
    binary = "/usr/lib/chromium/chromium"
    if not os.path.exists(binary):
        binary = shutil.which("chromium") or "/usr/bin/chromium"
    cdp = CDP(binary, udd)
    try:
        target = cdp.call("Target.createTarget", {"url": "about:blank"}, timeout=60)["targetId"]
        cdp.session = cdp.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            cdp.call(f"{domain}.enable")
        # runs before any page script: a capturing error listener that reports through a CDP binding it
        # holds privately, so `window.onerror = () => true` or stopPropagation in the page hides nothing
        cdp.call("Runtime.addBinding", {"name": "__rlk3_report"})
        cdp.call("Page.addScriptToEvaluateOnNewDocument", {"source": ERROR_HOOK})
        cdp.call("Page.navigate", {"url": origin + "/"})
        deadline = time.monotonic() + 20
        while not any(e.get("method") == "Page.loadEventFired" for e in cdp.events):
            if time.monotonic() > deadline:
                raise StepFailed("page did not finish loading")
            cdp.pump(0.1)
        cdp.pump(0.2)
        SPECS[spec_name](Page(cdp, origin), rng, result["steps"])
        cdp.pump(0.2)
    except (StepFailed, TimeoutError, RuntimeError) as e:
        result["failure"] = str(e)[:500]
    finally:
        for e in cdp.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                result["page_errors"].append((d.get("exception", {}).get("description") or d.get("text", ""))[:300])
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                args = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
                result["console_errors"].append(args[:300])
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                result["console_errors"].append(p["entry"].get("text", "")[:300])
            elif m == "Runtime.bindingCalled" and p.get("name") == "__rlk3_report":
                result["page_errors"].append(str(p.get("payload", ""))[:300])
            elif m == "Network.requestWillBeSent":
                url = p.get("request", {}).get("url", "")
                if not (
                    url.startswith(origin)
                    or url.startswith("data:")
                    or url.startswith("about:")
                    or url.startswith("blob:")
                ):
                    result["external_requests"].append(url[:300])
        cdp.close()
        server.shutdown()
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
