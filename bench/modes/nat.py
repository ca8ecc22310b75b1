"""The NAT modes: kube-proxy's rulesets as it generates them (bench.kubeproxy_rules),
loaded in the lab's node netns, hooked from nat OUTPUT as kube-proxy hooks them.

- ``iptables`` / ``iptables-legacy``: the nat table loaded with ``iptables-restore`` (nf_tables
  back end) / ``iptables-legacy-restore``;
- ``nftables``: the ``ip kube-proxy`` table loaded with ``nft -f``.

Programming and a change are timed as one restore process each, under the load tool's
``maxrss`` (its CPU and peak RSS too)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from bench import kubeproxy_rules as rules
from bench.config import CLUSTER_CIDR, VIP_NET, ModeFailed
from bench.kubeproxy_rules import ServicePort
from bench.lab import BenchLab
from bench.modes.base import Mode
from bench.services import ServiceSet


def timed_child(tool: Path, argv: list[str], stdin: str) -> dict:
    """Run ``argv`` with ``stdin`` under the load tool's ``maxrss``: wall time, CPU and peak
    RSS of that one command."""
    with tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        done = subprocess.run(
            [str(tool), "maxrss", *argv],
            input=stdin,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            check=False,
        )
        seconds = time.perf_counter() - started
        err.seek(0)
        usage = json.loads(done.stdout) if done.returncode == 0 else {"exit": done.returncode}
        if usage["exit"] != 0:
            raise ModeFailed(f"{' '.join(argv[-3:])} exited {usage['exit']}: {err.read()[:500]}")
    return {"seconds": seconds, "cpu_s": usage["cpu_s"], "peak_rss_mb": usage["maxrss_kb"] / 1024}


class Iptables(Mode):
    def __init__(self, name: str, restore: str, command: str) -> None:
        self.name = name
        self.restore = restore
        self.command = command

    def missing(self) -> str | None:
        for tool in (self.restore, self.command):
            if shutil.which(tool) is None:
                return f"{tool} not installed"
        return None

    def program(self, bl: BenchLab, services: ServiceSet) -> dict:
        text = rules.iptables_restore(services.ports, CLUSTER_CIDR)
        if self.name == "iptables-legacy":
            bl.dirty = True  # from here on the lab's netns has a legacy nat table
        # kube-proxy always restores with --noflush. For this first load into an empty netns
        # the nf_tables back end gets it without: iptables 1.8.9's iptables-nft-restore
        # --noflush grows far faster than linearly with the chains declared (docs/benchmarks.md)
        # and would take hours at 10,000 services. Flushing an empty nat table changes nothing.
        flags = ["--noflush"] if self.name == "iptables-legacy" else []
        run = timed_child(bl.tool, bl.lab.node_command([self.restore, *flags]), text)
        return {
            "program_s": run["seconds"],
            "program_noflush": bool(flags),
            "program_cpu_s": run["cpu_s"],
            "restore_peak_rss_mb": run["peak_rss_mb"],
            "rules": text.count("\n-A "),
        }

    def change(self, bl: BenchLab, services: ServiceSet, changed: dict[int, ServicePort]) -> dict:
        ports = [changed.get(i, sp) for i, sp in enumerate(services.ports)]
        text = rules.iptables_partial(ports, list(changed.values()), CLUSTER_CIDR)
        run = timed_child(bl.tool, bl.lab.node_command([self.restore, "--noflush"]), text)
        return {"change_s": run["seconds"]}

    def cleanup(self, bl: BenchLab) -> None:
        for argv in ([self.command, "-t", "nat", "-F"], [self.command, "-t", "nat", "-X"]):
            done = bl.node(argv)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
        if self.name == "iptables":
            # the nf_tables back end leaves an empty `ip nat` table with base chains, which
            # keep conntrack on; remove it (our node netns only)
            bl.node(["nft", "delete", "table", "ip", "nat"])


class Nftables(Mode):
    name = "nftables"

    def missing(self) -> str | None:
        return None if shutil.which("nft") else "nft not installed"

    def program(self, bl: BenchLab, services: ServiceSet) -> dict:
        text = rules.nft_ruleset(
            services.ports, CLUSTER_CIDR, str(VIP_NET), [str(bl.lab.node_ipv4)]
        )
        run = timed_child(bl.tool, bl.lab.node_command(["nft", "-f", "-"]), text)
        return {"program_s": run["seconds"], "program_cpu_s": run["cpu_s"],
                "restore_peak_rss_mb": run["peak_rss_mb"]}  # fmt: skip

    def change(self, bl: BenchLab, services: ServiceSet, changed: dict[int, ServicePort]) -> dict:
        text = "".join(
            rules.nft_partial(services.ports[i], new, CLUSTER_CIDR) for i, new in changed.items()
        )
        run = timed_child(bl.tool, bl.lab.node_command(["nft", "-f", "-"]), text)
        return {"change_s": run["seconds"]}

    def cleanup(self, bl: BenchLab) -> None:
        done = bl.node(["nft", "delete", "table", "ip", "kube-proxy"])
        if done.returncode != 0:
            raise RuntimeError(f"nft delete table ip kube-proxy: {done.stderr.strip()}")
