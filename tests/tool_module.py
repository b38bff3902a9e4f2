"""A script under tools/ loaded as a module for its tests (tools/ is no package: its files run as
scripts on the device machine)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py, executed once per call as a fresh module named `name`."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
