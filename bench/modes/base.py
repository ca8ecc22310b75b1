"""A mode: what the bench asks of every way of carrying a ClusterIP to the pods; and direct,
clients connecting straight to the pods, the physical limit every figure is divided by."""

from __future__ import annotations

from bench.kubeproxy_rules import ServicePort
from bench.lab import BenchLab
from bench.services import ServiceSet


class Mode:
    name = ""
    # Rules in the node netns (the NAT modes) also catch a connect made straight to a pod, so
    # direct is measured before they are loaded. kpr's programs see only the lab's cgroup: a
    # client in the lab's baseline cgroup is direct at the same moment (see measure_paired).
    pairs_with_direct = False

    def missing(self) -> str | None:
        """Why this machine cannot run the mode; None when it can."""
        return None

    def program(self, bl: BenchLab, services: ServiceSet) -> dict:
        return {}

    def change(self, bl: BenchLab, services: ServiceSet, changed: dict[int, ServicePort]) -> dict:
        return {}

    def memory(self, bl: BenchLab, services: ServiceSet) -> dict:
        return {}

    def cleanup(self, bl: BenchLab) -> None:
        pass

    def targets(self, bl: BenchLab, services: ServiceSet, port_name: str) -> list:
        return services.real_targets(port_name)


class Direct(Mode):
    name = "direct"

    def targets(self, bl: BenchLab, services: ServiceSet, port_name: str) -> list:
        return bl.direct_targets(port_name)


DIRECT = Direct()
