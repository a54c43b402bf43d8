"""Worker A creates a 16-variable batch (256 KiB each, cut at 64 KiB) on 8 local shards, its creates on shards
4-7 held back 1 s (a slow link); worker B creates the same batch 0.3 s after A began. Then: pieces on two
shards, and each shard's bytes. PYTHONPATH=TREE python race2.py."""

import asyncio
import collections
import threading
import time

import grpc
import numpy as np

import psclient
from psproto.v1 import ps_pb2, ps_pb2_grpc
from trainer.cluster import LocalCluster

with LocalCluster(num_shards=8) as cluster:
    batch = {f"v{i:02d}": np.zeros(65536, np.float32) for i in range(16)}

    def a() -> None:
        with psclient.PSClient(cluster.addresses, worker_id="w0") as c:
            for s in range(4, 8):
                shard = c._async._shards[s]
                orig = shard.unary_stream

                async def slow(*args, _orig=orig, **kw):
                    await asyncio.sleep(1.0)
                    return await _orig(*args, **kw)

                shard.unary_stream = slow
            c.create_many(batch, optimizer=psclient.SGD(learning_rate=0.0))

    def b() -> None:
        with psclient.PSClient(cluster.addresses, worker_id="w1") as c:
            time.sleep(0.3)
            c.create_many(batch, optimizer=psclient.SGD(learning_rate=0.0))

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    where = collections.defaultdict(list)
    per_shard = [0] * 8
    for s, addr in enumerate(cluster.addresses):
        with grpc.insecure_channel(addr) as ch:
            resp = ps_pb2_grpc.ParameterServerStub(ch).ListVariables(
                ps_pb2.ListVariablesRequest(), timeout=30
            )
        for info in resp.variables:
            where[info.spec.name].append(s)
            per_shard[s] += int(np.prod(info.spec.shape)) * 4
    twice = {n: s for n, s in where.items() if len(s) > 1}
    print("pieces", len(where), "on two or more shards", len(twice), sorted(twice.items())[:4])
    print("bytes a shard (KiB)", [x >> 10 for x in per_shard])
