"""Ops with a known amount of work, for measuring the instrument itself (experiments/power-*.yaml)."""
