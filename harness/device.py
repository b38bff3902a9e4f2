"""What the measuring process runs on: device identity, clocks and throttle state, versions.

Imported inside measured blocks, so it imports torch lazily and nothing from the op under test.
"""
from __future__ import annotations

import platform
import shutil
import socket
import subprocess
import sys

# NVML clock-event reason bits (nvml.h, nvmlClocksEventReason*); decoded so a reader need not.
_THROTTLE_BITS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def gpu_snapshot(index: int = 0) -> dict | None:
    """SM/memory clocks, temperature, power and throttle reasons now; None without a GPU."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return _smi_snapshot(index)
    try:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)
        snap = {
            "source": "nvml",
            "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
            "mem_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
            "max_sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
            "temperature_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
            "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "throttle_mask": int(reasons),
            "throttle_reasons": [name for bit, name in _THROTTLE_BITS.items() if reasons & bit],
        }
        pynvml.nvmlShutdown()
        return snap
    except Exception:  # NVML missing on this driver/container: fall back to nvidia-smi
        return _smi_snapshot(index)


def _smi_snapshot(index: int) -> dict | None:
    if shutil.which("nvidia-smi") is None:
        return None
    fields = "clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw,clocks_event_reasons.active"
    try:
        out = subprocess.run(["nvidia-smi", f"--id={index}", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout.strip()
    except (subprocess.SubprocessError, OSError):
        return None
    vals = [v.strip() for v in out.split(",")]

    def num(v: str):
        try:
            return float(v)
        except ValueError:
            return None

    mask = int(vals[5], 16) if vals[5].startswith("0x") else None
    return {
        "source": "nvidia-smi", "sm_clock_mhz": num(vals[0]), "mem_clock_mhz": num(vals[1]),
        "max_sm_clock_mhz": num(vals[2]), "temperature_c": num(vals[3]), "power_w": num(vals[4]),
        "throttle_mask": mask,
        "throttle_reasons": [n for b, n in _THROTTLE_BITS.items() if mask and mask & b],
    }


def device_info() -> dict:
    """Identity of the measuring device (GPU when present), for provenance."""
    import torch

    info: dict = {"host": socket.gethostname(), "platform": platform.platform(), "cpu_count": __import__("os").cpu_count()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update({
            "kind": "cuda", "name": props.name, "capability": list(torch.cuda.get_device_capability(0)),
            "sm_count": props.multi_processor_count, "total_memory_bytes": props.total_memory,
            "l2_bytes": getattr(props, "L2_cache_size", None), "uuid": str(getattr(props, "uuid", "")),
        })
        snap = gpu_snapshot(0)
        info["max_sm_clock_mhz"] = snap.get("max_sm_clock_mhz") if snap else None
        try:
            import pynvml

            pynvml.nvmlInit()
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
            pynvml.nvmlShutdown()
        except Exception:
            info["driver"] = None
    else:
        info.update({"kind": "cpu", "name": platform.processor() or platform.machine()})
    return info


def versions() -> dict:
    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out
