"""kube-proxy's configuration file (`kubeproxy.config.k8s.io/v1alpha1` KubeProxyConfiguration).

kpr reads the same file as kube-proxy, so an existing kube-proxy ConfigMap can be pointed at
it. The fields that carry over become a ProxyConfig with kube-proxy's defaulting applied
(pkg/proxy/apis/config/v1alpha1/defaults.go) and kube-proxy's validation rules; everything
else is accepted and reported in notes, one per field that asks for something kpr does not
do. Parsing is pure: no files, no sockets, no host look-ups.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fractions import Fraction
from ipaddress import ip_address, ip_network
from typing import Any

import yaml

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"
PROXY_HEALTHZ_PORT = 10256  # ports.ProxyHealthzPort
PROXY_STATUS_PORT = 10249  # ports.ProxyStatusPort
NODE_PORT_ADDRESSES_PRIMARY = "primary"
PROXY_MODES = ("", "iptables", "ipvs", "nftables", "kernelspace")
DEFAULT_SYNC_PERIOD = 30.0
DEFAULT_MIN_SYNC_PERIOD = 1.0
DEFAULT_CONFIG_SYNC_PERIOD = 900.0
DEFAULT_QPS = 5.0
DEFAULT_BURST = 10


class ConfigError(ValueError):
    """A configuration file kpr cannot use, naming the file, the field and the value."""


@dataclass(frozen=True)
class Conntrack:
    """The conntrack section with kube-proxy's defaults (a null field gets the default; an
    explicit 0 asks kube-proxy to leave that sysctl alone)."""

    max_per_core: int = 32768
    min: int = 131072
    tcp_established_timeout: float = 86400.0
    tcp_close_wait_timeout: float = 3600.0
    tcp_be_liberal: bool = False
    udp_timeout: float = 0.0
    udp_stream_timeout: float = 0.0

    def sysctls(self, cpus: int) -> dict[str, int]:
        """What kube-proxy would write under net.netfilter at start (server_linux.go)."""
        out: dict[str, int] = {}
        if self.max_per_core > 0:
            out["nf_conntrack_max"] = max(self.max_per_core * cpus, self.min)
        for name, seconds in (
            ("nf_conntrack_tcp_timeout_established", self.tcp_established_timeout),
            ("nf_conntrack_tcp_timeout_close_wait", self.tcp_close_wait_timeout),
            ("nf_conntrack_udp_timeout", self.udp_timeout),
            ("nf_conntrack_udp_timeout_stream", self.udp_stream_timeout),
        ):
            if seconds > 0:
                out[name] = int(seconds)
        if self.tcp_be_liberal:
            out["nf_conntrack_tcp_be_liberal"] = 1
        return out


@dataclass
class ProxyConfig:
    """The settings kpr takes from a KubeProxyConfiguration; defaults are kube-proxy's.

    Durations are in seconds. A bind address of "" means that server is not started; the
    file cannot ask for that (kube-proxy defaults an empty address), but a caller may.
    """

    hostname_override: str | None = None
    bind_address: str = "0.0.0.0"
    healthz_bind_address: str = f"0.0.0.0:{PROXY_HEALTHZ_PORT}"
    metrics_bind_address: str = f"127.0.0.1:{PROXY_STATUS_PORT}"
    cluster_cidr: str = ""
    node_port_addresses: list[str] = field(default_factory=list)
    min_sync_period: float = DEFAULT_MIN_SYNC_PERIOD
    sync_period: float = DEFAULT_SYNC_PERIOD
    localhost_node_ports: bool = True
    config_sync_period: float = DEFAULT_CONFIG_SYNC_PERIOD
    kubeconfig: str | None = None
    api_qps: float = DEFAULT_QPS
    api_burst: int = DEFAULT_BURST
    # read only to say what kpr does not do (unused()); not compared
    conntrack: Conntrack = field(default_factory=Conntrack, compare=False)

    def unused(self, cpus: int) -> list[str]:
        """One line per setting kpr reads and does not act on, saying what kube-proxy
        does with it instead; the conntrack sysctls always, as kube-proxy writes its
        defaults even when the file says nothing."""
        lines = []
        if self.cluster_cidr:
            lines.append(
                f"clusterCIDR {self.cluster_cidr} is not used: kube-proxy tells pod traffic "
                "from other traffic with it to masquerade the other; kpr's socket path needs "
                "no SNAT, and its TC path masquerades by where the backend is"
            )
        if self.config_sync_period != DEFAULT_CONFIG_SYNC_PERIOD:
            lines.append(
                f"configSyncPeriod {go_duration(self.config_sync_period)} is not used: it is "
                "kube-proxy's informer resync; kpr re-reads nothing from a cache, its full "
                f"sync runs every syncPeriod ({go_duration(self.sync_period)})"
            )
        if (self.api_qps, self.api_burst) != (DEFAULT_QPS, DEFAULT_BURST):
            lines.append(
                f"clientConnection.qps {self.api_qps:g} and burst {self.api_burst} are not "
                "used: kpr makes only list and watch requests, one at a time per resource, "
                "with its own back-off"
            )
        sysctls = self.conntrack.sysctls(cpus)
        if sysctls:
            settings = ", ".join(f"net.netfilter.{k}={v}" for k, v in sysctls.items())
            lines.append(
                f"conntrack is not applied: kube-proxy would set {settings}; kpr leaves the "
                "node's conntrack sysctls as they are (its Service traffic makes no "
                "conntrack entries). Set them with sysctl if the node's other traffic "
                "relied on kube-proxy's"
            )
        return lines

    def configz(self) -> dict[str, Any]:
        """The configuration in use, as kube-proxy's /configz shows its own (the
        KubeProxyConfiguration's field names, durations as Go writes them)."""
        periods = {
            "syncPeriod": go_duration(self.sync_period),
            "minSyncPeriod": go_duration(self.min_sync_period),
        }
        return {
            "bindAddress": self.bind_address,
            "healthzBindAddress": self.healthz_bind_address,
            "metricsBindAddress": self.metrics_bind_address,
            "hostnameOverride": self.hostname_override or "",
            "clusterCIDR": self.cluster_cidr,
            "nodePortAddresses": list(self.node_port_addresses),
            "configSyncPeriod": go_duration(self.config_sync_period),
            "clientConnection": {
                "kubeconfig": self.kubeconfig or "",
                "qps": self.api_qps,
                "burst": self.api_burst,
            },
            "iptables": {**periods, "localhostNodePorts": self.localhost_node_ports},
            "mode": "",
        }


# --- Go's time.ParseDuration --------------------------------------------------------

_DURATION_UNITS_NS = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,  # micro sign
    "\u03bcs": 1_000,  # Greek small letter mu
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
_DURATION_PART = re.compile(r"([0-9]*)(?:\.([0-9]*))?([^0-9.]*)")  # Go: ASCII digits only
_MAX_DURATION_NS = (1 << 63) - 1  # time.Duration is an int64 of nanoseconds


def parse_duration(text: str) -> float:
    """Seconds in a Go duration string ("1s", "1m0s", "500ms", "1h2m3.5s", "-2s", "0").

    Accepts exactly what time.ParseDuration accepts, to the nanosecond: a sign, then one
    or more decimal numbers each with a unit (ns, us, µs, ms, s, m, h); "0" needs none.
    """
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not a duration")
    rest, sign = text, 1
    if rest[:1] in ("-", "+"):
        sign = -1 if rest[0] == "-" else 1
        rest = rest[1:]
    if rest == "0":
        return 0.0
    if not rest:
        raise ValueError(f"{text!r} is not a duration")
    total = Fraction(0)
    while rest:
        match = _DURATION_PART.match(rest)
        assert match is not None  # every group may be empty, so it always matches
        whole, frac, unit = match.groups()
        if not whole and not frac:  # "." alone, or a unit with no number
            raise ValueError(f"{text!r} is not a duration")
        if unit not in _DURATION_UNITS_NS:
            raise ValueError(f"{text!r} is not a duration")
        number = Fraction(int(whole or "0"))
        if frac:
            number += Fraction(int(frac), 10 ** len(frac))
        total += int(number * _DURATION_UNITS_NS[unit])  # Go truncates below 1ns
        rest = rest[match.end() :]
    if total > _MAX_DURATION_NS:
        raise ValueError(f"{text!r} is not a duration: out of range")
    return sign * int(total) / 1e9


def go_duration(seconds: float) -> str:
    """Seconds as Go's time.Duration.String() writes them: "30s", "1m0s", "1.5s", "15m0s"."""
    nanos = round(seconds * 1e9)
    if nanos == 0:
        return "0s"
    sign, nanos = ("-", -nanos) if nanos < 0 else ("", nanos)
    if nanos < 1_000_000_000:
        for unit, size in (("ms", 1_000_000), ("\u00b5s", 1_000), ("ns", 1)):
            if nanos >= size:
                return f"{sign}{_decimal(nanos, size)}{unit}"
    hours, rest = divmod(nanos, 3_600_000_000_000)
    minutes, rest = divmod(rest, 60_000_000_000)
    text = f"{_decimal(rest, 1_000_000_000)}s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return sign + text


def _decimal(value: int, unit: int) -> str:
    whole, fraction = divmod(value, unit)
    if not fraction:
        return str(whole)
    digits = len(str(unit)) - 1
    return f"{whole}.{fraction:0{digits}d}".rstrip("0")


# --- Go's net.SplitHostPort -----------------------------------------------------------


def split_host_port(text: str) -> tuple[str, int]:
    """("host", port) from "host:port", "[v6]:port" or ":port" (host ""), as Go splits them.

    Port 0 is allowed (an ephemeral port); the host is returned without brackets and is
    not checked to be an address.
    """
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not host:port")
    if text.startswith("["):
        close = text.find("]")
        if close < 0 or text[close + 1 : close + 2] != ":":
            raise ValueError(f"{text!r} is not host:port")
        host, port = text[1:close], text[close + 2 :]
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise ValueError(f"{text!r} is not host:port: missing port")
        if ":" in host:
            raise ValueError(f"{text!r} is not host:port: an IPv6 address needs brackets")
    if not port.isascii() or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{text!r} is not host:port: {port!r} is not a port")
    return host, int(port)


# --- what kpr ignores, and why ----------------------------------------------------------

_NO_SNAT = "kpr rewrites the connect() and needs no SNAT"
_NO_CONNTRACK = "kpr creates no conntrack entries"
_NO_IPVS = "kpr has no IPVS mode"
_NO_WINDOWS = "kpr runs on Linux only"

# Fields kube-proxy knows that kpr accepts and ignores: path -> (reason, kube-proxy's
# default; durations in seconds). A field left at its zero value or that default asks for
# nothing, so only other values are noted: a stock kubeadm ConfigMap gives no notes.
_IGNORED: dict[str, tuple[str, object]] = {
    "featureGates": ("kpr has no kube-proxy feature gates", None),
    "logging": ("kpr logs to stderr in its own format", None),
    "bindAddressHardFail": ("kpr always fails when it cannot bind", None),
    "enableProfiling": ("kpr serves no /debug/pprof", None),
    "showHiddenMetricsForVersion": ("kpr hides no metrics", None),
    "oomScoreAdj": ("set the Pod's resources instead", -999),
    "portRange": ("it was for the removed userspace proxy", None),
    "udpIdleTimeout": ("it was for the removed userspace proxy", 0.25),
    "windowsRunAsService": (_NO_WINDOWS, None),
    "detectLocalMode": (_NO_SNAT, "ClusterCIDR"),
    "detectLocal": (_NO_SNAT, None),
    "clientConnection.acceptContentTypes": ("kpr's API client speaks JSON", None),
    "clientConnection.contentType": (
        "kpr's API client speaks JSON",
        "application/vnd.kubernetes.protobuf",
    ),
    "iptables.masqueradeAll": (_NO_SNAT, None),
    "iptables.masqueradeBit": (_NO_SNAT, 14),
    "iptables.snatNodeInternalIP": (_NO_SNAT, None),
    "nftables.masqueradeAll": (_NO_SNAT, None),
    "nftables.masqueradeBit": (_NO_SNAT, 14),
    "ipvs.scheduler": (_NO_IPVS, None),
    "ipvs.excludeCIDRs": (_NO_IPVS, None),
    "ipvs.strictARP": (_NO_IPVS, None),
    "ipvs.tcpTimeout": (_NO_IPVS, None),
    "ipvs.tcpFinTimeout": (_NO_IPVS, None),
    "ipvs.udpTimeout": (_NO_IPVS, None),
    "conntrack.maxPerCore": (_NO_CONNTRACK, 32768),
    "conntrack.min": (_NO_CONNTRACK, 131072),
    "conntrack.tcpEstablishedTimeout": (_NO_CONNTRACK, 86400.0),
    "conntrack.tcpCloseWaitTimeout": (_NO_CONNTRACK, 3600.0),
    "conntrack.tcpBeLiberal": (_NO_CONNTRACK, None),
    "conntrack.udpTimeout": (_NO_CONNTRACK, None),
    "conntrack.udpStreamTimeout": (_NO_CONNTRACK, None),
    "winkernel": (_NO_WINDOWS, None),
}
# Fields read below. The sync periods of all three modes are known; only the one the mode
# selects is used, as kube-proxy does (v1alpha1 conversion).
_SECTIONS = ("clientConnection", "iptables", "ipvs", "nftables", "conntrack")
_READ = {
    "apiVersion",
    "kind",
    "hostnameOverride",
    "bindAddress",
    "healthzBindAddress",
    "metricsBindAddress",
    "clusterCIDR",
    "nodePortAddresses",
    "configSyncPeriod",
    "mode",
    "clientConnection.kubeconfig",
    "clientConnection.qps",
    "clientConnection.burst",
    "iptables.localhostNodePorts",
    *(
        f"{m}.{p}"
        for m in ("iptables", "ipvs", "nftables")
        for p in ("syncPeriod", "minSyncPeriod")
    ),
}


def _is_unremarkable(value: object, default: object) -> bool:
    """Zero, empty, null or kube-proxy's own default: the field asks for nothing."""
    if value is None or value is False or value == 0 or value == "":
        return True
    if isinstance(value, dict):
        return all(_is_unremarkable(v, None) for v in value.values())
    if isinstance(value, list):
        return not value
    if isinstance(value, str) and (default is None or isinstance(default, float)):
        try:  # a duration: "0s", or the default however it is written
            return parse_duration(value) in (0, default)
        except ValueError:
            return False
    return value == default


class _Reader:
    """Typed access to the parsed document; each error names the source and field path."""

    def __init__(self, doc: dict[str, Any], source: str) -> None:
        self.doc = doc
        self.source = source

    def error(self, path: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {path}: {message}")

    def get(self, path: str) -> object:
        node: object = self.doc
        for part in path.split("."):
            if not isinstance(node, dict):
                return None
            node = node.get(part)
        return node

    def string(self, path: str) -> str:
        value = self.get(path)
        if value is None:
            return ""
        if not isinstance(value, str):
            raise self.error(path, f"{value!r} is not a string")
        return value

    def boolean(self, path: str, default: bool) -> bool:
        value = self.get(path)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(path, f"{value!r} is not true or false")
        return value

    def number(self, path: str) -> float:
        value = self.get(path)
        if value is None:
            return 0.0
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(path, f"{value!r} is not a number")
        return float(value)

    def duration(self, path: str) -> float:
        """Seconds; 0 when unset, as metav1.Duration's zero value."""
        value = self.get(path)
        if value is None:
            return 0.0
        try:
            return parse_duration(value)  # type: ignore[arg-type]
        except ValueError:
            raise self.error(path, f"{value!r} is not a duration") from None


def load_config(text: str, source: str = "<config>") -> tuple[ProxyConfig, list[str]]:
    """The ProxyConfig in a KubeProxyConfiguration document, and notes on ignored fields.

    Raises ConfigError for a document kube-proxy would refuse: not YAML, not a mapping,
    another apiVersion or kind, a field of the wrong type or an invalid value.
    """
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: not a mapping but {type(doc).__name__}")
    r = _Reader(doc, source)
    if doc.get("apiVersion") != API_VERSION:
        raise r.error("apiVersion", f"{doc.get('apiVersion')!r} is not {API_VERSION!r}")
    if doc.get("kind") != KIND:
        raise r.error("kind", f"{doc.get('kind')!r} is not {KIND!r}")
    for section in _SECTIONS:
        if doc.get(section) is not None and not isinstance(doc[section], dict):
            raise r.error(section, f"{doc[section]!r} is not a mapping")

    mode = r.string("mode")
    if mode not in PROXY_MODES:
        raise r.error("mode", f"{mode!r} is not one of {', '.join(repr(m) for m in PROXY_MODES)}")
    # kube-proxy reads the periods of the section its mode names; "" means iptables.
    periods = mode if mode in ("ipvs", "nftables") else "iptables"

    bind_address = r.string("bindAddress") or "0.0.0.0"
    try:
        ipv4 = ip_address(bind_address).version == 4
    except ValueError:
        raise r.error("bindAddress", f"{bind_address!r} is not an IP address") from None
    healthz_host, metrics_host = ("0.0.0.0", "127.0.0.1") if ipv4 else ("[::]", "[::1]")

    sync_period = r.duration(f"{periods}.syncPeriod") or DEFAULT_SYNC_PERIOD
    min_sync_period = r.duration(f"{periods}.minSyncPeriod") or DEFAULT_MIN_SYNC_PERIOD
    if sync_period <= 0:
        raise r.error(f"{periods}.syncPeriod", "must be greater than 0")
    if min_sync_period < 0:
        raise r.error(f"{periods}.minSyncPeriod", "must be greater than or equal to 0")
    if min_sync_period > sync_period:
        raise r.error(
            f"{periods}.syncPeriod",
            f"must be greater than or equal to {periods}.minSyncPeriod",
        )
    config_sync_period = r.duration("configSyncPeriod") or DEFAULT_CONFIG_SYNC_PERIOD
    if config_sync_period <= 0:
        raise r.error("configSyncPeriod", "must be greater than 0")

    burst = r.number("clientConnection.burst")
    if burst < 0 or burst != int(burst):
        raise r.error("clientConnection.burst", f"{burst:g} is not a whole number >= 0")
    hostname = r.string("hostnameOverride").strip().lower()  # as nodeutil.GetHostname
    config = ProxyConfig(
        hostname_override=hostname or None,
        bind_address=bind_address,
        healthz_bind_address=_bind_address(
            r, "healthzBindAddress", f"{healthz_host}:{PROXY_HEALTHZ_PORT}"
        ),
        metrics_bind_address=_bind_address(
            r, "metricsBindAddress", f"{metrics_host}:{PROXY_STATUS_PORT}"
        ),
        cluster_cidr=_cluster_cidr(r),
        node_port_addresses=_node_port_addresses(r),
        min_sync_period=min_sync_period,
        sync_period=sync_period,
        # Only kube-proxy's iptables mode serves NodePorts on localhost; in its other
        # modes an operator never had them, so kpr does not start offering them.
        localhost_node_ports=periods == "iptables"
        and r.boolean("iptables.localhostNodePorts", True),
        config_sync_period=config_sync_period,
        kubeconfig=r.string("clientConnection.kubeconfig") or None,
        api_qps=r.number("clientConnection.qps") or DEFAULT_QPS,
        api_burst=int(burst) or DEFAULT_BURST,
        conntrack=_conntrack(r),
    )
    return config, _notes(doc, mode, periods, source)


def _conntrack(r: _Reader) -> Conntrack:
    """kube-proxy's defaulting: null takes the default, 0 is kept (leave the sysctl)."""
    default = Conntrack()

    def count(name: str, fallback: int) -> int:
        path = f"conntrack.{name}"
        if r.get(path) is None:
            return fallback
        value = r.number(path)
        if value < 0 or value != int(value):
            raise r.error(path, f"{value:g} is not a whole number >= 0")
        return int(value)

    def seconds(name: str, fallback: float) -> float:
        path = f"conntrack.{name}"
        if r.get(path) is None:
            return fallback
        value = r.duration(path)
        if value < 0:
            raise r.error(path, "must be greater than or equal to 0")
        return value

    return Conntrack(
        max_per_core=count("maxPerCore", default.max_per_core),
        min=count("min", default.min),
        tcp_established_timeout=seconds("tcpEstablishedTimeout", default.tcp_established_timeout),
        tcp_close_wait_timeout=seconds("tcpCloseWaitTimeout", default.tcp_close_wait_timeout),
        tcp_be_liberal=r.boolean("conntrack.tcpBeLiberal", False),
        udp_timeout=seconds("udpTimeout", 0.0),
        udp_stream_timeout=seconds("udpStreamTimeout", 0.0),
    )


def _bind_address(r: _Reader, path: str, default: str) -> str:
    """kube-proxy's rules: empty means the default; a bare IP gets the default port."""
    value = r.string(path)
    if not value:
        return default
    try:
        host, port = split_host_port(value)
    except ValueError:
        try:  # proxyutil.AppendPortIfNeeded
            ip = ip_address(value)
        except ValueError:
            raise r.error(path, f"{value!r} is not IP:port") from None
        port = int(default.rpartition(":")[2])
        return f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}"
    if host:
        try:
            ip_address(host)
        except ValueError:
            raise r.error(path, f"{host!r} in {value!r} is not an IP address") from None
    if not 1 <= port <= 65535:
        raise r.error(path, f"{port} in {value!r} is not a valid port (1-65535)")
    return value


def _cluster_cidr(r: _Reader) -> str:
    """One CIDR, or a dual-stack pair "v4,v6", as kube-proxy validates it."""
    value = r.string("clusterCIDR")
    if not value:
        return ""
    try:
        networks = [ip_network(part, strict=False) for part in value.split(",")]
    except ValueError:
        raise r.error("clusterCIDR", f"{value!r} is not a CIDR or a dual-stack pair") from None
    if len(networks) > 2 or (len(networks) == 2 and networks[0].version == networks[1].version):
        raise r.error("clusterCIDR", f"{value!r} is not one CIDR or one of each IP family")
    return value


def _node_port_addresses(r: _Reader) -> list[str]:
    value = r.get("nodePortAddresses")
    if value is None:
        return []
    if not isinstance(value, list):
        raise r.error("nodePortAddresses", f"{value!r} is not a list")
    for i, entry in enumerate(value):
        path = f"nodePortAddresses[{i}]"
        if entry == NODE_PORT_ADDRESSES_PRIMARY:
            if len(value) > 1:
                raise r.error(path, "can't use both 'primary' and CIDRs")
            continue
        # Go's net.ParseCIDR: a prefix length is required, host bits may be set.
        if not isinstance(entry, str) or "/" not in entry:
            raise r.error(path, f"{entry!r} is not a CIDR or 'primary'")
        try:
            ip_network(entry, strict=False)
        except ValueError:
            raise r.error(path, f"{entry!r} is not a CIDR or 'primary'") from None
    return list(value)


def _notes(doc: dict[str, Any], mode: str, periods: str, source: str) -> list[str]:
    notes: list[str] = []
    if mode in ("ipvs", "kernelspace"):
        notes.append(
            f"{source}: mode: {mode!r} is ignored: kpr load-balances at the socket"
            + (", and reads its sync periods from ipvs.*" if mode == "ipvs" else "")
        )
    for path, value in _leaves(doc):
        if path in _READ:
            # The periods of the sections the mode does not name are read by neither.
            section, _, name = path.partition(".")
            unused = section in ("iptables", "ipvs", "nftables") and section != periods
            if (
                unused
                and name in ("syncPeriod", "minSyncPeriod")
                and not _is_unremarkable(value, None)
            ):
                notes.append(
                    f"{source}: {path} is ignored: with mode {mode!r} kube-proxy and "
                    f"kpr read {periods}.{name}"
                )
            continue
        known = next((p for p in _IGNORED if path == p or path.startswith(p + ".")), None)
        if known is None:
            notes.append(f"{source}: {path} is not a KubeProxyConfiguration field; ignored")
            continue
        reason, default = _IGNORED[known]
        if not _is_unremarkable(value, default):
            notes.append(f"{source}: {path} is ignored: {reason}")
    return notes


def _leaves(doc: dict[str, Any]) -> list[tuple[str, object]]:
    """(dotted path, value) of each field, descending only into the known sections.

    An ignored subtree (logging, featureGates, winkernel, detectLocal) is one entry, so it
    gets one note.
    """
    out: list[tuple[str, object]] = []
    for key, value in doc.items():
        if key in _SECTIONS and isinstance(value, dict):
            out.extend((f"{key}.{k}", v) for k, v in value.items())
        else:
            out.append((str(key), value))
    return out
