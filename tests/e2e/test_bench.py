"""kpr bench: kube-proxy's rulesets checked against upstream's format (golden files, hashes),
loaded by the real tools, and a small bench run end to end."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import uuid
from ipaddress import IPv4Address
from pathlib import Path

import pytest

from bench import config, measure, render
from bench import kubeproxy_rules as rules
from bench.kubeproxy_rules import ServicePort
from bench.modes.nat import Iptables
from bench.plot import write_plot
from bench.report import merged
from bench.services import build_services, changed_service
from tests.support.paths import REPO

GOLDEN = Path(__file__).with_name("golden")

# The small service set of the golden files: upstream's own test names and addresses
# (pkg/proxy/*/proxier_test.go: pod CIDR 10.0.0.0/8, ClusterIPs in 172.30.0.0/16).
SERVICES = [
    ServicePort(
        "ns1", "svc1", "p80", "TCP", "172.30.0.41", 80, (("10.180.0.1", 80), ("10.180.2.1", 80))
    ),
    ServicePort(
        "ns2",
        "svc2",
        "dns",
        "UDP",
        "172.30.0.42",
        53,
        (("10.180.0.2", 53), ("10.180.0.3", 53), ("10.180.0.4", 53)),
    ),
    ServicePort("ns3", "svc3", "", "TCP", "172.30.0.43", 8080, (("10.180.0.5", 8080),)),
]
CLUSTER_CIDR = "10.0.0.0/8"
SERVICE_CIDR = "172.30.0.0/16"
NODE_IPS = ["192.168.0.2"]


def _iptables() -> str:
    return rules.iptables_restore(SERVICES, CLUSTER_CIDR)


def _nftables() -> str:
    return rules.nft_ruleset(SERVICES, CLUSTER_CIDR, SERVICE_CIDR, NODE_IPS)


# --- names and format, against upstream --------------------------------------------------------


def test_chain_hashes_match_upstream():
    svc1 = SERVICES[0]
    assert rules.svc_chain(svc1) == "KUBE-SVC-XPGD46QRK7WJZT7O"
    assert rules.sep_chain(svc1, ("10.180.0.1", 80)) == "KUBE-SEP-SXIVWICOYRO3J4NJ"
    assert rules.sep_chain(svc1, ("10.180.2.1", 80)) == "KUBE-SEP-ZX7GRIZKSNUQ3LAJ"
    assert rules.port_proto_hash("ns1/svc1:p80", "tcp") == "XPGD46QRK7WJZT7O"
    assert rules.nft_service_chain(svc1) == "service-ULMVA6XW-ns1/svc1/tcp/p80"
    assert (
        rules.nft_endpoint_chain(svc1, ("10.180.0.1", 80))
        == "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
    )


def test_iptables_lines_as_upstream_writes_them():
    # Lines from upstream's TestOverallIPTablesRules (there with the pod CIDR 10.0.0.0/8).
    text = _iptables().splitlines()
    for line in [
        '-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp'
        " -d 172.30.0.41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O",
        '-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp'
        " -p tcp -d 172.30.0.41 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ",
        '-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> 10.180.0.1:80"'
        " -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-SXIVWICOYRO3J4NJ",
        '-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> 10.180.2.1:80"'
        " -j KUBE-SEP-ZX7GRIZKSNUQ3LAJ",
        "-A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -s 10.180.0.1"
        " -j KUBE-MARK-MASQ",
        "-A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -m tcp -p tcp"
        " -j DNAT --to-destination 10.180.0.1:80",
        "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000",
        "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
        "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000",
    ]:
        assert line in text
    # the statistic cascade: 1/3, 1/2, then unconditional
    svc2 = [line for line in text if line.startswith(f"-A {rules.svc_chain(SERVICES[1])} ")]
    assert [
        ("--probability 0.3333333333" in r, "--probability 0.5000000000" in r, "statistic" not in r)
        for r in svc2[1:]
    ] == [(True, False, False), (False, True, False), (False, False, True)]
    # NodePorts last in KUBE-SERVICES; the unnamed port's comment has no ":"
    services_chain = [line for line in text if line.startswith("-A KUBE-SERVICES ")]
    assert "-j KUBE-NODEPORTS" in services_chain[-1]
    assert any('"ns3/svc3 cluster IP"' in line for line in services_chain)


def test_large_cluster_mode_drops_per_endpoint_comments():
    many = [
        ServicePort(
            "ns",
            f"s{i}",
            "p",
            "TCP",
            f"172.30.{i // 250}.{i % 250}",
            80,
            tuple((f"10.{i // 250}.{i % 250}.{j}", 80) for j in range(11)),
        )
        for i in range(100)
    ]  # 1,100 endpoints: more than upstream's 1,000
    text = rules.iptables_restore(many, CLUSTER_CIDR)
    seps = [line for line in text.splitlines() if line.startswith("-A KUBE-SEP-")]
    assert seps and not any("comment" in line for line in seps)
    # ...but the ClusterIP rules keep theirs
    assert '"ns/s0:p cluster IP"' in text


def test_nftables_lines_as_upstream_writes_them():
    text = _nftables().splitlines()
    for line in [
        "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 ip daddr 172.30.0.41"
        " ip saddr != 10.0.0.0/8 jump mark-for-masquerade",
        "add rule ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
        " ip saddr 10.180.0.1 jump mark-for-masquerade",
        "add rule ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
        " meta l4proto tcp dnat to 10.180.0.1:80",
        "add element ip kube-proxy service-ips { 172.30.0.41 . tcp . 80 : goto"
        " service-ULMVA6XW-ns1/svc1/tcp/p80 }",
        "add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips",
    ]:
        assert line in text
    vmap = next(line for line in text if "service-ULMVA6XW" in line and "numgen" in line)
    assert "numgen random mod 2 vmap { 0 : goto endpoint-5OJB2KTY-" in vmap


def test_golden_files():
    # Regenerate with KPR_UPDATE_GOLDEN=1 after a deliberate format change, then review the diff
    # against upstream's proxier_test.go.
    for name, text in (("iptables.txt", _iptables()), ("nftables.nft", _nftables())):
        path = GOLDEN / name
        if os.environ.get("KPR_UPDATE_GOLDEN"):
            path.write_text(text)
        assert text == path.read_text(), f"{name} differs from the golden file"


def test_partial_syncs():
    old = SERVICES[0]
    new = ServicePort(
        *[
            getattr(old, f)
            for f in ("namespace", "name", "port_name", "protocol", "cluster_ip", "port")
        ],
        endpoints=(("10.180.9.9", 80), old.endpoints[1]),
    )
    ipt = rules.iptables_partial([new, *SERVICES[1:]], [new], CLUSTER_CIDR)
    # every ClusterIP rule again, but only the changed service's chains
    assert ipt.count("-A KUBE-SERVICES ") == len(SERVICES) + 1
    assert rules.svc_chain(SERVICES[1]) not in ipt.replace("-j " + rules.svc_chain(SERVICES[1]), "")
    assert "--to-destination 10.180.9.9:80" in ipt
    nft = rules.nft_partial(old, new, CLUSTER_CIDR)
    assert f"flush chain ip kube-proxy {rules.nft_service_chain(old)}" in nft
    assert f"flush chain ip kube-proxy {rules.nft_endpoint_chain(old, old.endpoints[0])}" in nft
    assert "dnat to 10.180.9.9:80" in nft


# --- the rulesets load ------------------------------------------------------------------------


@pytest.fixture
def throwaway_netns():
    if os.geteuid() != 0:
        pytest.skip("needs root to make a network namespace")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip`")
    name = f"kprbenchtest-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.mark.parametrize(
    "argv",
    [
        ["iptables-restore", "--test", "--noflush"],
        ["iptables-legacy-restore", "--test", "--noflush"],
        ["nft", "-c", "-f", "-"],
    ],
    ids=["iptables-nft", "iptables-legacy", "nft"],
)
def test_rulesets_load(throwaway_netns, argv):
    if shutil.which(argv[0]) is None:
        pytest.skip(f"{argv[0]} not installed")
    old = SERVICES[0]
    new = dataclasses.replace(old, endpoints=(("10.180.9.9", 80), old.endpoints[1]))
    if argv[0] == "nft":
        full, partial = _nftables(), rules.nft_partial(old, new, CLUSTER_CIDR)
    else:
        full = _iptables()
        partial = rules.iptables_partial([new, *SERVICES[1:]], [new], CLUSTER_CIDR)
    real = [a for a in argv if a not in ("--test", "-c")]  # the same tool, loading for real

    def load(tool: list[str], text: str) -> None:
        done = subprocess.run(
            ["ip", "netns", "exec", throwaway_netns, *tool],
            input=text,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr

    load(argv, full)
    # a partial sync only makes sense on top of the full one: load that, then check the update
    load(real, full)
    load(argv, partial)
    load(real, partial)


# --- the benchmark ------------------------------------------------------------------------------


def _kpr(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "kpr.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--services", "0"], "at least 1"),
        (["--services", ""], "--services"),
        (["--endpoints", "500"], "more endpoints than the lab has pod addresses"),
        (["--services", "5000000", "--endpoints", "10"], "more services than the service CIDR"),
        (["--modes", "direct,ipvs"], "unknown ['ipvs']"),
    ],
)
def test_bad_input_is_one_clear_line(args, message):
    done = _kpr("bench", *args)
    assert done.returncode == 2
    assert message in done.stderr


def test_a_missing_tool_skips_its_mode_with_the_reason():
    mode = Iptables("iptables-legacy", "no-such-iptables-restore", "no-such-iptables")
    assert mode.missing() == "no-such-iptables-restore not installed"
    report = {
        "results": [
            {"services": 3, "mode": "iptables-legacy", "skipped": mode.missing(), "summary": {}}
        ]
    }
    assert "skipped: no-such-iptables-restore not installed" in render.render_table(report)


def test_services_spread_real_ones_through_the_list():
    services = build_services(1000, 3, ["10.244.1.11", "10.244.1.12", "10.244.1.13"])
    assert len(services.real) == config.REAL_SERVICES
    assert services.real[0] < 100 and services.real[-1] > 900  # a linear scan meets every depth
    assert len(services.ports) == 1000 + 2 * config.REAL_SERVICES  # 3 ports on real services
    changed = changed_service(services, 3)
    assert all(IPv4Address(sp.endpoints[0][0]) in config.FAKE_NET for sp in changed.values())


def test_small_bench_every_mode_carries_connections(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root: network namespaces, BPF, iptables")
    from kpr.node import host

    try:
        host.require_bcc()
        host.require_kernel_headers()
        host.cgroup2_root()
    except (host.SetupError, RuntimeError) as err:
        pytest.skip(str(err))
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    from kpr.agent import runstate

    def bench_state_files() -> set[str]:
        return {p.name for p in runstate.RUN_DIR.glob("*kpr-bench-*")}

    state_files_before = bench_state_files()
    done = _kpr(
        "bench",
        "--services",
        "3",
        "--endpoints",
        "2",
        "--connections",
        "200",
        "--rounds",
        "1",
        "--stream-mb",
        "16",
        *("--changes", "4", "--churn-seconds", "4", "--idle-seconds", "3", "--time-limit", "120"),
        "--json",
        str(out),
        "--plot",
        str(plot),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert bench_state_files() <= state_files_before  # kpr's run-state files cleaned up too
    report = json.loads(out.read_text())
    assert plot.stat().st_size > 10_000
    assert {e["mode"] for e in report["results"]} == set(config.MODES)
    for line in ("direct", "iptables", "nftables", "kpr"):
        assert any(row.split()[1:2] == [line] for row in done.stdout.splitlines()), done.stdout
    pods = {"0", "1"}  # the load tool's servers answer with their pod's index
    go = shutil.which("go") or Path("/usr/local/go/bin/go").exists()
    for entry in report["results"]:
        if entry["skipped"]:
            # only a tool the machine lacks may be skipped, never kpr or direct
            assert entry["mode"] not in ("direct", "kpr"), entry["skipped"]
            if entry["mode"] in config.API_MODES:
                assert not go and "Kubernetes build" in entry["skipped"], entry["skipped"]
            else:
                assert "not installed" in entry["skipped"], entry["skipped"]
            continue
        summary = entry["summary"]
        assert summary["all_connected"], entry
        for key in ("connect_p50_us", "connect_p99_us", "rr_per_s", "stream_gbit_s"):
            assert summary[key] > 0
        for sample in entry["samples"]:
            assert set(sample["rr_backends"]) <= pods
            assert set(sample["rr_backends"]) == pods  # 200 connections reach both pods
        if entry["mode"] != "direct":
            assert summary["cleaned_up"] is True  # the ClusterIP leads nowhere after clean-up
            for key in ("connect_p50_us_ratio", "program_s", "change_s"):
                assert summary[key] > 0
        if entry["mode"] in config.API_MODES:
            # fed by the API server: programmed, every Service answered, each change seen
            assert summary["every_service_answered"] is True, entry
            assert summary["proxy_first_sync_s"] > 0
            assert summary["change_failures"] == summary["churn_failures"] == 0, entry
            (sample,) = entry["samples"]
            assert sample["change_latency_s"]["count"] == 4
            assert sample["churn_changes"] >= 40  # 20 a second for 4 s
            assert summary["churn_cpu"] > 0 and summary["idle_cpu"] >= 0
            assert summary["proxy_rss_mb"] > 0
        if entry["mode"] == "kpr":
            assert summary["agent_rss_mb"] > 0
        if entry["mode"] in ("kpr", "kpr-api"):
            for sample in entry["samples"]:  # direct alternated with kpr, block by block
                assert sample["blocks"] == sample["direct"]["blocks"] == measure.PAIRED_BLOCKS
                assert sample["direct"]["connect_ok"] == sample["connect_ok"] == 200
                assert sample["connect_p50_us_ratio"] > 0


def test_node_port_rules_as_upstream_writes_them(throwaway_netns):
    # Lines from upstream's TestOverallIPTablesRules (svc2 there has nodePort 3001).
    port = dataclasses.replace(SERVICES[0], node_port=3001)
    text = rules.iptables_restore([port], "10.0.0.0/8")
    for line in [
        "-A KUBE-NODEPORTS -m comment --comment ns1/svc1:p80 -m tcp -p tcp --dport 3001"
        " -j KUBE-EXT-XPGD46QRK7WJZT7O",
        '-A KUBE-EXT-XPGD46QRK7WJZT7O -m comment --comment "masquerade traffic for ns1/svc1:p80'
        ' external destinations" -j KUBE-MARK-MASQ',
        "-A KUBE-EXT-XPGD46QRK7WJZT7O -j KUBE-SVC-XPGD46QRK7WJZT7O",
    ]:
        assert line in text.splitlines()
    loaded = subprocess.run(
        ["ip", "netns", "exec", throwaway_netns, "iptables-restore", "--test", "--noflush"],
        input=text, capture_output=True, text=True,
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr


def test_node_port_bench_carries_connections_in_every_mode():
    from tests.support.kernel import skip_unless_kernel_ready

    skip_unless_kernel_ready()
    from bench import nodeport

    result = nodeport.run(rounds=1, connections=200)
    assert result["failures"] == {"direct": 0, "iptables": 0, "kpr": 0}
    assert all(rate > 0 for rate in result["rate_per_s"].values())
    assert result["ratio_to_direct"]["direct"] == 1.0


def test_the_api_fed_modes_read_the_proxy_metric_and_rank_each_column():
    from bench.modes import process

    text = (
        "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram\n"
        'kubeproxy_sync_proxy_rules_duration_seconds_bucket{le="1"} 2\n'
        "kubeproxy_sync_proxy_rules_duration_seconds_sum 1.5\n"
        "kubeproxy_sync_proxy_rules_duration_seconds_count 2\n"
        "kubeproxy_sync_full_proxy_rules_duration_seconds_sum 9\n"
    )
    assert process.sync_metric(text) == {"count": 2.0, "sum": 1.5}
    assert process.quantiles([0.3, 0.1, 0.2]) == {"count": 3, "p50": 0.2, "p99": 0.3, "max": 0.3}

    def entry(mode: str, **summary: float) -> dict:
        return {"services": 1000, "mode": mode, "skipped": None, "summary": summary}

    report = {"results": [
        entry("direct", connect_p50_us=10.0),
        entry("kube-proxy-iptables", connect_p50_us=30.0, connect_p50_us_ratio=3.0,
              program_s=5.0, idle_cpu=0.2),
        entry("kpr-api", connect_p50_us=11.0, connect_p50_us_ratio=1.01, program_s=0.5,
              idle_cpu=0.3),
        {"services": 1000, "mode": "kube-proxy-nftables", "skipped": "nft not found",
         "summary": {}},
    ]}  # fmt: skip
    rows = {e["mode"]: dict(zip([c[1] for c in render.API_COLUMNS], cells, strict=True))
            for e, cells in render.api_rows(report)}  # fmt: skip
    assert rows["kpr-api"]["connect_p50_us"] == ("11.0 ×1.01", True)  # ranked by its ratio
    assert rows["kpr-api"]["program_s"] == ("0.50", True)
    assert rows["kube-proxy-iptables"]["idle_cpu"] == ("20.00", True)
    assert not rows["direct"]["connect_p50_us"][1]  # the limit, never a winner
    markdown = render.render_api_markdown(report)
    assert "| 1,000 | kpr-api | **11.0 ×1.01** |" in markdown
    assert "skipped: nft not found" in markdown


def test_the_api_fed_modes_sample_services_across_the_list():
    from bench.modes import api

    services = build_services(30000, 2, ["10.244.1.11", "10.244.1.12"])
    targets = api._ready_targets(services)
    pairs = list(zip(targets[::2], targets[1::2], strict=True))
    assert len(pairs) <= 64  # the load tool's limit
    assert pairs[0] == ("10.96.0.16", "80") and pairs[-1] == (config.CHANGE_VIP, "81")
    assert pairs[-2] == (str(config.VIP_NET[config.VIP_FIRST + 29999]), "80")  # the last one
    for index in services.real:  # every pod-backed Service is among them
        assert (str(config.VIP_NET[config.VIP_FIRST + index]), "80") in pairs
    with pytest.raises(config.BenchError, match="API-fed modes hold at most"):
        config.BenchConfig(sizes=[config.API_MAX_SERVICES + 1], modes=["kpr-api"]).validate()
    config.BenchConfig(sizes=[config.API_MAX_SERVICES + 1], modes=["kpr"]).validate()


def test_runs_at_different_sizes_make_one_table_and_plot(tmp_path):
    runs = []
    for size in (1000, 30000):
        summary = {"program_s": size / 1000, "connect_p50_us_ratio": 1.0}
        entry = {"services": size, "mode": "kpr-api", "skipped": None, "summary": summary}
        report = {"command": f"kpr bench --services {size}", "machine": {"cpu": ""},
                  "config": {"endpoints": 10}, "results": [entry]}  # fmt: skip
        runs.append(tmp_path / f"{size}.json")
        runs[-1].write_text(json.dumps(report))
    report = merged(runs)
    assert [e["services"] for e in report["results"]] == [1000, 30000]
    assert [r["command"] for r in report["runs"]] == [
        "kpr bench --services 1000", "kpr bench --services 30000"]  # fmt: skip
    markdown = render.render_api_markdown(report)
    assert "| 1,000 | kpr-api |" in markdown and "| 30,000 | kpr-api |" in markdown
    write_plot(report, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000
