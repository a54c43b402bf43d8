"""Hatch build hook: generates psproto/ from protos/ before a wheel (or editable install) is built."""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class ProtoBuildHook(BuildHookInterface):  # type: ignore[misc]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        script = pathlib.Path(self.root) / "scripts" / "gen_protos.py"
        spec = importlib.util.spec_from_file_location("gen_protos", script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.generate(pathlib.Path(self.root))
