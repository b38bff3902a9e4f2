"""Declared A/B experiments for GPU kernels, from an experiment file to a verdict report."""
__version__ = "0.1.0"
