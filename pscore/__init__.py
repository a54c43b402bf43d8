"""pscore: the TensorFlow-free core that both sides of paramserver import.

``psserver`` (the shards) and ``psclient`` (the workers) never import each other; what
they must agree on lives here, once:

- ``codec``: the wire framing (tensors as raw little-endian bytes, zero-copy chunks, the
  one chunker and assembler);
- ``errors``: the exception tree and the one gRPC status <-> exception table;
- ``security``: auth-token and TLS credentials and the server-side interceptors;
- ``transport``: the one ``FrameTransport`` interface (the ring's and the shards' data paths)
  and the raw-TCP pieces: nonce-guarded data ports, connections, TLS;
- ``bulk``: the frames of the shards' data port (big pulls and pushes without gRPC);
- ``optimizers``: the optimizer specs a worker sends and a shard builds from;
- ``placement``: which shard holds which variable or row partition;
- ``embedding``: embedding-table wire names and deterministic row initializers;
- ``tf_config``: reading ``TF_CONFIG`` (Kubeflow / TensorFlow cluster specs);
- ``memory``: glibc malloc tuning for large transfers.

Imports numpy, grpc and protobuf only.
"""
