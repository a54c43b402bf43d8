"""Table export for serving: ``export`` (both clients), the ScanRows RPC, and ``psctl export``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _support import CALL_TIMEOUT_S as TIMEOUT_S

import psclient
from pscore.embedding import hash_keys
from pscore.placement import dynamic_row_shard
from psproto.v1 import ps_pb2

pytestmark = [pytest.mark.timeout(120)]


def _batches(c: psclient.PSClient, name: str, batch_rows: int) -> list[tuple[np.ndarray, np.ndarray]]:
    out = list(c.export(name, batch_rows=batch_rows))
    assert all(1 <= ids.size <= batch_rows and rows.shape == (ids.size, rows.shape[1]) for ids, rows in out)
    return out


def test_a_fixed_table_exports_every_row_once_shard_by_shard_in_id_order(
    client: psclient.PSClient, var_name: str
) -> None:
    client.create_embedding(var_name, 1001, 4, optimizer=psclient.SGD(1.0))
    client.push({var_name: psclient.Rows([3, 1000, 3], np.ones((3, 4), np.float32))})
    batches = _batches(client, var_name, 64)
    ids = np.concatenate([i for i, _ in batches])
    rows = np.concatenate([r for _, r in batches])
    shard = ids % 2
    assert (np.diff(shard) >= 0).all()  # shard 0's rows, then shard 1's
    for s in (0, 1):
        assert (np.diff(ids[shard == s]) > 0).all()
    np.testing.assert_array_equal(np.sort(ids), np.arange(1001))
    np.testing.assert_array_equal(rows, client.lookup(var_name, ids))  # the pushed rows as trained


def test_a_dynamic_table_exports_the_ids_that_have_a_row(client: psclient.PSClient, var_name: str) -> None:
    client.create_embedding(var_name, None, 3, optimizer=psclient.SGD(1.0), capacity=300, min_count=2)
    rng = np.random.default_rng(0)
    pushed = rng.integers(-(2**62), 2**62, size=500)
    for _ in range(2):  # admitted on the second push; 500 ids for a capacity of 300: some evicted
        for part in np.array_split(pushed, 5):
            client.push({var_name: psclient.Rows(part, np.ones((part.size, 3), np.float32))})
    infos = client.list_variables([var_name])[var_name]
    held = sum(i.dynamic.rows for i in infos)
    assert 0 < held <= 300 and sum(i.dynamic.evicted for i in infos) > 0
    batches = _batches(client, var_name, 50)
    ids = np.concatenate([i for i, _ in batches])
    rows = np.concatenate([r for _, r in batches])
    assert ids.size == held == np.unique(ids).size and np.isin(ids, pushed).all()
    shard = dynamic_row_shard(ids, 2)
    assert (np.diff(shard) >= 0).all()
    for s in (0, 1):
        assert (np.diff(ids[shard == s]) > 0).all()
    np.testing.assert_array_equal(rows, client.lookup(var_name, ids))
    assert not np.isin(pushed, ids).all()  # the evicted ones are not exported
    with pytest.raises(psclient.NotFoundError):
        list(client.export(var_name + "-missing"))
    client.create(var_name + "-dense", np.zeros(3, np.float32))
    with pytest.raises(psclient.InvalidArgumentError, match="is not an embedding table"):
        list(client.export(var_name + "-dense"))


async def test_the_async_client_exports_a_string_keyed_table_by_hashed_ids(
    async_client: psclient.AsyncPSClient, var_name: str
) -> None:
    await async_client.create_embedding(var_name, None, 2, key_type="string", initializer="zeros")
    keys = [f"user:{i}" for i in range(30)]
    await async_client.push({var_name: psclient.Rows(keys, np.ones((30, 2), np.float32))})
    got = [b async for b in async_client.export(var_name, batch_rows=7)]
    ids = np.concatenate([i for i, _ in got])
    np.testing.assert_array_equal(np.sort(ids), np.sort(hash_keys(keys)))
    np.testing.assert_array_equal(np.concatenate([r for _, r in got]), np.full((30, 2), -0.01, np.float32))


def test_scan_rows_refuses_bad_requests(
    client: psclient.PSClient, raw_stubs: list[Any], var_name: str
) -> None:
    client.create(var_name, np.zeros(3, np.float32))  # on one of the shards
    client.create_embedding(var_name + "t", 5, 2)

    def errors(request: ps_pb2.ScanRowsRequest) -> set[tuple[grpc.StatusCode, str]]:
        out = set()
        for stub in raw_stubs:
            with pytest.raises(grpc.RpcError) as err:
                stub.ScanRows(request, timeout=TIMEOUT_S)
            out.add((err.value.code(), err.value.details().partition(": ")[2]))
        return out

    assert {code for code, _ in errors(ps_pb2.ScanRowsRequest(name="nope/rows_0"))} == {
        grpc.StatusCode.NOT_FOUND
    }
    not_table = errors(ps_pb2.ScanRowsRequest(name=var_name))
    assert (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"ScanRows: variable {var_name!r} is not an embedding table piece",
    ) in not_table
    with pytest.raises(grpc.RpcError) as err:
        raw_stubs[0].ScanRows(
            ps_pb2.ScanRowsRequest(name=f"{var_name}t/rows_0", max_rows=-1), timeout=TIMEOUT_S
        )
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "max_rows -1 is negative" in err.value.details()
    )
    # A page past the last id is empty and done; one from the middle starts after it.
    last = raw_stubs[1].ScanRows(
        ps_pb2.ScanRowsRequest(name=f"{var_name}t/rows_1", after=3), timeout=TIMEOUT_S
    )
    assert last.done and last.rows == 2
    middle = raw_stubs[0].ScanRows(
        ps_pb2.ScanRowsRequest(name=f"{var_name}t/rows_0", after=1, max_rows=1), timeout=TIMEOUT_S
    )
    assert not middle.done and middle.values[0].data == np.array([2], "<i8").tobytes()


def _psctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "psclient.ctl", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S * 2,
        check=False,
    )


def test_psctl_export_writes_npy_files_with_progress(
    client: psclient.PSClient, var_name: str, tmp_path: Path
) -> None:
    client.create_embedding(var_name, 300, 8, initializer="normal")
    client.push({var_name: psclient.Rows([5, 299], np.ones((2, 8), np.float32))})
    out = tmp_path / "export"
    proc = _psctl(
        "export", var_name, *client.config.addresses, "--out", str(out), "--batch-rows", "40",
        "--progress-every", "0",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "exported" in proc.stdout and "300 rows of 8 float32" in proc.stdout
    progress = [line for line in proc.stderr.splitlines() if line.startswith(f"export {var_name}:")]
    assert len(progress) == 8 and progress[-1].startswith(f"export {var_name}: 300 / 300 rows (100%)")
    ids, rows = np.load(out / "ids.npy"), np.load(out / "rows.npy")
    assert ids.dtype == np.int64 and rows.shape == (300, 8) and rows.dtype == np.float32
    np.testing.assert_array_equal(rows, client.lookup(var_name, ids))
    np.testing.assert_array_equal(np.sort(ids), np.arange(300))
    meta = json.loads((out / "table.json").read_text())
    assert meta["rows"] == 300 and meta["kind"] == "fixed" and meta["num_rows"] == 300
    assert sorted(p.name for p in out.iterdir()) == ["ids.npy", "rows.npy", "table.json"]
    missing = _psctl("export", var_name + "-missing", *client.config.addresses, "--out", str(tmp_path / "m"))
    assert missing.returncode == 1 and "no table" in missing.stderr
    assert not any((tmp_path / "m").glob("*.npy"))
