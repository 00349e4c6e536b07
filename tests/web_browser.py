"""Headless Chromium with WebGPU, driven by Playwright, for the web-export tests.

Debian's ``chromium`` runs WebGPU compute headless on SwiftShader (a Vulkan driver on the
CPU that ships with Chromium) with these switches; the others keep it off the network
(closed here: it would stall on connections) and away from any existing profile."""
from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading

CHROMIUM = os.environ.get("MEGANEURA_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--enable-unsafe-webgpu", "--enable-features=Vulkan",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
    "--disable-quic", "--disable-dev-shm-usage",
]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class StaticServer:
    """Serves ``root`` on 127.0.0.1 (localhost is a secure context: WebGPU is allowed)."""

    def __init__(self, root):
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class Browser:
    """One Chromium with a fresh profile; ``page(url)`` opens a page that fails the test on
    any uncaught page error, and keeps the console for messages."""

    def __init__(self, profile_dir):
        if not os.path.exists(CHROMIUM):
            raise RuntimeError(f"no Chromium at {CHROMIUM}: run scripts/setup.sh (installs Debian's chromium)")
        from playwright.sync_api import sync_playwright
        self._pw = sync_playwright().start()
        try:
            self.context = self._pw.chromium.launch_persistent_context(
                str(profile_dir), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
                viewport={"width": 900, "height": 560})
        except Exception:
            self._pw.stop()
            raise

    def page(self, url, init_script=None):
        pg = self.context.new_page()
        pg.console_lines = []
        pg.page_errors = []
        pg.on("console", lambda m: pg.console_lines.append(f"{m.type}: {m.text}"))
        pg.on("pageerror", lambda e: pg.page_errors.append(str(e)))
        if init_script:
            pg.add_init_script(init_script)
        pg.goto(url)
        return pg

    def close(self):
        try:
            self.context.close()
        finally:
            self._pw.stop()
