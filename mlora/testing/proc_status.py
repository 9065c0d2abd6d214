"""This process's memory as Linux reports it (``/proc/self/status``) and the reset of its peak: the
one reader the memory probe, the tests and the benchmarks share."""

from __future__ import annotations


def rss(field_name: str = "VmRSS") -> int:
    """A ``VmRSS`` / ``VmHWM`` line of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def reset_peak() -> None:
    """VmHWM := VmRSS (Linux ≥ 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
