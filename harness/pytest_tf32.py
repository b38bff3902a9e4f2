"""A pytest plugin (`-p harness.pytest_tf32`): the repository's own tests in a CPU run multiply
fp32 as the side workers do, TF32 dots emulated (harness/interpreter_tf32.py). Loaded by
harness/pytest_gate.py only where the side's environment asks for the emulation."""
from harness.interpreter_tf32 import emulate_tf32_dots

emulate_tf32_dots()
