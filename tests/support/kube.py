"""Builders for API-shaped Service and EndpointSlice objects, as tests need them."""

from __future__ import annotations

from ipaddress import ip_address
from pathlib import Path

import yaml


def service(
    name: str,
    cluster_ips: list[str],
    ports: list[tuple[str, int, str]],  # (name, port, protocol)
    namespace: str = "default",
    **spec,
) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": cluster_ips[0],
            "clusterIPs": cluster_ips,
            "ports": [
                {"name": n, "port": p, "protocol": proto, "targetPort": 8080}
                for n, p, proto in ports
            ],
            **spec,
        },
    }


def endpoint_slice(
    service_name: str,
    addresses: list[str],
    ports: list[tuple[str, int, str]],  # (name, port, protocol)
    name: str | None = None,
    namespace: str = "default",
    ready: bool = True,
    terminating: bool = False,
) -> dict:
    family = "IPv6" if addresses and ip_address(addresses[0]).version == 6 else "IPv4"
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name or f"{service_name}-{family.lower()}",
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service_name},
        },
        "addressType": family,
        "ports": [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports],
        "endpoints": [
            {
                "addresses": [a],
                "conditions": {"ready": ready, "serving": True, "terminating": terminating},
                "nodeName": "node-1",
            }
            for a in addresses
        ],
    }


def write(directory: Path, filename: str, *objects: dict) -> Path:
    """Write objects as one multi-document YAML file (replacing it atomically)."""
    path = directory / filename
    tmp = directory / f".{filename}.tmp"
    tmp.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    tmp.replace(path)
    return path
