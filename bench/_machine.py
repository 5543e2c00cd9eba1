"""The machine line every bench prints with its numbers (a bench's ratios depend on it)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine(with_torch: bool = True) -> str:
    """CPU model, core count, (torch version and the vector ISA it runs,) Python version."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [cpu, f"{os.cpu_count()} cores"]
    if with_torch:
        import torch

        isa = os.environ.get("ATEN_CPU_CAPABILITY") or torch.backends.cpu.get_cpu_capability()
        parts.append(f"torch {torch.__version__} ({isa})")
    return ", ".join([*parts, f"Python {platform.python_version()}"])
