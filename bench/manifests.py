"""The generated Services as Kubernetes objects: a Service and one EndpointSlice each, written
as kubectl-shaped YAML files for kpr's manifest source, or handed to the API server."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from bench.config import SERVICES_PER_FILE
from bench.kubeproxy_rules import ServicePort


def service_objects(group: list[ServicePort]) -> list[dict]:
    """One Service's ports (``group``) as its Service and its EndpointSlice."""
    first = group[0]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": first.name, "namespace": first.namespace},
        "spec": {
            "clusterIP": first.cluster_ip,
            "clusterIPs": [first.cluster_ip],
            "ports": [
                {
                    "name": sp.port_name,
                    "port": sp.port,
                    "protocol": sp.protocol,
                    "targetPort": sp.endpoints[0][1],
                }  # fmt: skip
                for sp in group
            ],
        },
    }
    # One slice: every port of a service here has the same endpoint addresses.
    slice_ = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{first.name}-bench",
            "namespace": first.namespace,
            "labels": {"kubernetes.io/service-name": first.name},
        },
        "addressType": "IPv4",
        "ports": [
            {"name": sp.port_name, "port": sp.endpoints[0][1], "protocol": sp.protocol}
            for sp in group
        ],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": True}} for ip, _ in first.endpoints
        ],
    }
    return [service, slice_]


def write_manifests(directory: Path, ports: Sequence[ServicePort]) -> dict[str, str]:
    """kubectl-shaped YAML, SERVICES_PER_FILE services a file; returns file name by service."""
    groups: dict[str, list[ServicePort]] = {}
    for sp in ports:
        groups.setdefault(sp.name, []).append(sp)
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    file_of: dict[str, str] = {}
    names = list(groups)
    for chunk in range(0, len(names), SERVICES_PER_FILE):
        file_name = f"services-{chunk // SERVICES_PER_FILE:05d}.yaml"
        docs = []
        for name in names[chunk : chunk + SERVICES_PER_FILE]:
            docs += service_objects(groups[name])
            file_of[name] = file_name
        (directory / file_name).write_text(yaml.dump_all(docs, Dumper=dumper))
    return file_of


def rewrite_manifest(directory: Path, file_name: str, ports: Sequence[ServicePort]) -> None:
    """Write one file again from ``ports`` (all services), as an operator's edit would."""
    groups: dict[str, list[ServicePort]] = {}
    for sp in ports:
        groups.setdefault(sp.name, []).append(sp)
    docs = []
    for _name, group in groups.items():
        docs += service_objects(group)
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    path = directory / file_name
    tmp = path.with_name(f".{file_name}.tmp")  # hidden: the source skips it
    tmp.write_text(yaml.dump_all(docs, Dumper=dumper))
    tmp.replace(path)
