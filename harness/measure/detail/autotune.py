"""Which config each Triton autotuner of a process chose, and where the workers of a run disagree.

A worker reads its process's choices after preparing a row (worker.py) and reports those it has not
reported before (`NewChoices`: a key is tuned once a process, so a row's record holds what preparing
it tuned), the driver records them per worker and row (model.py `RowPrepared`), and the report lists
every kernel and tuning key on which workers chose differently. Why: the sides of a comparison
share one Triton cache (sides.py), so a worker normally finds its side's configs tuned by the row's
first worker; a config chosen anew in
some process (a cache miss, near-equal configs, a space a side changed) changes the code that is
timed, and the interval cannot tell it from the candidate's own effect.

Only autotuners with a choice are seen: Triton keeps a tuned config per key in `Autotuner.cache`
when its space has more than one config (a one-config space is used as is, and so is every space
under the CPU interpreter, which cannot benchmark).
"""
from __future__ import annotations

import sys
from collections import defaultdict

# a decorated kernel may be wrapped in further layers (heuristics over autotune, or the reverse)
_MAX_WRAPPING = 4


def _autotuners(obj):
    """The autotuners in a kernel object's wrapping. Only Triton's kernel objects are unwrapped:
    reading `.fn` of anything else can run code (a ctypes library opens a library of that name)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    for _ in range(_MAX_WRAPPING):
        if not isinstance(obj, KernelInterface):
            return
        if isinstance(obj, Autotuner):
            yield obj
        obj = getattr(obj, "fn", None)


def chosen_configs() -> dict[str, dict[str, str]]:
    """{module.kernel: {tuning key: config}} over every autotuner that module attributes of this
    process hold and that has tuned a key; {} when Triton is not imported."""
    if "triton" not in sys.modules:
        return {}
    found: dict[str, dict[str, str]] = {}
    seen: set[int] = set()
    for module_name, module in list(sys.modules.items()):
        attrs = getattr(module, "__dict__", None)
        if not attrs or module_name.startswith(("triton.", "torch.")):
            continue
        for attr, value in list(attrs.items()):
            for tuner in _autotuners(value):
                if id(tuner) in seen or not getattr(tuner, "cache", None):
                    continue
                seen.add(id(tuner))
                name = f"{module_name}.{getattr(getattr(tuner, 'base_fn', None), '__name__', attr)}"
                found[name] = {str(key): str(config) for key, config in tuner.cache.items()}
    return found


class NewChoices:
    """What a process's autotuners chose since it last asked (the first call: everything so far)."""

    def __init__(self) -> None:
        self.reported: dict[tuple[str, str], str] = {}

    def __call__(self) -> dict[str, dict[str, str]]:
        new: dict[str, dict[str, str]] = {}
        for kernel, keys in chosen_configs().items():
            for key, config in keys.items():
                if self.reported.get((kernel, key)) != config:
                    self.reported[(kernel, key)] = config
                    new.setdefault(kernel, {})[key] = config
        return new


def disagreements(choices: list[tuple[str, dict[str, dict[str, str]]]]) -> list[dict]:
    """Per (kernel, key) that workers chose differently: {kernel, key, by_side: {side: {config:
    workers}}}. `choices`: (side, {kernel: {key: config}}) of each worker, everything it reported over
    the run. A kernel or key that only some workers tuned (another side's code, a row prepared only
    by some) is no disagreement."""
    seen: dict[tuple[str, str], dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    for side, kernels in choices:
        for kernel, keys in kernels.items():
            for key, config in keys.items():
                seen[(kernel, key)][side][config] += 1
    out = []
    for (kernel, key), by_side in sorted(seen.items()):
        configs = {c for counts in by_side.values() for c in counts}
        if len(configs) > 1:
            out.append({"kernel": kernel, "key": key,
                        "by_side": {side: dict(counts) for side, counts in sorted(by_side.items())}})
    return out
