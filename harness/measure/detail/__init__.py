"""Mechanisms of the measuring workers, kept out of the way of the nouns in harness/measure/:
the pipe between driver and worker, CUDA-graph capture and burst timing, NVML telemetry, the
autotune configs a process chose."""
