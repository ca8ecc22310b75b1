"""kube-proxy's configuration file (kpr/cli/config.py): defaults, parsing, validation, notes."""

from __future__ import annotations

import pytest

from kpr.cli.config import (
    ConfigError,
    ProxyConfig,
    go_duration,
    load_config,
    parse_duration,
    split_host_port,
)

HEADER = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"

# config.conf of the kube-proxy ConfigMap as kubeadm (v1.30) writes it, with what cluster
# admins commonly change: a kubeconfig path, clusterCIDR, strictARP for MetalLB, conntrack.
KUBEADM_CONFIG_CONF = """\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 0s
conntrack:
  maxPerCore: 0
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: true
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"""


def load(body: str) -> tuple[ProxyConfig, list[str]]:
    return load_config(HEADER + body, source="kube-proxy.yaml")


def error_of(body: str) -> str:
    with pytest.raises(ConfigError) as e:
        load(body)
    return str(e.value)


# --- defaults ------------------------------------------------------------------------


def test_defaults_are_kube_proxys() -> None:
    # pkg/proxy/apis/config/v1alpha1/defaults.go and pkg/cluster/ports
    expected = ProxyConfig(
        hostname_override=None,
        bind_address="0.0.0.0",
        healthz_bind_address="0.0.0.0:10256",
        metrics_bind_address="127.0.0.1:10249",
        cluster_cidr="",
        node_port_addresses=[],
        min_sync_period=1.0,
        sync_period=30.0,
        localhost_node_ports=True,
        config_sync_period=900.0,
        kubeconfig=None,
        api_qps=5.0,
        api_burst=10,
    )
    assert ProxyConfig() == expected
    assert load("") == (expected, [])


def test_ipv6_bind_address_moves_the_default_server_addresses() -> None:
    config, _ = load("bindAddress: '::'\n")
    assert config.healthz_bind_address == "[::]:10256"
    assert config.metrics_bind_address == "[::1]:10249"


# --- a real ConfigMap ----------------------------------------------------------------


def test_kubeadm_config_conf_loads_with_kube_proxys_values() -> None:
    config, notes = load_config(KUBEADM_CONFIG_CONF, source="config.conf")
    assert config == ProxyConfig(
        cluster_cidr="10.244.0.0/16",
        kubeconfig="/var/lib/kube-proxy/kubeconfig.conf",
    )
    # Zero and null values ask for nothing; only strictARP asks for something kpr won't do.
    assert notes == ["config.conf: ipvs.strictARP is ignored: kpr has no IPVS mode"]


def test_written_out_defaults_give_no_notes() -> None:
    # What `kube-proxy --write-config-to` prints: every default spelled out.
    body = """
clientConnection: {contentType: application/vnd.kubernetes.protobuf, burst: 10, qps: 5}
conntrack: {maxPerCore: 32768, min: 131072, tcpCloseWaitTimeout: 1h0m0s,
            tcpEstablishedTimeout: 24h0m0s}
iptables: {masqueradeBit: 14, minSyncPeriod: 1s, syncPeriod: 30s, localhostNodePorts: true}
oomScoreAdj: -999
detectLocalMode: ClusterCIDR
configSyncPeriod: 15m0s
"""
    assert load(body) == (ProxyConfig(), [])


def test_ignored_fields_are_noted_one_line_each() -> None:
    body = """
mode: ipvs
ipvs: {scheduler: lc, syncPeriod: 10s, minSyncPeriod: 2s}
iptables: {masqueradeAll: true, syncPeriod: 5s}
conntrack: {maxPerCore: 0, tcpEstablishedTimeout: 2h}
featureGates: {SomeGate: true}
winkernel: {enableDSR: true}
udpIdleTimeout: 250ms
someNewField: 1
clientConnection: {contentType: application/json, bogus: x}
"""
    config, notes = load(body)
    assert (config.sync_period, config.min_sync_period) == (10.0, 2.0)
    assert notes == [
        "kube-proxy.yaml: mode: 'ipvs' is ignored: kpr load-balances at the socket, "
        "and reads its sync periods from ipvs.*",
        "kube-proxy.yaml: ipvs.scheduler is ignored: kpr has no IPVS mode",
        "kube-proxy.yaml: iptables.masqueradeAll is ignored: kpr rewrites the connect() "
        "and needs no SNAT",
        "kube-proxy.yaml: iptables.syncPeriod is ignored: with mode 'ipvs' kube-proxy and "
        "kpr read ipvs.syncPeriod",
        "kube-proxy.yaml: conntrack.tcpEstablishedTimeout is ignored: kpr creates no "
        "conntrack entries",
        "kube-proxy.yaml: featureGates is ignored: kpr has no kube-proxy feature gates",
        "kube-proxy.yaml: winkernel is ignored: kpr runs on Linux only",
        "kube-proxy.yaml: someNewField is not a KubeProxyConfiguration field; ignored",
        "kube-proxy.yaml: clientConnection.contentType is ignored: kpr's API client speaks JSON",
        "kube-proxy.yaml: clientConnection.bogus is not a KubeProxyConfiguration field; ignored",
    ]


# --- fields that carry over ------------------------------------------------------------


def test_periods_come_from_the_section_the_mode_names() -> None:
    body = "iptables: {syncPeriod: 1m0s, minSyncPeriod: 500ms}\n"
    body += "nftables: {syncPeriod: 20s, minSyncPeriod: 2s}\n"
    iptables, _ = load(body)
    assert (iptables.sync_period, iptables.min_sync_period) == (60.0, 0.5)
    explicit, _ = load(body + "mode: iptables\n")
    assert explicit == iptables
    nftables, notes = load(body + "mode: nftables\n")
    assert (nftables.sync_period, nftables.min_sync_period) == (20.0, 2.0)
    assert [n.split(": ")[1] for n in notes] == [
        "iptables.syncPeriod is ignored",
        "iptables.minSyncPeriod is ignored",
    ]


def test_zero_periods_mean_kube_proxys_defaults() -> None:
    # defaults.go defaults a zero metav1.Duration; 0s cannot be configured through the file.
    config, _ = load("iptables: {syncPeriod: 0s, minSyncPeriod: 0s}\nconfigSyncPeriod: '0'\n")
    assert (config.sync_period, config.min_sync_period, config.config_sync_period) == (
        30.0,
        1.0,
        900.0,
    )


def test_localhost_node_ports_only_in_iptables_mode() -> None:
    assert load("iptables: {localhostNodePorts: false}\n")[0].localhost_node_ports is False
    assert load("mode: nftables\n")[0].localhost_node_ports is False
    assert load("mode: iptables\n")[0].localhost_node_ports is True


def test_carried_over_fields() -> None:
    config, notes = load(
        """
hostnameOverride: ' Node-1.Example '
bindAddress: 10.0.0.5
healthzBindAddress: 10.0.0.5
metricsBindAddress: 0.0.0.0:9999
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
nodePortAddresses: [10.0.0.0/8, '2001:db8::/64', 192.168.1.7/24]
configSyncPeriod: 1h
clientConnection: {kubeconfig: /etc/kube-proxy/kubeconfig, qps: 20.5, burst: 40}
"""
    )
    assert notes == []
    assert config.hostname_override == "node-1.example"  # trimmed and lowered, as upstream
    assert config.bind_address == "10.0.0.5"
    assert config.healthz_bind_address == "10.0.0.5:10256"  # AppendPortIfNeeded
    assert config.metrics_bind_address == "0.0.0.0:9999"
    assert config.cluster_cidr == "10.244.0.0/16,fd00:10:244::/56"
    assert config.node_port_addresses == ["10.0.0.0/8", "2001:db8::/64", "192.168.1.7/24"]
    assert config.config_sync_period == 3600.0
    assert config.kubeconfig == "/etc/kube-proxy/kubeconfig"
    assert (config.api_qps, config.api_burst) == (20.5, 40)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("':10256'", ":10256"),
        ("'[::]:10256'", "[::]:10256"),
        ("'::1'", "[::1]:10256"),
        ("'127.0.0.1:1'", "127.0.0.1:1"),
    ],
)
def test_healthz_bind_address_forms(value: str, expected: str) -> None:
    assert load(f"healthzBindAddress: {value}\n")[0].healthz_bind_address == expected


def test_primary_node_port_addresses() -> None:
    assert load("nodePortAddresses: [primary]\n")[0].node_port_addresses == ["primary"]


# --- bad values name the file, the field and the value ------------------------------------


BAD_VALUES = [
    ("iptables: {syncPeriod: 3x}", "iptables.syncPeriod: '3x' is not a duration"),
    ("iptables: {syncPeriod: 30}", "iptables.syncPeriod: 30 is not a duration"),
    (
        "mode: nftables\nnftables: {minSyncPeriod: 1 s}",
        "nftables.minSyncPeriod: '1 s' is not a duration",
    ),
    ("configSyncPeriod: 15 minutes", "configSyncPeriod: '15 minutes' is not a duration"),
    ("iptables: {syncPeriod: -1s}", "iptables.syncPeriod: must be greater than 0"),
    (
        "iptables: {syncPeriod: 1s, minSyncPeriod: 2s}",
        "iptables.syncPeriod: must be greater than or equal to iptables.minSyncPeriod",
    ),
    (
        "healthzBindAddress: localhost:10256",
        "healthzBindAddress: 'localhost' in 'localhost:10256' is not an IP address",
    ),
    (
        "metricsBindAddress: '127.0.0.1:0'",
        "metricsBindAddress: 0 in '127.0.0.1:0' is not a valid port (1-65535)",
    ),
    ("metricsBindAddress: '::1:10249'", "metricsBindAddress: '::1:10249' is not IP:port"),
    ("metricsBindAddress: 127.0.0.1:http", "metricsBindAddress: '127.0.0.1:http' is not IP:port"),
    ("bindAddress: node1", "bindAddress: 'node1' is not an IP address"),
    (
        "nodePortAddresses: [10.0.0.1]",
        "nodePortAddresses[0]: '10.0.0.1' is not a CIDR or 'primary'",
    ),
    (
        "nodePortAddresses: [10.0.0.0/8, 1.2.3/24]",
        "nodePortAddresses[1]: '1.2.3/24' is not a CIDR or 'primary'",
    ),
    (
        "nodePortAddresses: [10.0.0.0/8, primary]",
        "nodePortAddresses[1]: can't use both 'primary' and CIDRs",
    ),
    ("nodePortAddresses: 10.0.0.0/8", "nodePortAddresses: '10.0.0.0/8' is not a list"),
    (
        "clusterCIDR: 10.0.0.0/8,10.1.0.0/16",
        "clusterCIDR: '10.0.0.0/8,10.1.0.0/16' is not one CIDR or one of each IP family",
    ),
    ("clusterCIDR: 10.0.0.0/33", "clusterCIDR: '10.0.0.0/33' is not a CIDR or a dual-stack pair"),
    (
        "mode: userspace",
        "mode: 'userspace' is not one of '', 'iptables', 'ipvs', 'nftables', 'kernelspace'",
    ),
    ("hostnameOverride: 5", "hostnameOverride: 5 is not a string"),
    (
        "iptables: {localhostNodePorts: 'yes please'}",
        "iptables.localhostNodePorts: 'yes please' is not true or false",
    ),
    ("clientConnection: {burst: -1}", "clientConnection.burst: -1 is not a whole number >= 0"),
    ("clientConnection: {qps: fast}", "clientConnection.qps: 'fast' is not a number"),
    ("iptables: [syncPeriod]", "iptables: ['syncPeriod'] is not a mapping"),
]


@pytest.mark.parametrize(("body", "message"), BAD_VALUES)
def test_bad_values_name_the_file_and_field(body: str, message: str) -> None:
    assert error_of(body + "\n") == f"kube-proxy.yaml: {message}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("apiVersion: v1\nkind: ConfigMap\n", "kube-proxy.yaml: apiVersion: 'v1' is not "
         "'kubeproxy.config.k8s.io/v1alpha1'"),
        ("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n",
         "kube-proxy.yaml: kind: 'KubeletConfiguration' is not 'KubeProxyConfiguration'"),
        ("- a\n- b\n", "kube-proxy.yaml: not a mapping but list"),
        ("", "kube-proxy.yaml: not a mapping but NoneType"),
    ],
)  # fmt: skip
def test_not_a_kube_proxy_configuration(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(text, source="kube-proxy.yaml")
    assert str(e.value) == message


def test_not_yaml() -> None:
    with pytest.raises(ConfigError, match=r"^kube-proxy.yaml: not valid YAML: "):
        load_config("mode: [unclosed\n", source="kube-proxy.yaml")


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


# --- Go's time.ParseDuration ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("0", 0.0),
        ("0s", 0.0),
        ("-0", 0.0),
        ("1s", 1.0),
        ("30s", 30.0),
        ("1m0s", 60.0),
        ("15m0s", 900.0),
        ("500ms", 0.5),
        ("1h2m3.5s", 3723.5),
        ("24h0m0s", 86400.0),
        ("1.5h", 5400.0),
        ("-1.5h", -5400.0),
        ("+2s", 2.0),
        (".5s", 0.5),
        ("5.s", 5.0),
        ("1s1s", 2.0),  # Go sums repeated units
        ("250ms", 0.25),
        ("1ns", 1e-9),
        ("1us", 1e-6),
        ("1\u00b5s", 1e-6),
        ("1\u03bcs", 1e-6),
        ("1.0000000009s", 1.0),  # Go truncates below a nanosecond
        ("2562047h47m16.854775807s", 9223372036.854775807),  # the largest time.Duration
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    ["", "1", "3x", "s", ".s", ".", "1s2", "--1s", "+", "-", "1d", "1 s", " 1s", "1S",
     "\u0661s", "2562047h47m16.854775808s"],
)  # fmt: skip
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)


# --- Go's net.SplitHostPort ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.0.0.0:10256", ("0.0.0.0", 10256)),
        (":10256", ("", 10256)),
        ("[::]:10256", ("::", 10256)),
        ("[fe80::1%eth0]:80", ("fe80::1%eth0", 80)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("localhost:65535", ("localhost", 65535)),
    ],
)
def test_split_host_port(text: str, expected: tuple[str, int]) -> None:
    assert split_host_port(text) == expected


@pytest.mark.parametrize(
    "text", ["10.0.0.1", "::1:80", "[::1]80", "[::1", "h:65536", "h:-1", "h:", "h:http"]
)
def test_split_host_port_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        split_host_port(text)


@pytest.mark.parametrize(
    "seconds, text",
    [(30, "30s"), (1, "1s"), (0.5, "500ms"), (900, "15m0s"), (3723.5, "1h2m3.5s"), (0, "0s")],
)
def test_go_duration_writes_what_go_writes_and_parses_back(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text
    assert parse_duration(text) == seconds


def test_configz_shows_the_configuration_in_use() -> None:
    config, _ = load_config(KUBEADM_CONFIG_CONF)
    shown = config.configz()
    assert shown["healthzBindAddress"] == "0.0.0.0:10256"
    assert shown["iptables"]["syncPeriod"] == "30s"
    assert shown["clientConnection"]["kubeconfig"] == "/var/lib/kube-proxy/kubeconfig.conf"


def test_kubeadm_config_conf_names_what_kpr_reads_and_does_not_apply() -> None:
    config, _ = load_config(KUBEADM_CONFIG_CONF, source="config.conf")
    unused = config.unused(cpus=4)
    assert [line.split(" ", 1)[0] for line in unused] == ["clusterCIDR", "conntrack"]
    # maxPerCore 0 leaves nf_conntrack_max alone; the null timeouts take kube-proxy's defaults
    assert unused[1].startswith(
        "conntrack is not applied: kube-proxy would set "
        "net.netfilter.nf_conntrack_tcp_timeout_established=86400, "
        "net.netfilter.nf_conntrack_tcp_timeout_close_wait=3600; kpr leaves"
    )


def test_conntrack_is_computed_as_kube_proxy_computes_it() -> None:
    # no conntrack section: kube-proxy's defaults, nf_conntrack_max from the CPUs
    assert ProxyConfig().conntrack.sysctls(cpus=2) == {
        "nf_conntrack_max": 131072,  # 2 x 32768 is below the minimum
        "nf_conntrack_tcp_timeout_established": 86400,
        "nf_conntrack_tcp_timeout_close_wait": 3600,
    }
    config, _ = load(
        "conntrack: {maxPerCore: 65536, min: 0, tcpEstablishedTimeout: 2h, "
        "tcpCloseWaitTimeout: 0s, tcpBeLiberal: true, udpTimeout: 30s}\n"
    )
    assert config.conntrack.sysctls(cpus=8) == {
        "nf_conntrack_max": 524288,
        "nf_conntrack_tcp_timeout_established": 7200,
        "nf_conntrack_udp_timeout": 30,
        "nf_conntrack_tcp_be_liberal": 1,
    }
    assert "conntrack.maxPerCore: -1 is not a whole number >= 0" in error_of(
        "conntrack: {maxPerCore: -1}\n"
    )


def test_other_read_and_unused_fields_are_named() -> None:
    config, _ = load("configSyncPeriod: 1h\nclientConnection: {qps: 50, burst: 100}\n")
    unused = config.unused(cpus=1)
    assert unused[0].startswith("configSyncPeriod 1h0m0s is not used:")
    assert unused[1].startswith("clientConnection.qps 50 and burst 100 are not used:")
    assert [line.split(" ", 1)[0] for line in ProxyConfig().unused(cpus=1)] == ["conntrack"]
