"""ModelSpec: the synthetic model a load test pushes, parsed from ``COUNTxSIZE[,COUNTxSIZE...]``."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
          "g": 10**9, "gb": 10**9, "gib": 1 << 30}  # fmt: skip
_ITEM = re.compile(r"^\s*(?:(\d+)\s*[x*]\s*)?(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_ITEMSIZE = 4  # float32


def parse_size(text: str) -> int:
    """``"1MiB"`` -> 1048576; ``"64k"`` -> 64000; a bare number is bytes.

    Raises:
        ValueError: not a size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 4096, 64KiB, 1MiB, 2.5MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Variables of a synthetic float32 model: ``sizes[i]`` is variable i's size in bytes."""

    sizes: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """Parses ``"8x1MiB"``, ``"4x256KiB,1x16MiB"`` or ``"1MiB"`` (count 1).

        Raises:
            ValueError: malformed text, or a variable smaller than one float32.
        """
        sizes: list[int] = []
        for item in text.split(","):
            m = _ITEM.match(item)
            if not m:
                raise ValueError(f"model spec item {item!r} is not COUNTxSIZE (e.g. 8x1MiB)")
            count = int(m.group(1) or 1)
            size = parse_size(m.group(2) + m.group(3))
            if count < 1 or size < _ITEMSIZE:
                raise ValueError(f"model spec item {item!r}: need count >= 1 and size >= {_ITEMSIZE} bytes")
            sizes.extend([size - size % _ITEMSIZE] * count)
        return cls(tuple(sizes))

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def shapes(self) -> list[tuple[int]]:
        """1-D float32 shapes of the variables, in order."""
        return [(s // _ITEMSIZE,) for s in self.sizes]

    def names(self, prefix: str = "psload") -> list[str]:
        """Variable names; they carry the size, so specs of different runs never collide."""
        return [f"{prefix}/v{i}_{s // _ITEMSIZE}" for i, s in enumerate(self.sizes)]

    def describe(self) -> str:
        counts: dict[int, int] = {}
        for s in self.sizes:
            counts[s] = counts.get(s, 0) + 1
        return ",".join(f"{n}x{_human(s)}" for s, n in counts.items())


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"
