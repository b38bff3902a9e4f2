"""Declared A/B experiments for GPU kernels, from an experiment file to a verdict report."""
__version__ = "0.1.0"

import os as _os

if _os.environ.get("HARNESS_PARENT_PID"):  # a worker the harness started: die with it (harness/children.py)
    from harness.children import die_with_parent as _die_with_parent

    _die_with_parent()
