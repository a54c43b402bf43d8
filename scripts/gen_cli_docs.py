"""Writes docs/reference/cli.md from the commands' own ``--help`` (run: ``python scripts/gen_cli_docs.py``).

``--check`` exits 1 when the page differs from what the commands print now (the docs test runs it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "cli.md"

# (command as a user types it, the module that `[project.scripts]` points at)
COMMANDS = [
    ("psserver", "psserver"),
    ("pstrain", "trainer"),
    ("pstrain demo", "trainer"),
    ("pstrain worker", "trainer"),
    ("pstrain launch", "trainer"),
    ("pstrain local", "trainer"),
    ("psctl", "psclient.ctl"),
    ("psctl status", "psclient.ctl"),
    ("psctl save", "psclient.ctl"),
    ("psctl export", "psclient.ctl"),
    ("psrun", "trainer.psrun"),
    ("psload", "psload"),
]
_HELP_TIMEOUT_S = 60  # pstrain's parsers import nothing heavy; a loaded 2-core machine still needs seconds

HEADER = """# Command line

Every command's `--help`, generated from the commands themselves by `python scripts/gen_cli_docs.py`
(a test fails when this page and the commands disagree). The guides show how to use them:
[Getting started](../getting-started.md), [Load testing](../load-testing.md),
[Coming from tf.distribute or Horovod](../migrating.md).
"""


def help_text(command: str, module: str) -> str:
    """Runs ``python -m MODULE [SUBCOMMAND] --help`` at a fixed width and returns its output."""
    args = [sys.executable, "-m", module, *command.split()[1:], "--help"]
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=_HELP_TIMEOUT_S, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{command} --help exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout.rstrip()


def render() -> str:
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        texts = list(pool.map(lambda c: help_text(*c), COMMANDS))
    parts = [HEADER]
    for (command, _), text in zip(COMMANDS, texts, strict=True):
        level = "##" if " " not in command else "###"
        parts.append(f"{level} `{command}`\n\n```text\n{text}\n```\n")
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page is out of date")
    args = parser.parse_args()
    page = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            stale = PAGE.relative_to(ROOT)
            print(f"{stale} is out of date: run python scripts/gen_cli_docs.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(PAGE.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
