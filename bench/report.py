"""The report `kpr bench --json` writes: each mode's samples summed up over rounds, the machine
it ran on, and several runs' reports merged into one."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path


def summarize(samples: list[dict]) -> dict:
    """Medians over rounds; a ratio is the median of per-round ratios to the adjacent direct."""
    summary: dict = {}
    keys = {k for s in samples for k, v in s.items() if isinstance(v, int | float)}
    for key in sorted(keys):
        if isinstance(samples[0].get(key), bool):
            summary[key] = all(s.get(key) for s in samples)
            continue
        values = [s[key] for s in samples if isinstance(s.get(key), int | float)]
        if values:
            summary[key] = statistics.median(values)
    summary["rounds"] = len(samples)
    for key in ("not_measured", "program_timed_out"):  # reasons, said in the table
        if reasons := [s[key] for s in samples if s.get(key)]:
            summary[key] = reasons[0]
    if any("cleaned_up" in s for s in samples):
        summary["cleaned_up"] = all(s.get("cleaned_up") for s in samples)
    summary["all_connected"] = all(
        s.get("connect_failures") == 0 and s.get("rr_failures") == 0 and s.get("stream_ok")
        for s in samples
    )
    return summary


def machine() -> dict:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_kb = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1])
    versions = {}
    for tool in ("iptables", "iptables-legacy", "nft"):
        if shutil.which(tool):
            done = subprocess.run([tool, "--version"], capture_output=True, text=True)
            versions[tool] = done.stdout.strip()
    return {"kernel": platform.release(), "cpus": os.cpu_count(), "cpu": cpu,
            "memory_gib": round(mem_kb / 2**20, 1), "python": platform.python_version(),
            "tools": versions}  # fmt: skip


def merged(paths: Sequence[Path]) -> dict:
    """Several runs' reports as one (their results one after the other), for one table and
    one plot across sizes measured by separate commands."""
    reports = [json.loads(path.read_text()) for path in paths]
    report = dict(reports[0])
    report["results"] = [entry for r in reports for entry in r["results"]]
    for entry in report["results"]:  # summarised again: by this version's rules
        if entry.get("samples") and not entry["skipped"]:
            entry["summary"] = summarize(entry["samples"])
    report["runs"] = [{k: r.get(k) for k in ("command", "started", "finished")} for r in reports]
    return report
