"""Make Triton's on-disk autotune cache work for kernels whose tuning key holds a dtype.

The harness turns on `TRITON_CACHE_AUTOTUNING=1` in every side's worker (harness/measure/sides.py)
so a fresh block process does not benchmark every config again. Triton (3.6 and 3.7) then writes
`{"key": tuning_key, ...}` with json.dumps, and a key that holds a `tl.dtype` constexpr (our
PKDA backward keys its kernels on DT) raises TypeError after the benchmark, inside the op's call:
on the H200 that made every fwdbwd case of a correct baseline fail. The key in that file is only
informational (the cache is addressed by a SHA-256 of str(tuning_key)), so the harness gives
Triton's autotuner module a json whose dumps writes what it cannot encode as str(). Nothing a
kernel computes or which config wins changes. Called by the workers before the op is imported.
"""
from __future__ import annotations

import json
import os
import types


def _dumps(obj, **kw):
    kw.setdefault("default", str)
    return json.dumps(obj, **kw)


def make_autotune_cache_serialisable() -> bool:
    """Patch triton.runtime.autotuner's json when autotune caching is on; True if patched."""
    if os.environ.get("TRITON_CACHE_AUTOTUNING", "0") in ("", "0", "false", "False"):
        return False
    try:
        from triton.runtime import autotuner
    except Exception:  # noqa: BLE001 - no Triton here: nothing to patch
        return False
    if getattr(autotuner.json, "_harness_str_default", False):
        return True
    shim = types.SimpleNamespace(**{n: getattr(json, n) for n in ("load", "loads", "dump", "JSONDecodeError")})
    shim.dumps = _dumps
    shim._harness_str_default = True
    autotuner.json = shim
    return True
