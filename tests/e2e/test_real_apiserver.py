"""kpr against the real kube-apiserver, fed by the real EndpointSlice controller.

Services are created through the API (ClusterIPs and NodePorts allocated by the API server),
Pods are lab pods bound to lab Nodes with the status a kubelet would write, and the slices kpr
reads are the ones kube-controller-manager writes from them. kpr runs with deploy/'s RBAC and a
ServiceAccount token only: the module ends by checking the API server's audit log for any
request of kpr's that was refused. Every check is a real connection from the lab's client
cgroup to the address a user would use.
"""

from __future__ import annotations

import pytest

from lab.kube import objects
from tests.support.kubelab import Agent, Kube, eventually

KPR_USER = "system:serviceaccount:kube-system:kpr"
NO_BACKEND = "ECONNREFUSED"  # what kube-proxy's REJECT gives a client, and kpr too
# Small slices, so that a Service of a few pods already spans several of them.
CONTROLLER_MANAGER_ARGS = ["--max-endpoints-per-slice=3"]


@pytest.fixture(scope="module")
def kube(control_plane, lab, kube_bin, tmp_path_factory):
    if len(lab.pods) < 4:
        lab.add_pods(4 - len(lab.pods))
    return Kube(control_plane, lab, kube_bin, tmp_path_factory.mktemp("kube-lab"))


@pytest.fixture(scope="module")
def agent(kube, tmp_path_factory):
    running = Agent(kube, tmp_path_factory.mktemp("agent"))
    running.start()
    yield running
    running.stop()
    made, denied = kube.audit(KPR_USER)
    assert made >= 6  # a list and a watch of Services, EndpointSlices and its Node at least
    assert not denied, f"kpr asked for what its RBAC does not allow: {denied}"


@pytest.fixture
def ns(kube):
    name = kube.namespace()
    yield name
    kube.core.delete_namespace(name)


def cluster_ip(svc: dict, family: int = 4) -> str:
    return next(ip for ip in svc["spec"]["clusterIPs"] if (":" in ip) == (family == 6))


def test_a_clusterip_service_follows_its_pods_ready_terminating_gone(kube, agent, ns):
    for i in (0, 1, 2):
        kube.pod(ns, i)
    svc = kube.service(ns, "echo")
    vip = cluster_ip(svc)
    assert vip.startswith("10.96.")  # allocated by the API server
    eventually(lambda: kube.reached(vip) == kube.names(0, 1, 2), what="all three pods")
    eventually(lambda: kube.reached(vip, 53, mode="udp-connected") == kube.names(0, 1, 2))
    # not ready: the controller marks it, kpr stops sending to it
    objects.set_pod_status(kube.core, ns, "pod-0", [str(kube.lab.pods[0].ipv4)], ready=False)
    eventually(lambda: kube.reached(vip) == kube.names(1, 2), what="pod-0 not ready")
    # deleted with a grace period: serving+terminating, used only while nothing is ready
    kube.core.delete_namespaced_pod("pod-1", ns, grace_period_seconds=30)
    eventually(lambda: kube.reached(vip) == kube.names(2), what="pod-1 terminating")
    kube.core.delete_namespaced_pod("pod-2", ns, grace_period_seconds=30)
    terminating = eventually(
        lambda: [
            e["conditions"] for s in kube.slices(ns, "echo") for e in s["endpoints"]
            if e["conditions"].get("terminating")
        ],
        what="terminating endpoints in the slice",
    )  # fmt: skip
    assert all(c["serving"] and not c["ready"] for c in terminating)
    eventually(lambda: kube.reached(vip) == kube.names(1, 2), what="terminating pods serve")
    # gone
    for name in ("pod-0", "pod-1", "pod-2"):
        objects.force_delete(kube.core, ns, name)
    eventually(lambda: kube.reached(vip) == {NO_BACKEND}, what="no endpoint: refused")


def test_nodeport_and_loadbalancer_ports_allocated_by_the_api_server(kube, agent, ns):
    kube.pod(ns, 1)
    node_port = kube.service(ns, "np", type="NodePort")
    number = node_port["spec"]["ports"][0]["nodePort"]
    assert 30000 <= number <= 32767
    lb = kube.service(ns, "lb", type="LoadBalancer")
    kube.core.patch_namespaced_service_status(
        "lb", ns, {"status": {"loadBalancer": {"ingress": [{"ip": "192.168.60.10"}]}}}
    )
    # localhostNodePorts, as kube-proxy's default: the node's own clients reach 127.0.0.1
    eventually(lambda: kube.reached("127.0.0.1", number) == kube.names(1), what="NodePort")
    eventually(lambda: kube.reached("192.168.60.10") == kube.names(1), what="LB ingress IP")
    lb_port = lb["spec"]["ports"][0]["nodePort"]
    eventually(lambda: kube.reached("127.0.0.1", lb_port) == kube.names(1), what="LB NodePort")
    assert kube.reached(cluster_ip(lb)) == kube.names(1)


def test_dual_stack_service_is_served_on_both_cluster_ips(kube, agent, ns):
    for i in (0, 1):
        kube.pod(ns, i)
    svc = kube.service(ns, "dual", ipFamilyPolicy="RequireDualStack")
    assert len(svc["spec"]["clusterIPs"]) == 2
    for family in (4, 6):
        vip = cluster_ip(svc, family)
        eventually(lambda v=vip: kube.reached(v) == kube.names(0, 1), what=f"IPv{family}")


@pytest.mark.parametrize(
    "distribution", ["PreferClose", "PreferSameZone", "PreferSameNode", "topology-mode Auto"]
)
def test_topology_hints_written_by_the_controller_keep_traffic_close(kube, agent, ns, distribution):
    # node-1 (kpr's, zone-a) has pods 0 and 1; node-2 (zone-b) has pods 2 and 3
    for i, node in ((0, "node-1"), (1, "node-1"), (2, "node-2"), (3, "node-2")):
        kube.pod(ns, i, node=node)
    if distribution == "topology-mode Auto":
        metadata = {"annotations": {"service.kubernetes.io/topology-mode": "Auto"}}
        svc = kube.service(ns, "close", metadata=metadata)
    else:
        svc = kube.service(ns, "close", trafficDistribution=distribution)
    hint = "forNodes" if distribution == "PreferSameNode" else "forZones"
    eventually(
        lambda: all(hint in e.get("hints", {}) for s in kube.slices(ns, "close")
                    for e in s["endpoints"]) and kube.slices(ns, "close"),
        what=f"the controller's {hint} hints",
    )  # fmt: skip
    vip = cluster_ip(svc)
    eventually(lambda: kube.reached(vip, count=40) == kube.names(0, 1), what="node-1's zone")


def test_traffic_policy_local_serves_this_nodes_endpoints_only(kube, agent, ns):
    for i, node in ((0, "node-1"), (2, "node-2")):
        kube.pod(ns, i, node=node)
    svc = kube.service(ns, "local", internalTrafficPolicy="Local")
    eventually(lambda: kube.reached(cluster_ip(svc), count=30) == kube.names(0))
    ext = kube.service(ns, "ext", type="NodePort", externalTrafficPolicy="Local")
    # the node's own clients reach every endpoint of an eTP Local Service (kube-proxy's
    # short-circuit); external traffic is the TC path's, tested in test_nodeport.py
    eventually(lambda: kube.reached(cluster_ip(ext), count=40) == kube.names(0, 2))


def test_session_affinity_keeps_a_client_on_one_pod(kube, agent, ns):
    for i in (0, 1, 2):
        kube.pod(ns, i)
    svc = kube.service(ns, "sticky", sessionAffinity="ClientIP")
    vip = cluster_ip(svc)
    eventually(lambda: len(kube.reached(vip, count=5) - {NO_BACKEND}) == 1)
    assert len(kube.reached(vip, count=40)) == 1


def test_headless_and_externalname_services_get_no_frontend(kube, agent, ns):
    kube.pod(ns, 0)
    kube.service(ns, "headless", clusterIP="None")
    kube.service(ns, "external", app=None, type="ExternalName", externalName="example.org",
                 ports=[])  # fmt: skip
    plain = kube.service(ns, "plain")  # a marker: once it is served, the others were seen
    vip = cluster_ip(plain)
    eventually(lambda: kube.reached(vip) == kube.names(0))
    assert eventually(lambda: kube.slices(ns, "headless"))  # the controller wrote its slice

    def served() -> set[str]:
        return {s["service"].split(":")[0] for s in agent.status()["services"]}

    eventually(lambda: f"{ns}/plain" in served(), what="kpr status names the Services")
    assert not {f"{ns}/headless", f"{ns}/external"} & served()


def test_selectorless_services_with_hand_written_slices_and_mirrored_endpoints(kube, agent, ns):
    manual = kube.service(ns, "manual", app=None)
    pods = kube.lab.pods
    kube.discovery.create_namespaced_endpoint_slice(
        ns,
        {
            "metadata": {
                "name": "manual-1",
                "labels": {
                    "kubernetes.io/service-name": "manual",
                    "endpointslice.kubernetes.io/managed-by": "hand-written",
                },
            },
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": [str(pods[i].ipv4)], "conditions": {"ready": True}} for i in (0, 1)
            ],
        },
    )
    eventually(lambda: kube.reached(cluster_ip(manual)) == kube.names(0, 1), what="hand slice")
    mirrored = kube.service(ns, "mirrored", app=None)
    kube.core.create_namespaced_endpoints(
        ns,
        {
            "metadata": {"name": "mirrored"},
            "subsets": [
                {
                    "addresses": [{"ip": str(pods[2].ipv4)}],
                    "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                }
            ],
        },
    )
    eventually(lambda: kube.slices(ns, "mirrored"), what="the mirroring controller's slice")
    eventually(lambda: kube.reached(cluster_ip(mirrored)) == kube.names(2), what="mirrored")


def test_service_proxy_name_label_selects_the_proxy(kube, agent, ns):
    kube.pod(ns, 3)
    label = "service.kubernetes.io/service-proxy-name"
    other = kube.service(ns, "other", metadata={"labels": {label: "someone-else"}})
    ours = kube.service(ns, "ours", metadata={"labels": {label: "kpr"}})
    eventually(lambda: kube.reached(cluster_ip(ours)) == kube.names(3))
    assert cluster_ip(other) not in {f.rsplit(":", 1)[0] for f in agent.frontends()}


def test_a_service_whose_endpoints_span_several_slices(kube, agent, ns):
    extra = kube.lab.add_pods(4)  # 8 pods: the lab's kube-controller-manager puts 3 per slice
    for i in range(len(kube.lab.pods)):
        kube.pod(ns, i)
    svc = kube.service(ns, "wide")
    everyone = kube.names(*range(len(kube.lab.pods)))
    eventually(lambda: len(kube.slices(ns, "wide")) >= 3, what="several slices")
    eventually(lambda: kube.reached(cluster_ip(svc), count=120) == everyone)
    assert extra


def test_kpr_status_names_the_real_api_server_and_healthy_watches(kube, agent, ns):
    status = agent.status()
    watches = status["agent"]["watches"]
    assert watches and all(w["connected"] and w["synced"] for w in watches.values())
    assert agent.metric("kubeproxy_sync_proxy_rules_last_timestamp_seconds") > 0
    assert status["agent"]["source"] == f"kubernetes:{kube.plane.url}"


def test_service_updates_and_deletes_follow_the_api(kube, agent, ns):
    for i in (0, 1):
        kube.pod(ns, i)
    svc = kube.service(ns, "echo")
    vip = cluster_ip(svc)
    eventually(lambda: kube.reached(vip) == kube.names(0, 1))
    current = kube.core.read_namespaced_service("echo", ns)
    current.spec.ports[0].port = 81
    kube.core.replace_namespaced_service("echo", ns, current)
    eventually(lambda: kube.reached(vip, 81) == kube.names(0, 1), what="the new port")
    eventually(lambda: f"{vip}:80/TCP" not in agent.frontends(), what="the old port gone")
    kube.core.delete_namespaced_service("echo", ns)
    eventually(lambda: not {f for f in agent.frontends() if f.startswith(f"{vip}:")})


def test_metrics_and_health_follow_the_controllers_changes(kube, agent, ns):
    programmed = agent.metric("kubeproxy_network_programming_duration_seconds_count")
    kube.pod(ns, 0)
    vip = cluster_ip(kube.service(ns, "echo"))
    eventually(lambda: kube.reached(vip) == kube.names(0))
    # the controller's trigger time (endpoints.kubernetes.io/last-change-trigger-time) counts
    eventually(
        lambda: agent.metric("kubeproxy_network_programming_duration_seconds_count") > programmed
    )
    assert agent.metric("kubeproxy_sync_proxy_rules_duration_seconds_count") >= 1
    assert agent.metric('kpr_datapath_outcomes_total{outcome="translated"}') >= 30
    status, body = agent.get(agent.healthz, "/healthz")
    assert status == 200 and '"nodeEligible": true' in body


def test_hints_follow_a_change_of_this_nodes_zone(kube, agent, ns):
    for i, node in ((0, "node-1"), (1, "node-1"), (2, "node-2"), (3, "node-2")):
        kube.pod(ns, i, node=node)
    vip = cluster_ip(kube.service(ns, "close", trafficDistribution="PreferClose"))
    eventually(lambda: kube.reached(vip, count=40) == kube.names(0, 1), what="zone-a's pods")
    kube.core.patch_node("node-1", {"metadata": {"labels": {objects.ZONE_LABEL: "zone-b"}}})
    try:
        # kpr follows its Node's zone (the controller may re-hint pods 0 and 1 as zone-b too)
        eventually(lambda: kube.names(2, 3) <= kube.reached(vip, count=40), what="zone-b's pods")
    finally:
        kube.core.patch_node("node-1", {"metadata": {"labels": {objects.ZONE_LABEL: "zone-a"}}})
