"""Which accelerators this node has, and their telemetry aggregated over one interval.

`--devices auto`: NVIDIA GPUs through NVML (nvidia-ml-py) when the driver is present; else an
error that says to pass `--devices cpu:N`. `--devices cpu:N`: N CPU slots standing in for GPUs
(type "CPU"), as the embedded demo and the tests use.
"""
from __future__ import annotations

import os
import re

NVML_TYPE_NAMES = (  # NVML product name fragment -> Meridian accelerator type
    ("H200", "H200-141GB"), ("H100", "H100-80GB"), ("A100-SXM4-40GB", "A100-40GB"),
    ("A100-PCIE-40GB", "A100-40GB"), ("A100", "A100-80GB"), ("V100", "V100-32GB"),
)


class DeviceError(RuntimeError):
    pass


def parse_devices(spec):
    """Returns ("cpu", n) or ("auto", None) for a --devices value; raises DeviceError otherwise."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return "auto", None
    match = re.fullmatch(r"cpu:(\d+)", spec)
    if not match or not 1 <= int(match.group(1)) <= 64:
        raise DeviceError(f"--devices {spec!r}: use 'auto' (NVIDIA GPUs via NVML) or 'cpu:N' with N in 1..64")
    return "cpu", int(match.group(1))


def _nvml():
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver / no GPU: NVML's errors vary by platform
        return None
    return pynvml


def nvml_type(name):
    for fragment, type_name in NVML_TYPE_NAMES:
        if fragment in name:
            return type_name
    raise DeviceError(f"GPU {name!r} is not a known accelerator type; add it to fleet/accelerator_types.py "
                      "and agent/devices.py NVML_TYPE_NAMES")


class Devices:
    """The node's devices: `describe()` for registration, `sample(busy)` for telemetry."""

    def __init__(self, spec):
        kind, count = parse_devices(spec)
        self.nvml = None
        if kind == "auto":
            self.nvml = _nvml()
            if self.nvml is None:
                raise DeviceError("--devices auto found no NVIDIA GPU (NVML unavailable); pass --devices cpu:N "
                                  "to run with N CPU slots")
            self.handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.nvml.nvmlDeviceGetCount())]
            if not self.handles:
                raise DeviceError("NVML reports no GPU; pass --devices cpu:N")
            self.count = len(self.handles)
        else:
            self.count = count
        self._cpu_last = _cpu_times()

    def describe(self):
        """Returns [{"type", "memory_gb", "uuid"}] in device index order."""
        if self.nvml is None:
            return [{"type": "CPU", "memory_gb": 0, "uuid": ""} for _ in range(self.count)]
        out = []
        for handle in self.handles:
            name = self.nvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            memory = self.nvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30
            uuid = self.nvml.nvmlDeviceGetUUID(handle)
            out.append({"type": nvml_type(name), "memory_gb": int(round(memory)),
                        "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid})
        return out

    def sample(self, busy_indices=()):
        """Returns the node's telemetry since the previous call: {"utilization", "memory_used_gb", "devices"}.

        NVML: per-GPU utilization and memory. CPU slots: the node's CPU busy fraction over the
        interval (from /proc/stat), attributed to the slots that hold a job.
        """
        if self.nvml is not None:
            devices = []
            for i, handle in enumerate(self.handles):
                rates = self.nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
                devices.append({"index": i, "utilization": rates.gpu / 100.0, "memory_used_gb": memory.used / 2**30})
        else:
            now = _cpu_times()
            busy = now[0] - self._cpu_last[0]
            total = now[1] - self._cpu_last[1]
            self._cpu_last = now
            node_busy = busy / total if total > 0 else 0.0
            busy_set = set(busy_indices)
            devices = [{"index": i, "utilization": round(node_busy if i in busy_set else 0.0, 4),
                        "memory_used_gb": None} for i in range(self.count)]
        used = [d["memory_used_gb"] for d in devices if d["memory_used_gb"] is not None]
        return {"utilization": round(sum(d["utilization"] for d in devices) / max(1, len(devices)), 4),
                "memory_used_gb": round(sum(used), 3) if used else None, "devices": devices}


def _cpu_times():
    """Returns (busy jiffies, total jiffies) from /proc/stat, or (0, 0) where it does not exist."""
    try:
        with open("/proc/stat") as handle:
            fields = [int(x) for x in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def hostname_default():
    return os.uname().nodename
