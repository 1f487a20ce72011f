"""What a saved run records about the machine it ran on: git commit, CPU, kernel, QEMU version
and the load beside the run (other work on the same host makes every figure noisier)."""

import datetime
import os
import re
import subprocess
from pathlib import Path


def git_commit(root):
    """HEAD of the tree at `root`, with `-dirty` if a tracked file was modified."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def qemu_version(binary):
    """(`--version`'s first line, "major.minor.micro")."""
    try:
        first = subprocess.run([binary, "--version"], capture_output=True, text=True,
                               timeout=60).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return None, None
    m = re.search(r"version (\d+\.\d+\.\d+)", first)
    return first, (m.group(1) if m else None)


def now():
    """The local time, ISO 8601 with its offset, to the second."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def loadavg():
    """One sample of /proc/loadavg: the 1, 5 and 15 minute load averages, with the time."""
    try:
        one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    except (OSError, ValueError):
        return None
    return {"at": now(),
            "1m": float(one), "5m": float(five), "15m": float(fifteen)}


def host():
    """The host's CPU, cores, kernel and memory."""
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) // 1024
    except (OSError, ValueError):
        pass
    return {"nproc": os.cpu_count(), "kernel": os.uname().release,
            "kernel_version": os.uname().version, "cpu_model": cpu_model(), "mem_mib": mem}
