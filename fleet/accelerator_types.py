"""The accelerator types Meridian knows. The API, the fleet loader and job
submission validate against this registry; add a line to support a new type.

"CPU" is a CPU slot standing in for a GPU: the embedded demo and the tests run on it.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class AcceleratorType:
    name: str
    memory_gb: int
    vendor: str


ACCELERATOR_TYPES = {
    t.name: t
    for t in (
        AcceleratorType("H100-80GB", 80, "NVIDIA"),
        AcceleratorType("H200-141GB", 141, "NVIDIA"),
        AcceleratorType("A100-80GB", 80, "NVIDIA"),
        AcceleratorType("A100-40GB", 40, "NVIDIA"),
        AcceleratorType("V100-32GB", 32, "NVIDIA"),
        AcceleratorType("CPU", 0, "CPU"),
    )
}
ACCELERATOR_TYPE_CHOICES = [(name, name) for name in ACCELERATOR_TYPES]


def is_gpu(name):
    """True for a GPU type (its jobs' ranks hold CUDA state), False for "CPU"."""
    return ACCELERATOR_TYPES[name].vendor != "CPU"


def accelerator_type_error(name):
    """Returns a message a person can act on when `name` is not a known type, else None."""
    if name in ACCELERATOR_TYPES:
        return None
    return f"unknown accelerator type {name!r}; known types: {', '.join(ACCELERATOR_TYPES)}"
