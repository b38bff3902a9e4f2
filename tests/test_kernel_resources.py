"""tools/kernel_resources.py: the op's Triton kernels found under the interpreter and compiled
offline for sm_90 with Triton's bundled ptxas (CPU only, real compiles in a fresh Triton cache)."""
from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
import yaml

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENT = ROOT / "experiments" / "pkda-aa.yaml"
SHAPE = "dense_K64_V128"  # pkda-aa's fixture shape: K != V, one chunk and a partial one (T=100)

# loaded by path here, not through tests/tool_module.py: the tool's binding subprocess imports this
# file to find the kernels defined in it, without tests/ on its path
spec = importlib.util.spec_from_file_location("kernel_resources", ROOT / "tools" / "kernel_resources.py")
kr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kr)


@triton.jit
def trivial_kernel(x, y, n, scale, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(y + o, tl.load(x + o, mask=m) * scale, mask=m)


@triton.jit
def hungry_kernel(x, y, N: tl.constexpr):
    # eight [N] rows live at once: at N=1024 on one warp that is 8 x 32 fp32 a thread, more
    # than the 255 registers a thread can have, so ptxas must spill
    o = tl.arange(0, N)
    a0 = tl.load(x + o)
    a1 = tl.load(x + N + o)
    a2 = tl.load(x + 2 * N + o)
    a3 = tl.load(x + 3 * N + o)
    a4 = tl.load(x + 4 * N + o)
    a5 = tl.load(x + 5 * N + o)
    a6 = tl.load(x + 6 * N + o)
    a7 = tl.load(x + 7 * N + o)
    s = a0 * a1 * a2 * a3 * a4 * a5 * a6 * a7
    tl.store(y + o, s / a0 + s / a1 + s / a2 + s / a3 + s / a4 + s / a5 + s / a6 + s / a7)


def launch(kernel, *args, **kwargs) -> dict:
    """A launch as the discover step records it (the kernel object is a JITFunction, or an
    InterpretedFunction under TRITON_INTERPRET=1: either way its .fn is the Python function)."""
    fn = kernel.fn
    return {"kernel": fn.__qualname__, "module": fn.__module__, "file": inspect.getsourcefile(fn),
            "args": [kr.describe(a) for a in args], "kwargs": {k: kr.describe(v) for k, v in kwargs.items()}}


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    """A fresh Triton cache: every kernel is really compiled (ptxas runs), none comes from disk."""
    return {"TRITON_CACHE_DIR": str(tmp_path_factory.mktemp("triton-cache"))}


@pytest.fixture(scope="module")
def pkda_run(tmp_path_factory, cache_env):
    """The CLI on one small shape, fwd+bwd, bf16, every kernel, with --json."""
    out = tmp_path_factory.mktemp("out") / "resources.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", cache_env["TRITON_CACHE_DIR"])
        rc = kr.main([str(EXPERIMENT), "--shape", SHAPE, "--mode", "fwd+bwd", "--dtype", "bfloat16",
                      "--json", str(out)])
    return rc, json.loads(out.read_text())


def test_every_kernel_of_the_op_compiles_for_sm90(pkda_run):
    rc, result = pkda_run
    assert rc == 0, result["errors"]
    assert result["errors"] == []
    records = result["records"]
    assert records and all("error" not in r for r in records)
    assert all(r["registers"] > 0 for r in records)
    assert all(r["shape"] == SHAPE and r["dtype"] == "bfloat16" for r in records)
    kernels = {r["kernel"] for r in records}
    # forward and backward: the backward's recompute and its own kernels are found (at K <= 128 the
    # forward's o comes from the state walk, pkda_fwd_h_o_kernel; fwd_h runs in the recompute)
    assert {"pkda_fwd_l2norm_kernel", "pkda_fwd_intra_a_kernel", "pkda_fwd_solve_kernel", "pkda_fwd_h_o_kernel",
            "pkda_fwd_h_kernel", "pkda_bwd_intra_kernel", "pkda_bwd_wy_dqkg_kernel",
            "pkda_bwd_l2norm_kernel"} <= kernels
    h = result["header"]
    assert h["triton"] == triton.__version__ and h["arch"] == 90 and h["ptxas"]
    assert h["unique_compiles"] <= len(records)


def test_autotune_spaces_are_whole_not_the_interpreters_first_config(pkda_run):
    _, result = pkda_run
    def warps(name):
        return sorted(r["config"]["num_warps"] for r in result["records"] if r["kernel"] == name)

    assert warps("pkda_bwd_intra_kernel") == [2, 4]           # PKDA_BWD_INTRA_WARPS's default space
    assert warps("pkda_fwd_intra_a_kernel") == [2, 4]         # (4,1), (2,1)
    h = sorted((r["config"]["num_warps"], r["config"]["num_stages"], r["config"]["kwargs"]["BV"])
               for r in result["records"] if r["kernel"] == "pkda_fwd_h_kernel")
    assert h == [(4, 2, "32"), (4, 2, "64"), (8, 2, "64")]   # warps, stages and a kwarg per config
    from kernels.pkda.fwd import HO_SPACE  # the fused walk's whole space
    ho = sorted((r["config"]["num_warps"], r["config"]["num_stages"], r["config"]["kwargs"]["BV"])
                for r in result["records"] if r["kernel"] == "pkda_fwd_h_o_kernel")
    assert ho == sorted((w, s, str(meta["BV"])) for meta, w, s in HO_SPACE) and len(ho) >= 3
    atk = [r for r in result["records"] if r["kernel"] == "pkda_fwd_atk_local_kernel"]
    # a config's kwargs are constexprs; the whole space under each launch variant (STORE_FLAGS:
    # the forward's launch and the backward's recompute)
    for flags in {r["constexprs"].get("STORE_FLAGS") for r in atk}:
        assert sorted(r["config"]["kwargs"]["BK"] for r in atk
                      if r["constexprs"].get("STORE_FLAGS") == flags) == ["32", "64"]
    assert all(r["constexprs"]["BK"] == r["config"]["kwargs"]["BK"] for r in atk)
    # a kernel launched without @triton.autotune keeps the launch's options (l2norm: num_warps=4)
    assert all(r["config"]["num_warps"] == 4 and not r["autotuned"]
               for r in result["records"] if r["kernel"] == "pkda_fwd_l2norm_kernel")


def test_launch_variants_and_the_table(pkda_run):
    _, result = pkda_run
    atk = [r for r in result["records"] if r["kernel"] == "pkda_fwd_atk_kernel"]
    assert {r["constexprs"]["STORE_A"] for r in atk} == {"True", "False"}  # forward and the backward's recompute
    text = kr.format_table(result)
    assert SHAPE in text and "pkda_bwd_intra_kernel" in text
    assert "STORE_A=True" in text and "STORE_A=False" in text


def test_an_env_knob_of_the_op_is_respected(cache_env):
    """PKDA_BWD_INTRA_WARPS is read when kernels/pkda/bwd.py is imported: both steps see it."""
    result = kr.measure(EXPERIMENT, [SHAPE], env={**cache_env, "PKDA_BWD_INTRA_WARPS": "8"},
                        kernel="pkda_bwd_intra_kernel")
    assert result["errors"] == []
    assert [r["config"]["num_warps"] for r in result["records"]] == [8]
    assert result["header"]["env"]["PKDA_BWD_INTRA_WARPS"] == "8"


def test_a_register_hungry_kernel_spills_and_a_trivial_one_does_not(cache_env):
    x = torch.empty(8 * 1024, dtype=torch.float32)
    launches = [launch(trivial_kernel, x, x, 1000, 0.5, BLOCK=256, num_warps=4),
                launch(hungry_kernel, x, x, N=1024, num_warps=1, num_stages=1)]
    out = kr.compile_launches(launches, cache_env)
    trivial, hungry = sorted(out["results"], key=lambda r: r["launch"])
    assert "error" not in trivial and "error" not in hungry
    assert trivial["registers"] > 0 and not trivial["spills"]
    assert trivial["stack_bytes"] == trivial["local_bytes"] == trivial["spill_stores"] == trivial["spill_loads"] == 0
    # ptxas puts the spill slots in the stack frame (cuobjdump's LOCAL stays 0 on this toolchain)
    assert hungry["spills"] and hungry["registers"] >= 200
    assert hungry["stack_bytes"] > 0 and hungry["spill_stores"] > 0 and hungry["spill_loads"] > 0
    assert trivial["config"]["num_warps"] == 4 and hungry["config"]["num_warps"] == 1


@triton.jit
def shared_hungry_kernel(x, y, N: tl.constexpr):
    # a loop of [N, N] fp32 dots: software pipelining stages each iteration's two operand tiles in
    # shared memory, 2 x 64 KB a stage at N=128, so three stages need more than a block may have
    o = tl.arange(0, N)
    tile = o[:, None] * N + o[None, :]
    acc = tl.zeros([N, N], dtype=tl.float32)
    for i in range(4):
        acc += tl.dot(tl.load(x + i * N * N + tile), tl.load(y + i * N * N + tile), input_precision="ieee")
    tl.store(x + tile, acc)


def test_a_config_over_the_shared_memory_a_block_may_have_is_flagged(cache_env):
    x = torch.empty(4 * 128 * 128, dtype=torch.float32)
    launches = [launch(shared_hungry_kernel, x, x, N=128, num_warps=4, num_stages=3),
                launch(shared_hungry_kernel, x, x, N=32, num_warps=4, num_stages=1),
                launch(trivial_kernel, x, x, 1000, 0.5, BLOCK=256, num_warps=4)]
    out = sorted(kr.compile_launches(launches, cache_env)["results"], key=lambda r: r["launch"])
    hungry, small, trivial = out
    assert [r.get("error") for r in out] == [None] * 3
    assert hungry["shared_bytes"] > kr.SM90_MAX_SHARED_PER_BLOCK and hungry["over_shared"]
    assert 0 < small["shared_bytes"] <= kr.SM90_MAX_SHARED_PER_BLOCK and not small["over_shared"]
    assert not trivial["over_shared"]
    table = kr.format_table({"header": {"experiment": "x.yaml", "op": "op", "worktree": ".", "mode": "fwd",
                                        "dtype": "float32", "side": "baseline", "env": {}, "arch": 90,
                                        "unique_compiles": 3, "total_s": 0.0},
                             "records": [{**r, "shape": "s", "launches": 1} for r in out], "errors": []})
    rows = [line for line in table.splitlines() if line.startswith(("shared_hungry_kernel", "trivial_kernel"))]
    assert len(rows) == 3 and sum("OVER SHARED" in line for line in rows) == 1


def test_integer_and_pointer_specialisation_follows_the_launcher(cache_env):
    x = torch.empty(4096, dtype=torch.bfloat16)
    launches = [launch(trivial_kernel, x, x, 1024, 0.5, BLOCK=256),    # n % 16 == 0: divisible
                launch(trivial_kernel, x, x[1:], 1000, 0.5, BLOCK=256),  # y 2 bytes off: not aligned
                launch(trivial_kernel, x, x, 1, 0.5, BLOCK=256)]         # n == 1: a constexpr
    out = sorted(kr.compile_launches(launches, cache_env)["results"], key=lambda r: r["launch"])
    assert [r.get("error") for r in out] == [None] * 3
    assert out[0]["divisible16"] == ["n", "x", "y"] and out[0]["signature"]["x"] == "*bf16"
    assert out[1]["divisible16"] == ["x"] and out[1]["signature"]["n"] == "i32"
    assert out[2]["constexprs"]["n"] == "1" and out[2]["signature"]["n"] == "constexpr"
    assert out[0]["signature"]["scale"] == "fp32"
    assert out[0]["config"]["num_stages"] == 3  # Triton's CUDA default when the launch gives none


@pytest.fixture(scope="module")
def fp32_d256_run(tmp_path_factory, cache_env):
    """pkda-aa's experiment with one more fixture shape, K = V = 256, compiled in fp32: the widest
    head dims at the widest dtype the op takes."""
    exp = yaml.safe_load(EXPERIMENT.read_text())
    exp["target"]["repo"] = str(ROOT)
    exp["target"]["inputs"] = str(EXPERIMENT.parent / exp["target"]["inputs"])
    exp["fixture_shapes"].append({"name": "dense_K256_V256", "B": 1, "T": 130, "H": 2, "K": 256, "V": 256})
    path = tmp_path_factory.mktemp("exp") / "pkda-aa-d256.yaml"
    path.write_text(yaml.safe_dump(exp, sort_keys=False))
    return kr.measure(path, ["dense_K256_V256"], dtype="float32", env=cache_env, worktree=ROOT)


def test_every_kernel_has_a_config_that_fits_hoppers_shared_memory_in_fp32_at_d256(fp32_d256_run):
    """An autotuner whose every config needs more shared memory than a block may have raises
    OutOfResources at the launch, on the GPU only (the interpreter has no shared memory): the op
    did so in fp32 at K = V = 256 on an H100 (2026-12-07, pkda_fwd_h_kernel's two-stage configs at
    280-297 KB). Each launch variant of each kernel needs one config that fits."""
    result = fp32_d256_run
    assert result["errors"] == [] and result["records"]
    assert all("error" not in r for r in result["records"])
    smallest: dict[tuple, int] = {}
    for r in result["records"]:
        variant = tuple(sorted((k, v) for k, v in r["constexprs"].items() if k not in r["config"]["kwargs"]))
        key = (r["kernel"], variant)
        smallest[key] = min(smallest.get(key, r["shared_bytes"]), r["shared_bytes"])
        assert r["over_shared"] == (r["shared_bytes"] > kr.SM90_MAX_SHARED_PER_BLOCK)
    too_big = {k: v for k, v in smallest.items() if v > kr.SM90_MAX_SHARED_PER_BLOCK}
    assert not too_big, f"no config fits {kr.SM90_MAX_SHARED_PER_BLOCK} B of shared memory: {too_big}"
    # the state passes and the backward intra kernel (whichever variant runs at K = 256) were found
    found = {k for k, _ in smallest}
    assert all(any(k.startswith(prefix) for k in found)
               for prefix in ("pkda_fwd_h_", "pkda_bwd_dhu_", "pkda_bwd_intra_kernel"))
