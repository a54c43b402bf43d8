"""Builds the docs site and screenshots pages in headless Chromium, to check them by eye.

    python scripts/docs_screenshots.py [--out DIR] [PAGE ...]

PAGE is a site path (default: the home page, the Keras guide and a benchmark page). Needs mkdocs (extra
``dev``) and Chromium (Debian: ``apt-get install -y chromium``). Not run by the test suite: a human (or a
reviewer) looks at the PNGs for the navigation, code blocks and images. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = ["", "keras/", "benchmarks/ps/"]
_BUILD_TIMEOUT_S = 180
_SHOT_TIMEOUT_S = 60  # one page in headless Chromium, its images loaded
_WINDOW = "1280,1800"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def serve(directory: pathlib.Path) -> Iterator[str]:
    """Serves ``directory`` on a free loopback port (Material's directory URLs need a server, not file://)."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    sys.exit("no Chromium found: apt-get install -y chromium")


def shoot(browser: str, url: str, png: pathlib.Path) -> None:
    args = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        f"--window-size={_WINDOW}", "--virtual-time-budget=5000", f"--screenshot={png}", url,
    ]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=_SHOT_TIMEOUT_S, check=False)
    if proc.returncode != 0 or not png.exists():
        sys.exit(f"chromium failed on {url}: {proc.stderr[-2000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", default=PAGES, help="site paths (default: %(default)s)")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "site-screenshots", help="PNG directory")
    args = parser.parse_args()
    browser = chromium()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = pathlib.Path(tmp) / "site"
        subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "--site-dir", str(site)],
            cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=_BUILD_TIMEOUT_S, check=True,
        )  # fmt: skip
        with serve(site) as base:
            for page in args.pages:
                png = args.out / (page.strip("/").replace("/", "_") or "home")
                png = png.with_suffix(".png")
                shoot(browser, base + page, png)
                print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
