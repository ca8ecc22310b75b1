"""Why an endpoint gets traffic on this node or not (kpr/desired/explain.py), rule by rule."""

from __future__ import annotations

from dataclasses import replace
from ipaddress import ip_address

from kpr.desired.explain import explain, render
from kpr.model import EndpointPort, EndpointSlice, NodeContext, ServicePort
from tests.support.builders import HTTP, endpoint, endpoint_slice, service

NODE = NodeContext(name="node-1", zone="zone-a")


def verdicts(svc, slices, node: NodeContext = NODE, policy: str = "Cluster") -> dict[str, object]:
    [port] = explain(svc, slices, node)["ports"]
    return {e["address"]: e.get("no_traffic", e["traffic"].get(policy)) for e in port["endpoints"]}


def test_ready_endpoints_get_traffic_and_not_ready_ones_say_so() -> None:
    slices = [
        endpoint_slice(
            endpoint("10.244.1.11", node_name="node-1", zone="zone-a"),
            endpoint("10.244.1.12", ready=False, serving=False),
            endpoint("10.244.1.13", ready=False, terminating=True),
        )
    ]
    assert verdicts(service(), slices) == {
        "10.244.1.11:8080": None,
        "10.244.1.12:8080": "not ready",
        "10.244.1.13:8080": "terminating: used only while no endpoint is ready",
    }
    [port] = explain(service(), slices, NODE)["ports"]
    first = port["endpoints"][0]
    assert (first["node"], first["zone"], first["slice"]) == ("node-1", "zone-a", "web-abc12")
    assert port["frontends"] == [
        {"frontend": "10.96.0.10:80/TCP", "kind": "ClusterIP", "policy": "Cluster"}
    ]


def test_terminating_endpoints_get_traffic_when_none_is_ready() -> None:
    slices = [endpoint_slice(endpoint("10.244.1.13", ready=False, terminating=True))]
    assert verdicts(service(), slices) == {"10.244.1.13:8080": None}


def test_local_policy_names_the_other_node() -> None:
    svc = service(internal_traffic_policy="Local")
    slices = [endpoint_slice(endpoint("10.244.2.11", node_name="node-2"), endpoint("10.244.9.9"))]
    assert verdicts(svc, slices, policy="Local") == {
        "10.244.2.11:8080": "on node node-2, not this node (node-1), and the traffic policy is "
        "Local",
        "10.244.9.9:8080": "on no node, not this node (node-1), and the traffic policy is Local",
    }


def test_topology_hints_say_which_zone_they_are_for() -> None:
    slices = [
        endpoint_slice(
            endpoint("10.244.1.11", hints_for_zones=("zone-a",)),
            endpoint("10.244.2.11", hints_for_zones=("zone-b",)),
        )
    ]
    assert verdicts(service(), slices) == {
        "10.244.1.11:8080": None,
        "10.244.2.11:8080": "outside this node's hints: hinted for zone(s) zone-b, not zone-a",
    }


def test_every_endpoint_of_a_5000_endpoint_service_gets_traffic() -> None:
    many = [endpoint(str(ip_address("10.244.0.0") + i)) for i in range(5000)]
    assert set(verdicts(service(), [endpoint_slice(*many)]).values()) == {None}


def test_invalid_or_mismatched_slice_ports_are_named() -> None:
    no_number = endpoint_slice(endpoint("10.244.1.11"), ports=(EndpointPort("http", "TCP", 0),))
    other_name = endpoint_slice(
        endpoint("10.244.1.12"), name="web-2", ports=(EndpointPort("grpc", "TCP", 9090),)
    )
    assert verdicts(service(), [no_number, other_name]) == {
        "10.244.1.11": "invalid field: the slice's port has no number (unset or 0)",
        "10.244.1.12": "the slice has no port named 'http' with protocol TCP",
    }


def test_a_duplicate_address_says_the_other_slice_is_used() -> None:
    first = endpoint_slice(endpoint("10.244.1.11", ready=False, terminating=True), name="a")
    second = endpoint_slice(endpoint("10.244.1.11"), name="b")
    [port] = explain(service(), [first, second], NODE)["ports"]
    by_slice = {e["slice"]: e for e in port["endpoints"]}
    assert by_slice["a"]["no_traffic"] == (
        "the same address and port in another slice is used instead"
    )
    assert by_slice["b"]["traffic"] == {"Cluster": None}


def test_fqdn_slices_and_other_families_are_not_proxied() -> None:
    fqdn = EndpointSlice("default", "web-fqdn", "web", "FQDN", (EndpointPort("http", "TCP", 80),))
    v6 = endpoint_slice(endpoint("fd00:244::11"), name="web-v6", address_type="IPv6")
    fqdn = replace(fqdn, endpoints=(endpoint("10.244.1.11"),))
    assert verdicts(service(), [fqdn, v6]) == {
        "10.244.1.11:80": "addressType FQDN: not proxied",
        "[fd00:244::11]:8080": "the Service has no IPv6 clusterIP",
    }


def test_services_no_proxy_serves_say_why() -> None:
    headless = service(cluster_ips=())
    assert "headless" in explain(headless, [], NODE)["not_served"]
    other = service(labels={"service.kubernetes.io/service-proxy-name": "cilium"})
    assert "cilium" in explain(other, [], NODE)["not_served"]
    sctp = service(ports=(ServicePort("s", "SCTP", 9),))
    assert explain(sctp, [], NODE)["ports"][0]["not_served"] == "kpr handles TCP and UDP only"


def test_render_shows_frontends_with_the_maps_and_each_endpoint() -> None:
    slices = [
        endpoint_slice(
            endpoint("10.244.1.11", node_name="node-1"), endpoint("10.244.1.12", ready=False)
        )
    ]
    text = render(explain(service(), slices, NODE), {"10.96.0.10:80/TCP": ["10.244.1.11:8080"]})
    assert "10.96.0.10:80/TCP" in text and "-> 10.244.1.11:8080" in text
    assert "not ready" in text and "Cluster: no traffic, not ready" in text
    assert HTTP.name in text


def test_a_frontend_without_endpoints_here_says_refused_or_dropped_and_why() -> None:
    """kube-proxy rejects a Service without endpoints and drops a Local-policy one whose
    endpoints are all elsewhere. kpr's TC path drops too; its socket hooks refuse (they can
    only fail the call): the frontend says which, and that kube-proxy drops there."""
    from tests.support.builders import EXTERNAL_NODE, HTTP_NP

    svc = service(
        ports=(HTTP_NP,),
        type="NodePort",
        internal_traffic_policy="Local",
        external_traffic_policy="Local",
    )
    elsewhere = [endpoint_slice(endpoint("10.244.2.11", node_name="node-2"))]
    said = {
        f["frontend"]: f.get("no_endpoint")
        for f in explain(svc, elsewhere, EXTERNAL_NODE)["ports"][0]["frontends"]
    }
    assert said["10.96.0.10:80/TCP"].startswith("none here: refused at once (Local policy)")
    assert "kube-proxy drops" in said["10.96.0.10:80/TCP"]
    external = [f for f in said if f.endswith("(external)")]
    assert external and all(said[f].startswith("none here: dropped") for f in external)
    # a NodePort from the node itself follows Cluster: the remote endpoint serves it
    assert all(said[f] is None for f in said if f not in external and ":30080/" in f)
    nothing = explain(svc, [], EXTERNAL_NODE)["ports"][0]["frontends"]
    assert {f["no_endpoint"].split(" (")[0] for f in nothing} == {"none: refused"}
    text = render(explain(svc, elsewhere, EXTERNAL_NODE), {"10.96.0.10:80/TCP": []})
    assert "-> none here: refused at once (Local policy)" in text
