"""A @triton.jit function may read a module global only if it is a tl.constexpr: a real GPU
compile rejects plain ints ("Cannot access global variable"), while the CPU interpreter accepts
them, so CPU tests alone would never see it. This scan catches it on CPU."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNEL_FILES = sorted((Path(__file__).resolve().parent.parent / "kernels").rglob("*.py"))


def non_constexpr_globals(path: Path) -> list[str]:
    src = path.read_text()
    tree = ast.parse(src)
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = ast.get_source_segment(src, node.value) or ""
    found = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        if not any("jit" in (ast.get_source_segment(src, d) or "") for d in node.decorator_list):
            continue
        # the body only: decorators (an autotune space) and defaults are evaluated by Python at
        # import, not compiled by Triton
        body = [n for stmt in node.body for n in ast.walk(stmt)]
        local = {a.arg for a in node.args.args}
        for n in body:
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                local.add(n.id)
        for n in body:
            if (isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local
                    and n.id in values and "constexpr" not in values[n.id]):
                found.append(f"{path.name}:{n.lineno} {node.name} reads global {n.id} = {values[n.id]}")
    return found


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_jit_functions_read_only_constexpr_globals(path):
    assert non_constexpr_globals(path) == []


def test_the_scan_finds_a_plain_int_global(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import triton\nBT = 64\n\n@triton.jit\ndef k(x):\n    return x + BT\n")
    assert non_constexpr_globals(bad) == ["bad.py:6 k reads global BT = 64"]


def test_a_global_in_the_decorators_is_python_not_triton(tmp_path):
    """An autotune space named in @triton.autotune(...) is read at import, outside the kernel:
    not a finding; the same name read in the body still is."""
    src = ("import triton\nSPACE = [1, 2]\n\n@triton.autotune(configs=SPACE, key=[])\n@triton.jit\n"
           "def k(x):\n    return x\n\n@triton.jit\ndef j(x):\n    return x + SPACE[0]\n")
    f = tmp_path / "deco.py"
    f.write_text(src)
    assert non_constexpr_globals(f) == ["deco.py:11 j reads global SPACE = [1, 2]"]
