"""Triton's autotune disk cache json-encodes the tuning key; a tl.dtype in the key (the PKDA
backward's DT) made every fwdbwd call fail on the H200 once the harness turned the cache on."""
from __future__ import annotations

import json

import pytest
import triton.language as tl
from triton.runtime import autotuner

from harness.triton_autotune_cache import make_autotune_cache_serialisable


def test_plain_json_cannot_write_a_dtype_key():
    with pytest.raises(TypeError):
        json.dumps({"key": (16, 128, tl.bfloat16)})


def test_patched_autotuner_writes_and_reads_a_dtype_key(monkeypatch, tmp_path):
    monkeypatch.setattr(autotuner, "json", json)
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    assert make_autotune_cache_serialisable() is False and autotuner.json is json
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "1")
    assert make_autotune_cache_serialisable() is True
    assert make_autotune_cache_serialisable() is True  # idempotent
    text = autotuner.json.dumps({"key": (16, 128, tl.bfloat16, "torch.bfloat16"),
                                 "configs_timings": [({"num_warps": 4}, [0.5])]})
    path = tmp_path / "k.autotune.json"
    path.write_text(text)
    with open(path) as f:
        back = autotuner.json.load(f)
    assert back["key"][2] == str(tl.bfloat16) and back["configs_timings"] == [[{"num_warps": 4}, [0.5]]]
    assert json.dumps is not autotuner.json.dumps  # the process-wide json module is untouched
