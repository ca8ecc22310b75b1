"""The API server of the API-fed modes (lab.kube.controlplane, one for the whole run) and
what the bench writes through it, as a controller would: the N Services × M endpoints the
generated-rules modes program (explicit ClusterIPs, one EndpointSlice each), one Service whose
one endpoint the bench moves from pod to pod (programming latency: API write → first connection
answered by the new pod), and CHURN_SERVICES whose endpoints churn."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from ipaddress import IPv4Address
from pathlib import Path

from bench.config import (
    CHANGE_VIP,
    CHURN_ENDPOINTS,
    CHURN_FIRST_VIP,
    NAMESPACE,
    ModeFailed,
)
from bench.lab import BenchLab
from bench.manifests import service_objects
from bench.services import ServiceSet

NODE = "bench-node"
CHANGE_SERVICE = "bench-change"
CHURN_SERVICES = 20
CREATE_THREADS = 8


@dataclass
class ApiBenchConfig:
    """The API-fed modes' part of BenchConfig."""

    changes: int = 50
    churn_rate: float = 20.0
    churn_s: float = 60.0
    idle_s: float = 300.0
    time_limit_s: float = 900.0


def _service_objects(group: list) -> tuple[dict, dict]:
    service, slice_ = service_objects(group)
    slice_["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] = "kpr-bench"
    for endpoint in slice_["endpoints"]:
        if endpoint["addresses"][0].startswith("10.244."):
            endpoint["nodeName"] = NODE  # the lab's pods are on the bench's node
    return service, slice_


class ApiFeed:
    """One API server for the whole bench run (sizes grow); the bench writes through it."""

    def __init__(self, directory: Path, cfg: ApiBenchConfig) -> None:
        self.directory = directory
        self.cfg = cfg
        self.plane = None
        self.held: dict[str, str] = {}  # service name -> its objects as written
        self.pod_ips: list[str] = []
        self.churn: list[list[str]] = []
        self.given_up: dict[str, str] = {}  # mode: why it is not run at bigger sizes

    def version(self) -> str:
        from lab.kube import build

        return build.kubernetes_version()

    def missing(self) -> str | None:
        from lab.kube import build

        try:
            build.find_go()
        except build.GoMissing as err:
            return f"needs the lab's Kubernetes build: {err}"
        return None

    def start(self) -> None:
        if self.plane is not None:
            return
        from kubernetes import client

        from lab.kube import build, objects
        from lab.kube.controlplane import ControlPlane

        self.bin_dir = build.build()
        plane = ControlPlane(
            self.bin_dir,
            self.directory / "kube",
            extra_users={"kube-proxy": ("system:kube-proxy", "")},
        )
        plane.start()
        self.plane = plane
        self.core = objects.core_api(plane.kubeconfig)
        self.discovery = client.DiscoveryV1Api(self.core.api_client)
        self.core.create_namespace({"metadata": {"name": NAMESPACE}})
        self.kpr_kubeconfig = objects.install_kpr_identity(
            plane, self.bin_dir, self.directory / "kpr.kubeconfig"
        )

    def stop(self) -> None:
        if self.plane is not None:
            self.plane.stop()
            self.plane = None

    @property
    def apiserver_port(self) -> int:
        assert self.plane is not None
        return int(self.plane.url.rsplit(":", 1)[1])

    def hold(self, services: ServiceSet, bl: BenchLab) -> dict:
        """Make the API hold exactly ``services`` (plus the change and churn Services)."""
        from lab.kube import objects

        self.start()
        started = time.monotonic()
        if not self.pod_ips:
            objects.create_node(self.core, NODE, internal_ips=[str(bl.lab.node_ipv4)])
            self.pod_ips = bl.pod_ips
            self._create_change_and_churn()
        elif self.pod_ips != bl.pod_ips:
            raise ModeFailed(f"the lab's pods moved: {self.pod_ips} then {bl.pod_ips}")
        groups: dict[str, list] = {}
        for sp in services.ports:
            groups.setdefault(sp.name, []).append(sp)
        wanted = {name: _service_objects(group) for name, group in groups.items()}
        texts = {name: json.dumps(objs, sort_keys=True) for name, objs in wanted.items()}
        gone = [n for n in self.held if n not in wanted]
        changed = [n for n in self.held if n in wanted and self.held[n] != texts[n]]
        new = [n for n in wanted if n not in self.held]
        with ThreadPoolExecutor(CREATE_THREADS) as pool:
            list(pool.map(self._delete, gone))
            # updated in place: a ClusterIP deleted and at once asked for again can still be
            # held by the allocator
            list(pool.map(lambda n: self._replace(*wanted[n]), changed))
            list(pool.map(lambda n: self._create(*wanted[n]), new))
        for name in gone:
            del self.held[name]
        self.held.update({n: texts[n] for n in changed + new})
        return {"api_objects_written": 2 * (len(gone) + len(changed) + len(new)),
                "api_write_s": time.monotonic() - started}  # fmt: skip

    def _create(self, service: dict, slice_: dict) -> None:
        self.core.create_namespaced_service(NAMESPACE, service, _preload_content=False)
        self.discovery.create_namespaced_endpoint_slice(NAMESPACE, slice_, _preload_content=False)

    def _replace(self, service: dict, slice_: dict) -> None:
        name = service["metadata"]["name"]
        current = self.core.read_namespaced_service(name, NAMESPACE)
        service["metadata"]["resourceVersion"] = current.metadata.resource_version
        self.core.replace_namespaced_service(name, NAMESPACE, service, _preload_content=False)
        current_slice = self.discovery.read_namespaced_endpoint_slice(f"{name}-bench", NAMESPACE)
        slice_["metadata"]["resourceVersion"] = current_slice.metadata.resource_version
        self.discovery.replace_namespaced_endpoint_slice(
            f"{name}-bench", NAMESPACE, slice_, _preload_content=False
        )

    def _delete(self, name: str) -> None:
        self.core.delete_namespaced_service(name, NAMESPACE, _preload_content=False)
        self.discovery.delete_namespaced_endpoint_slice(
            f"{name}-bench", NAMESPACE, _preload_content=False
        )

    def _create_change_and_churn(self) -> None:
        rr = {"name": "rr", "port": 81, "protocol": "TCP", "targetPort": 9090}
        self._create(
            _selectorless(CHANGE_SERVICE, CHANGE_VIP, [rr]),
            _slice(CHANGE_SERVICE, [self.pod_ips[0]], 9090, "rr"),
        )
        http = {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}
        for k in range(CHURN_SERVICES):
            addresses = [str(CHURN_ENDPOINTS + 256 * k + j) for j in range(10)]
            self.churn.append(addresses)
            name = f"churn-{k}"
            self._create(
                _selectorless(name, str(CHURN_FIRST_VIP + k), [http]),
                _slice(name, addresses, 8080, "http"),
            )

    def move_change_endpoint(self, pod: int) -> None:
        self.discovery.patch_namespaced_endpoint_slice(
            f"{CHANGE_SERVICE}-bench",
            NAMESPACE,
            {"endpoints": _endpoints([self.pod_ips[pod]])},
            _preload_content=False,
        )

    def churn_step(self, n: int) -> None:
        """Change n: one endpoint of one churn Service moves to another address."""
        k, j = n % CHURN_SERVICES, (n // CHURN_SERVICES) % 10
        addresses = self.churn[k]
        base = int(CHURN_ENDPOINTS) + 256 * k
        current = int(IPv4Address(addresses[j])) - base
        addresses[j] = str(IPv4Address(base + (current + 10 if current < 200 else j)))
        self.discovery.patch_namespaced_endpoint_slice(
            f"churn-{k}-bench",
            NAMESPACE,
            {"endpoints": _endpoints(addresses)},
            _preload_content=False,
        )


def _selectorless(name: str, vip: str, ports: list[dict]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"clusterIP": vip, "clusterIPs": [vip], "ports": ports},
    }


def _endpoints(addresses: list[str]) -> list[dict]:
    return [{"addresses": [a], "conditions": {"ready": True}} for a in addresses]


def _slice(name: str, addresses: list[str], port: int, port_name: str) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-bench",
            "namespace": NAMESPACE,
            "labels": {
                "kubernetes.io/service-name": name,
                "endpointslice.kubernetes.io/managed-by": "kpr-bench",
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": _endpoints(addresses),
    }
