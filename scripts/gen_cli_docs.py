"""Writes docs/reference/cli.md from the commands' own ``--help`` (run: ``python scripts/gen_cli_docs.py``).

Each command's entry point (the ``[project.scripts]`` function) runs in this process with ``--help``,
as its console script would, at a fixed width. ``--check`` exits 1 when the page differs from what the
commands print now (tests/test_docs.py runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import pathlib
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "cli.md"
COMMANDS = [  # as a user types them; the entry point comes from pyproject.toml's [project.scripts]
    "psserver",
    "pstrain", "pstrain demo", "pstrain worker", "pstrain launch", "pstrain local",
    "psctl", "psctl status", "psctl save", "psctl export",
    "psrun",
    "psload",
]  # fmt: skip
_WIDTH = "100"  # columns argparse wraps at, so the page does not depend on the terminal

HEADER = """# Command line

Every command's `--help`, generated from the commands themselves by `python scripts/gen_cli_docs.py`
(a test fails when this page and the commands disagree). The guides show how to use them:
[Getting started](../getting-started.md), [Load testing](../load-testing.md),
[Coming from tf.distribute or Horovod](../migrating.md).
"""


def help_text(command: str, scripts: dict[str, str]) -> str:
    """Runs ``command --help`` through its console-script entry point and returns what it prints."""
    name, *sub = command.split()
    module, func = scripts[name].split(":")
    entry = getattr(importlib.import_module(module), func)
    out = io.StringIO()
    argv, columns = sys.argv, os.environ.get("COLUMNS")
    sys.argv, os.environ["COLUMNS"] = [name, *sub, "--help"], _WIDTH
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            entry([*sub, "--help"])
    finally:
        sys.argv = argv
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    text = out.getvalue().rstrip()
    if not text.startswith("usage: "):
        raise RuntimeError(f"{command} --help printed no usage: {text[:500]!r}")
    return text


def render() -> str:
    sys.path.insert(0, str(ROOT))
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    parts = [HEADER]
    for command in COMMANDS:
        level = "##" if " " not in command else "###"
        parts.append(f"{level} `{command}`\n\n```text\n{help_text(command, scripts)}\n```\n")
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
