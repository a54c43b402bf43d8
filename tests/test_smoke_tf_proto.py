"""psproto.v1's generated code and TensorFlow load in one process (catches protobuf gencode/runtime skew,
grpc/grpc#39912, tensorflow/tensorboard#5708)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.tf, pytest.mark.timeout(240)]

_SCRIPT = """
import google.protobuf
from psproto.v1 import collective_pb2, collective_pb2_grpc, ps_pb2, ps_pb2_grpc
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2
import psclient
from pscore import codec
import numpy as np

chunk = codec.encode("w", np.arange(6, dtype=np.float32).reshape(2, 3))
again = ps_pb2.TensorChunk.FromString(chunk.SerializeToString())
assert (codec.decode(again) == tf.reshape(tf.range(6, dtype=tf.float32), (2, 3)).numpy()).all()
proto = tf.make_tensor_proto(np.ones(2, np.float32))
assert tensor_pb2.TensorProto.FromString(proto.SerializeToString()) == proto
print("ok", tf.__version__, google.protobuf.__version__)
"""


def test_smoke_tf_and_psproto_import_together() -> None:
    # A fresh interpreter: the order of imports matters, and pytest may already have loaded protobuf.
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.startswith("ok"), out.stdout
