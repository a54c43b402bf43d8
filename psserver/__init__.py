"""psserver: one parameter-server shard (asyncio gRPC on uvloop). Never imports TensorFlow."""
