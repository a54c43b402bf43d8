"""Horovod's gradient compression: ``Compression.none`` and ``Compression.fp16`` (cast around the ring)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class Compressor:
    """Interface: ``compress(t) -> (t, ctx)`` before the all-reduce, ``decompress(t, ctx)`` after."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes); the result is cast back."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        dtype = tensor.dtype
        if dtype.is_floating and dtype != tf.float16:
            return tf.cast(tensor, tf.float16), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """The compressors by name, as in Horovod: ``Compression.none``, ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
