"""The docs cannot rot: the site builds strictly, the CLI page is the commands' own ``--help``, and every
Python block of the README and ``docs/`` runs (against a local cluster) or says why it cannot.

A Python block is marked by an HTML comment on the line before its fence:

- ``<!-- docs-test: cluster -->``: run against a fresh 2-shard local cluster, with the block's
  ``127.0.0.1:50051`` and ``127.0.0.1:50052`` replaced by that cluster's addresses;
- ``<!-- docs-test: launch -->``: a whole training script, run by the README's ``pstrain launch`` command;
- ``<!-- docs-test: skip: REASON -->``: not runnable here, and why.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from _support import pythonpath

import psclient
from trainer.cluster import LocalCluster

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
DOC_ADDRESSES = ("127.0.0.1:50051", "127.0.0.1:50052")
_MKDOCS_TIMEOUT_S = 120  # about 5 s quiet; mkdocstrings parses every public module
_BLOCKS_TIMEOUT_S = 120  # the cluster blocks together take a few seconds
_LAUNCH_TIMEOUT_S = 240  # a TensorFlow worker starting on a loaded 2-core machine
_MARK = re.compile(r"<!-- docs-test: (cluster|launch|skip: (?P<reason>.+?)) -->")


@dataclass(frozen=True)
class Block:
    page: pathlib.Path
    line: int  # of the opening fence, 1-based
    mark: str  # "cluster", "launch", "skip" or "" (unmarked)
    reason: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def python_blocks() -> list[Block]:
    blocks = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = lines[i].lstrip()
            if fence.startswith("```python"):
                indent = len(lines[i]) - len(fence)
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                code = "\n".join(ln[indent:] for ln in lines[i + 1 : end]) + "\n"
                mark = _MARK.search(lines[i - 1]) if i else None
                kind = "" if mark is None else mark.group(1).split(":")[0]
                reason = (mark.group("reason") or "") if mark else ""
                blocks.append(Block(page, i + 1, kind, reason.strip(), code))
                i = end
            i += 1
    return blocks


def test_docs_every_python_block_runs_or_says_why_not() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 10, "the block parser found too few python blocks"
    unmarked = [b.where for b in blocks if not b.mark]
    assert not unmarked, f"python blocks without a docs-test mark (see this file's docstring): {unmarked}"
    for b in blocks:
        if b.mark == "skip":
            assert len(b.reason) >= 20, f"{b.where}: say why the block cannot run"
        if b.mark == "cluster":
            others = set(re.findall(r"\d+\.\d+\.\d+\.\d+:\d+", b.code)) - set(DOC_ADDRESSES)
            assert not others, f"{b.where}: a cluster block may only use {DOC_ADDRESSES}, not {others}"
    assert [b.page.name for b in blocks if b.mark == "launch"] == ["README.md"]


# Runs each block in its own namespace in one interpreter (one import of psclient for all), closing the
# clients a block leaves open; prints the failures as JSON.
_RUNNER = r"""
import json, sys, traceback
import psclient
failed = []
for where, code in json.load(sys.stdin):
    ns = {"__name__": "__docs__"}
    try:
        exec(compile(code, where, "exec"), ns)
    except BaseException:
        failed.append([where, traceback.format_exc()])
    finally:
        for value in ns.values():
            if isinstance(value, psclient.PSClient):
                value.close()
print(json.dumps(failed))
"""


@pytest.fixture(scope="module")
def docs_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(num_shards=2) as cluster:
        yield cluster


def test_docs_cluster_blocks_run_against_a_local_cluster(docs_cluster: LocalCluster) -> None:
    blocks = [b for b in python_blocks() if b.mark == "cluster"]
    assert blocks
    payload = []
    for b in blocks:
        code = b.code
        for doc_address, address in zip(DOC_ADDRESSES, docs_cluster.addresses, strict=True):
            code = code.replace(doc_address, address)
        payload.append([b.where, code])
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": pythonpath(ROOT)},
        timeout=_BLOCKS_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failed, "\n\n".join(f"{where}:\n{tb}" for where, tb in failed)


def _normalized(text: str) -> str:
    """Numbers (ports, seconds, counts) and 16-hex-digit session ids vary between runs."""
    text = re.sub(r"\b[0-9a-f]{16}\b", "ID", text)
    return re.sub(r"\d+(\.\d+)?", "N", text)


def test_docs_troubleshooting_shows_the_real_messages(
    docs_cluster: LocalCluster, tmp_path: pathlib.Path
) -> None:
    """The TF-free errors of docs/troubleshooting.md, reproduced: the page must quote them as they are."""
    messages = []
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"} | {"PYTHONPATH": pythonpath(ROOT)}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for args in (["--shard", "0", "--port", port], ["--port", port]):
            proc = subprocess.run(
                [sys.executable, "-m", "psserver", *args],
                capture_output=True, text=True, env=env, timeout=_BLOCKS_TIMEOUT_S, check=False,
            )  # fmt: skip
            assert proc.returncode == 2, proc.stderr[-2000:]
            messages.append(proc.stderr.strip().splitlines()[-1])
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{free.getsockname()[1]}"
    raised: list[BaseException] = []

    def catch(call: object, *args: object, **kwargs: object) -> None:
        with pytest.raises(psclient.PSError) as info:
            call(*args, **kwargs)  # type: ignore[operator]
        raised.append(info.value)

    with psclient.PSClient([nobody], worker_id="w0", timeout=1.0) as c:
        catch(c.pull)
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    guarded = LocalCluster(num_shards=1, server_args=["--auth-token-file", str(token)]).start()
    try:
        for auth in ("wrong", None):
            with psclient.PSClient(guarded.addresses, worker_id="w0", auth_token=auth, timeout=10.0) as c:
                catch(c.pull)
    finally:
        guarded.stop()
    with (
        psclient.PSClient(docs_cluster.addresses, worker_id="w0", timeout=10.0) as a,
        psclient.PSClient(docs_cluster.addresses, worker_id="w0", timeout=10.0) as b,
    ):
        a.create("troubleshooting/v", np.zeros(4, np.float32), optimizer=psclient.SGD(0.1))
        b.push({"troubleshooting/v": np.ones(4, np.float32)})
        a.push({"troubleshooting/v": np.ones(4, np.float32)})  # a's session is newer: it takes over
        catch(b.push, {"troubleshooting/v": np.ones(4, np.float32)})
        catch(a.pull, ["dense/kernal"])
    stalled = LocalCluster(num_shards=1).start()  # a push into a shard that stops (SIGSTOP) answering
    try:
        with psclient.PSClient(stalled.addresses, worker_id="w0", timeout=1.0) as c:
            c.create("troubleshooting/v", np.zeros(2, np.float32))
            c.push({"troubleshooting/v": np.ones(2, np.float32)})
            os.kill(stalled.procs[0].pid, signal.SIGSTOP)
            try:
                catch(c.push, {"troubleshooting/v": np.ones(2, np.float32)})
                catch(c.list_variables, ["troubleshooting/v"])  # any call: the shard is silent
            finally:
                os.kill(stalled.procs[0].pid, signal.SIGCONT)
    finally:
        stalled.stop()
    messages += [f"{type(e).__module__}.{type(e).__name__}: {e}" for e in raised]
    page = _normalized((DOCS / "troubleshooting.md").read_text())
    missing = [m for m in messages if _normalized(m) not in page]
    stale = "\n".join(missing)
    assert not missing, f"docs/troubleshooting.md does not quote these messages as they are now:\n{stale}"


def test_docs_site_builds_strictly(tmp_path: pathlib.Path) -> None:
    """Broken links, anchors and API references (mkdocstrings) fail ``mkdocs build --strict``."""
    pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "--site-dir", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": pythonpath(ROOT)},
        timeout=_MKDOCS_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert (tmp_path / "site" / "reference" / "psclient" / "index.html").exists()


def test_docs_cli_reference_is_the_commands_own_help() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_cli_docs.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=_MKDOCS_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_docs_readme_links_point_at_files() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert targets
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_docs_readme_quick_start_is_what_ci_runs() -> None:
    """The README's second quick-start command and ``.ci/run`` install the same extras and run pytest."""
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start") : readme.index("\n## ", readme.index("## Quick start") + 5)]
    commands = re.findall(r"```bash\n(.+?)\n```", quick)
    venv = "python3 -m venv .venv && . .venv/bin/activate && "
    assert commands == [
        venv + 'pip install -e ".[tf]" && pstrain demo',
        venv + 'pip install -e ".[dev,tf,load]" && python -m pytest',
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv .venv\n. .venv/bin/activate\n" in ci
    assert 'pip install -q -e ".[dev,tf,load]"\n' in ci
    assert "python -m pytest -q -p no:cacheprovider" in ci


@pytest.mark.tf
@pytest.mark.e2e
def test_docs_readme_keras_example_trains(tmp_path: pathlib.Path) -> None:
    """The README's ten-line Keras script, run by the README's own ``pstrain launch`` command (one worker
    instead of two, to spare the suite a second TensorFlow process)."""
    (block,) = [b for b in python_blocks() if b.mark == "launch"]
    (tmp_path / "train.py").write_text(block.code)
    readme = (ROOT / "README.md").read_text()
    (command,) = re.findall(r"^pstrain launch .* -- python train\.py$", readme, re.M)
    args = shlex.split(command.replace("--workers 2", "--workers 1"))
    assert args[:2] == ["pstrain", "launch"] and "--workers" in args
    # `pstrain` is `python -m trainer`; this checkout's, not an installed one's
    argv = [sys.executable, "-m", "trainer", *(sys.executable if a == "python" else a for a in args[1:])]
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": pythonpath(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"},
        timeout=_LAUNCH_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Epoch 2/2" in proc.stdout, proc.stdout[-3000:]
