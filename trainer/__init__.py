"""trainer: runnable training entry points (``pstrain``), data pipelines and the local cluster launcher."""
