"""SM clock, temperature and throttle reasons of the measuring GPU, read right after every burst.

NVML is opened once per worker (an init per reading costs milliseconds); the GPU is found by the
UUID torch reports for cuda:0, so CUDA_VISIBLE_DEVICES cannot make us read another card. Without
NVML (no GPU, or no nvidia-ml-py) there is no reading, and no burst is ever flagged.
"""
from __future__ import annotations

from harness.device import _THROTTLE_BITS

LOW_CLOCK_FRACTION = 0.75  # a burst whose SM clock fell below this share of the boost clock is left out
# reasons that mean the chip slowed itself down whatever the clock reads now
SLOWDOWN_REASONS = ("hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
# A low clock under the software power cap alone is the chip's normal state for a power-bound kernel,
# not a disturbance: on the H200 (2026-12-03) a compute-bound bf16 matmul chain ran every burst under
# sw_power_cap at 1275-1600 MHz of a 1980 MHz boost, so the 75% line cut through the middle of its
# clock distribution and left out ~10% of its rounds, unbalancing the side orders the interval
# relies on. Such bursts are kept (their clock is recorded); a low clock with no power cap, or any
# thermal or hardware slowdown, still leaves the round out.
POWER_CAP = "sw_power_cap"


class Telemetry:
    def __init__(self):
        self.nvml = self.handle = None
        self.max_sm_clock = None
        try:
            import pynvml
            import torch

            if not torch.cuda.is_available():
                return
            pynvml.nvmlInit()
            uuid = str(getattr(torch.cuda.get_device_properties(0), "uuid", "") or "")
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            except Exception:  # noqa: BLE001 - older drivers spell UUIDs differently: take the first GPU
                handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.nvml, self.handle = pynvml, handle
            self.max_sm_clock = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
        except Exception:  # noqa: BLE001 - no NVML: no readings
            self.nvml = self.handle = None

    def read(self) -> dict | None:
        if self.nvml is None:
            return None
        n, h = self.nvml, self.handle
        try:
            mask = int(n.nvmlDeviceGetCurrentClocksThrottleReasons(h))
            return {"sm_clock_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
                    "max_sm_clock_mhz": self.max_sm_clock,
                    "temperature_c": n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
                    "throttle_mask": mask,
                    "throttle_reasons": [name for bit, name in _THROTTLE_BITS.items() if mask & bit]}
        except Exception:  # noqa: BLE001 - a failed reading is no reading
            return None


def throttled(reading: dict | None) -> str | None:
    """Why a burst that ended with this reading cannot be trusted, or None."""
    if not reading:
        return None
    reasons = reading.get("throttle_reasons") or []
    slow = [r for r in reasons if r in SLOWDOWN_REASONS]
    if slow:
        return f"throttle: {', '.join(slow)}"
    clock, top = reading.get("sm_clock_mhz"), reading.get("max_sm_clock_mhz")
    if clock and top and clock < LOW_CLOCK_FRACTION * top and POWER_CAP not in reasons:
        return f"SM clock {clock} MHz < {LOW_CLOCK_FRACTION:.0%} of {top} MHz"
    return None


def late_replay(late: int | None) -> str | None:
    """Why a burst whose replays stayed late after every retime (detail/timing.py) cannot be trusted, or
    None: the device may have waited for the host inside the timed span."""
    return f"host late for {late} replay(s): device waited inside the timing" if late else None
