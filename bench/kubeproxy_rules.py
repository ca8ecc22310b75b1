"""kube-proxy's rulesets for a set of ClusterIP service ports, as kube-proxy itself writes them.

Pure text generators, no I/O. They follow upstream's pkg/proxy/iptables/proxier.go and
pkg/proxy/nftables/proxier.go (syncProxyRules) for ClusterIP services with the cluster traffic
policy and no session affinity — what the benchmark needs:

- iptables: the nat table as ``iptables-restore --noflush`` input. Chain names are
  ``KUBE-SVC-``/``KUBE-SEP-`` + the first 16 characters of base32(sha256(...)); chain
  declarations come first, then the rules, as kube-proxy's natChains/natRules buffers are
  written; ``-m comment`` on per-endpoint rules is dropped above 1,000 endpoints (upstream's
  "large cluster mode"); KUBE-NODEPORTS is the last rule of KUBE-SERVICES.
- nftables: table ``ip kube-proxy`` as ``nft -f`` input, with the ``service-ips`` verdict map
  keyed ``ipv4_addr . inet_proto . inet_service``, one ``service-<hash>-ns/svc/proto/port``
  chain per service port picking an endpoint with ``numgen random mod N vmap``, and
  ``endpoint-<hash>-...`` chains doing the DNAT.

Both also have the one-service update kube-proxy makes when an endpoint changes (its partial
sync), so the benchmark can time "one endpoint change" the way kube-proxy applies it.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MASQ_MARK = "0x4000"  # kube-proxy's default masqueradeBit 14
LARGE_CLUSTER_ENDPOINTS = 1000  # upstream largeClusterEndpointsThreshold
NODEPORTS_COMMENT = "kubernetes service nodeports; NOTE: this must be the last rule in this chain"


@dataclass(frozen=True)
class ServicePort:
    """One port of one Service with its ready endpoints: what a proxier's svcPortMap holds."""

    namespace: str
    name: str
    port_name: str  # "" for a Service's single unnamed port
    protocol: str  # "TCP" | "UDP" | "SCTP"
    cluster_ip: str
    port: int
    endpoints: tuple[tuple[str, int], ...]
    node_port: int | None = None

    @property
    def port_name_string(self) -> str:
        """Upstream ServicePortName.String(): ``ns/svc:port``, or ``ns/svc`` when unnamed."""
        suffix = f":{self.port_name}" if self.port_name else ""
        return f"{self.namespace}/{self.name}{suffix}"

    @property
    def proto(self) -> str:
        return self.protocol.lower()


def _hash(text: str) -> str:
    return base64.b32encode(hashlib.sha256(text.encode()).digest()).decode()


def port_proto_hash(port_name_string: str, protocol: str) -> str:
    """upstream portProtoHash: base32(sha256(servicePortName + protocol))[:16]."""
    return _hash(port_name_string + protocol)[:16]


def svc_chain(sp: ServicePort) -> str:
    """upstream servicePortChainName: e.g. ns1/svc1:p80 + tcp -> KUBE-SVC-XPGD46QRK7WJZT7O."""
    return "KUBE-SVC-" + port_proto_hash(sp.port_name_string, sp.proto)


def sep_chain(sp: ServicePort, endpoint: tuple[str, int]) -> str:
    """upstream servicePortEndpointChainName; the endpoint is hashed as ``ip:port``."""
    ip, port = endpoint
    return "KUBE-SEP-" + _hash(sp.port_name_string + sp.proto + f"{ip}:{port}")[:16]


def probability(n: int) -> str:
    """upstream proxier.probability: fmt.Sprintf("%0.10f", 1.0/float64(n))."""
    return f"{1.0 / n:.10f}"


def _chain_line(chain: str) -> str:
    return f":{chain} - [0:0]"


def _comment(text: str) -> str:
    # iptables-restore input quotes comments holding spaces, as kube-proxy writes them
    return f'"{text}"' if " " in text else text


class _IptablesWriter:
    def __init__(self, services: Sequence[ServicePort], cluster_cidr: str) -> None:
        self.cluster_cidr = cluster_cidr
        total = sum(len(sp.endpoints) for sp in services)
        self.large_cluster = total > LARGE_CLUSTER_ENDPOINTS
        self.chains: list[str] = []
        self.rules: list[str] = []

    def service_comment(self, text: str) -> list[str]:
        # upstream appendServiceCommentLocked: no comment at all in large cluster mode
        return [] if self.large_cluster else ["-m", "comment", "--comment", _comment(text)]

    def top_level(self) -> None:
        for chain in ("KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"):
            self.chains.append(_chain_line(chain))
        self.rules += [
            f"-A KUBE-POSTROUTING -m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN",
            f"-A KUBE-POSTROUTING -j MARK --xor-mark {MASQ_MARK}",
            # --random-fully: iptables here supports it, so kube-proxy adds it
            '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT"'
            " -j MASQUERADE --random-fully",
            f"-A KUBE-MARK-MASQ -j MARK --or-mark {MASQ_MARK}",
        ]

    def service(self, sp: ServicePort, chains: bool = True) -> None:
        """The KUBE-SERVICES rule of ``sp`` and, with ``chains``, its SVC and SEP chains, in
        upstream's order (SVC declared, ClusterIP captured, SVC rules, then the SEP chains)."""
        svc = svc_chain(sp)
        if chains:
            self.chains.append(_chain_line(svc))
        self.rules.append(
            f'-A KUBE-SERVICES -m comment --comment "{sp.port_name_string} cluster IP"'
            f" -m {sp.proto} -p {sp.proto} -d {sp.cluster_ip} --dport {sp.port} -j {svc}"
        )
        if not chains:
            return
        if sp.node_port:
            self.node_port(sp)
        # off-cluster sources reaching a ClusterIP are marked for masquerade (localDetector)
        self.rules.append(
            f'-A {svc} -m comment --comment "{sp.port_name_string} cluster IP"'
            f" -m {sp.proto} -p {sp.proto} -d {sp.cluster_ip} --dport {sp.port}"
            f" ! -s {self.cluster_cidr} -j KUBE-MARK-MASQ"
        )
        n = len(sp.endpoints)
        for i, (ip, port) in enumerate(sp.endpoints):
            args = ["-A", svc, *self.service_comment(f"{sp.port_name_string} -> {ip}:{port}")]
            if i < n - 1:  # each but the last is a probabilistic match
                args += ["-m", "statistic", "--mode", "random", "--probability", probability(n - i)]
            self.rules.append(" ".join([*args, "-j", sep_chain(sp, (ip, port))]))
        for ip, port in sp.endpoints:
            sep = sep_chain(sp, (ip, port))
            self.chains.append(_chain_line(sep))
            comment = self.service_comment(sp.port_name_string)
            # hairpin: an endpoint reaching itself through the service is masqueraded
            self.rules.append(" ".join(["-A", sep, *comment, "-s", ip, "-j", "KUBE-MARK-MASQ"]))
            self.rules.append(
                " ".join(
                    ["-A", sep, *comment, "-m", sp.proto, "-p", sp.proto]
                    + ["-j", "DNAT", "--to-destination", f"{ip}:{port}"]
                )
            )

    def node_port(self, sp: ServicePort) -> None:
        """externalTrafficPolicy Cluster: KUBE-NODEPORTS -> KUBE-EXT- (mark for masquerade)
        -> the service's SVC chain, as upstream's syncProxyRules writes them."""
        ext = "KUBE-EXT-" + svc_chain(sp).removeprefix("KUBE-SVC-")
        self.chains.append(_chain_line(ext))
        self.rules += [
            f"-A KUBE-NODEPORTS -m comment --comment {_comment(sp.port_name_string)}"
            f" -m {sp.proto} -p {sp.proto} --dport {sp.node_port} -j {ext}",
            f"-A {ext} -m comment --comment "
            f'"masquerade traffic for {sp.port_name_string} external destinations"'
            " -j KUBE-MARK-MASQ",
            f"-A {ext} -j {svc_chain(sp)}",
        ]

    def nodeports(self) -> None:
        # nodePortAddresses unset and localhostNodePorts true: every local address
        self.rules.append(
            f'-A KUBE-SERVICES -m comment --comment "{NODEPORTS_COMMENT}"'
            " -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"
        )


JUMP_RULES = (
    # kube-proxy inserts these with `iptables -I` (iptablesJumpChains) before its first restore
    '-I OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
    '-I PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
    '-I POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING',
)


def iptables_restore(
    services: Sequence[ServicePort], cluster_cidr: str, jump_rules: bool = True
) -> str:
    """The nat table of a full sync as ``iptables-restore --noflush`` input.

    ``jump_rules`` folds kube-proxy's separate `iptables -I` calls for the OUTPUT,
    PREROUTING and POSTROUTING jumps into the same input, so one restore sets everything up
    in a fresh network namespace.
    """
    w = _IptablesWriter(services, cluster_cidr)
    w.top_level()
    for sp in services:
        w.service(sp)
    w.nodeports()
    return _nat_table(w, JUMP_RULES if jump_rules else ())


def iptables_partial(
    services: Sequence[ServicePort], changed: Iterable[ServicePort], cluster_cidr: str
) -> str:
    """The nat table of kube-proxy's partial sync after the ``changed`` service ports changed.

    As upstream: the top-level chains and every KUBE-SERVICES rule are written again, the SVC
    and SEP chains only of the changed services. A SEP chain no longer used is left alone: only
    a full sync deletes stale chains.
    """
    w = _IptablesWriter(services, cluster_cidr)
    w.top_level()
    rewrite = {sp.port_name_string + sp.proto for sp in changed}
    for sp in services:
        w.service(sp, chains=sp.port_name_string + sp.proto in rewrite)
    w.nodeports()
    return _nat_table(w, ())


def _nat_table(w: _IptablesWriter, jumps: Sequence[str]) -> str:
    lines = ["*nat", *w.chains, *jumps, *w.rules, "COMMIT"]
    return "\n".join(lines) + "\n"


def iptables_rules_sorted_by_chain(text: str) -> list[str]:
    """For comparisons that do not care about the order of chains (upstream's tests sort too)."""
    return sorted(line for line in text.splitlines() if line.startswith("-A "))


# --- nftables -------------------------------------------------------------------------------

TABLE = "ip kube-proxy"


def nft_service_chain(sp: ServicePort) -> str:
    """upstream servicePortChainNameBase with the ``service-`` prefix:
    e.g. service-ULMVA6XW-ns1/svc1/tcp/p80."""
    base = f"{sp.namespace}/{sp.name}/{sp.proto}/{sp.port_name}"
    return f"service-{_hash(base)[:8]}-{base}"


def nft_endpoint_chain(sp: ServicePort, endpoint: tuple[str, int]) -> str:
    """upstream servicePortEndpointChainNameBase (``ip:port`` written ``ip/port``):
    e.g. endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80."""
    ip, port = endpoint
    base = f"{sp.namespace}/{sp.name}/{sp.proto}/{sp.port_name}__{ip}/{port}"
    return f"endpoint-{_hash(base)[:8]}-{base}"


def _nft_base(service_cidr: str, node_ips: Sequence[str]) -> list[str]:
    t = TABLE
    verdict_map = "type ipv4_addr . inet_proto . inet_service : verdict"
    lines = [
        f'add table {t} {{ comment "rules for kube-proxy" ; }}',
        f'add set {t} cluster-ips {{ type ipv4_addr ; comment "Active ClusterIPs" ; }}',
        f"add set {t} nodeport-ips {{ type ipv4_addr ; "
        'comment "IPs that accept NodePort traffic" ; }',
        f"add map {t} firewall-ips {{ {verdict_map} ; "
        'comment "destinations that are subject to LoadBalancerSourceRanges" ; }',
        f"add map {t} no-endpoint-nodeports {{ type inet_proto . inet_service : verdict ; "
        'comment "vmap to drop or reject packets to service nodeports with no endpoints" ; }',
        f"add map {t} no-endpoint-services {{ {verdict_map} ; "
        'comment "vmap to drop or reject packets to services with no endpoints" ; }',
        f"add map {t} service-ips {{ {verdict_map} ; "
        'comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ; }',
        f"add map {t} service-nodeports {{ type inet_proto . inet_service : verdict ; "
        'comment "NodePort traffic" ; }',
        f"add chain {t} cluster-ips-check",
        f"add chain {t} filter-prerouting-pre-dnat "
        "{ type filter hook prerouting priority -110 ; }",
        f"add chain {t} filter-output-pre-dnat {{ type filter hook output priority -110 ; }}",
        f"add chain {t} filter-forward {{ type filter hook forward priority 0 ; }}",
        f"add chain {t} filter-input {{ type filter hook input priority 0 ; }}",
        f"add chain {t} filter-output {{ type filter hook output priority 0 ; }}",
        f"add chain {t} firewall-check",
        f"add chain {t} mark-for-masquerade",
        f"add chain {t} masquerading",
        f"add chain {t} nat-output {{ type nat hook output priority -100 ; }}",
        f"add chain {t} nat-postrouting {{ type nat hook postrouting priority 100 ; }}",
        f"add chain {t} nat-prerouting {{ type nat hook prerouting priority -100 ; }}",
        f"add chain {t} nodeport-endpoints-check",
        f"add chain {t} reject-chain "
        '{ comment "helper for @no-endpoint-services / @no-endpoint-nodeports" ; }',
        f"add chain {t} services",
        f"add chain {t} service-endpoints-check",
        f"add rule {t} cluster-ips-check ip daddr @cluster-ips reject "
        'comment "Reject traffic to invalid ports of ClusterIPs"',
        f"add rule {t} cluster-ips-check ip daddr {{ {service_cidr} }} drop "
        'comment "Drop traffic to unallocated ClusterIPs"',
        f"add rule {t} filter-prerouting-pre-dnat ct state new jump firewall-check",
        f"add rule {t} filter-forward ct state new jump service-endpoints-check",
        f"add rule {t} filter-forward ct state new jump cluster-ips-check",
        f"add rule {t} filter-input ct state new jump nodeport-endpoints-check",
        f"add rule {t} filter-input ct state new jump service-endpoints-check",
        f"add rule {t} filter-output ct state new jump service-endpoints-check",
        f"add rule {t} filter-output-pre-dnat ct state new jump firewall-check",
        f"add rule {t} filter-output ct state new jump cluster-ips-check",
        f"add rule {t} firewall-check ip daddr . meta l4proto . th dport vmap @firewall-ips",
        f"add rule {t} mark-for-masquerade mark set mark or {MASQ_MARK}",
        f"add rule {t} masquerading mark and {MASQ_MARK} == 0 return",
        f"add rule {t} masquerading mark set mark xor {MASQ_MARK}",
        f"add rule {t} masquerading masquerade fully-random",
        f"add rule {t} nat-output jump services",
        f"add rule {t} nat-postrouting jump masquerading",
        f"add rule {t} nat-prerouting jump services",
        f"add rule {t} nodeport-endpoints-check ip daddr @nodeport-ips "
        "meta l4proto . th dport vmap @no-endpoint-nodeports",
        f"add rule {t} reject-chain reject",
        f"add rule {t} services ip daddr . meta l4proto . th dport vmap @service-ips",
        f"add rule {t} services ip daddr @nodeport-ips meta l4proto . th dport vmap "
        "@service-nodeports",
    ]
    lines += [f"add element {t} nodeport-ips {{ {ip} }}" for ip in node_ips]
    lines.append(
        f"add rule {t} service-endpoints-check "
        "ip daddr . meta l4proto . th dport vmap @no-endpoint-services"
    )
    return lines


def _nft_service_chain_rules(sp: ServicePort, cluster_cidr: str, flush: bool) -> list[str]:
    t, chain = TABLE, nft_service_chain(sp)
    lines = [f"add chain {t} {chain}"]
    if flush:
        lines.append(f"flush chain {t} {chain}")
    lines.append(
        f"add rule {t} {chain} ip daddr {sp.cluster_ip} ip saddr != {cluster_cidr}"
        " jump mark-for-masquerade"
    )
    targets = ", ".join(
        f"{i} : goto {nft_endpoint_chain(sp, ep)}" for i, ep in enumerate(sp.endpoints)
    )
    lines.append(f"add rule {t} {chain} numgen random mod {len(sp.endpoints)} vmap {{ {targets} }}")
    return lines


def _nft_endpoint_chain(sp: ServicePort, endpoint: tuple[str, int], flush: bool) -> list[str]:
    chain = nft_endpoint_chain(sp, endpoint)
    return [f"add chain {TABLE} {chain}"] + ([f"flush chain {TABLE} {chain}"] if flush else [])


def _nft_endpoint_rules(sp: ServicePort, endpoint: tuple[str, int]) -> list[str]:
    t, chain = TABLE, nft_endpoint_chain(sp, endpoint)
    ip, port = endpoint
    return [
        f"add rule {t} {chain} ip saddr {ip} jump mark-for-masquerade",
        f"add rule {t} {chain} meta l4proto {sp.proto} dnat to {ip}:{port}",
    ]


def nft_ruleset(
    services: Sequence[ServicePort],
    cluster_cidr: str,
    service_cidr: str,
    node_ips: Sequence[str],
) -> str:
    """A full sync into an empty network namespace as ``nft -f`` input: one transaction."""
    t = TABLE
    lines = _nft_base(service_cidr, node_ips)
    seen_ips: set[str] = set()
    for sp in services:
        lines.append("")
        lines.append(f"# {sp.namespace}/{sp.name}")
        # as upstream: endpoint chains exist before the service chain's vmap names them
        for ep in sp.endpoints:
            lines += _nft_endpoint_chain(sp, ep, flush=False)
        lines += _nft_service_chain_rules(sp, cluster_cidr, flush=False)
        for ep in sp.endpoints:
            lines += _nft_endpoint_rules(sp, ep)
        if sp.cluster_ip not in seen_ips:  # one element per ClusterIP, not per port
            seen_ips.add(sp.cluster_ip)
            lines.append(f"add element {t} cluster-ips {{ {sp.cluster_ip} }}")
        lines.append(
            f"add element {t} service-ips {{ {sp.cluster_ip} . {sp.proto} . {sp.port} : "
            f"goto {nft_service_chain(sp)} }}"
        )
    return "\n".join(lines) + "\n"


def nft_partial(old: ServicePort, new: ServicePort, cluster_cidr: str) -> str:
    """kube-proxy's partial-sync transaction when ``old``'s endpoints became ``new``'s: the
    service chain rewritten, new endpoint chains added, endpoint chains no longer used
    flushed (upstream deletes them in a later sync, once nothing can still jump to them)."""
    t = TABLE
    added = [ep for ep in new.endpoints if ep not in old.endpoints]
    lines = []
    for ep in added:
        lines += _nft_endpoint_chain(new, ep, flush=True)
    lines += _nft_service_chain_rules(new, cluster_cidr, flush=True)
    for ep in added:
        lines += _nft_endpoint_rules(new, ep)
    for ep in old.endpoints:
        if ep not in new.endpoints:
            lines.append(f"flush chain {t} {nft_endpoint_chain(old, ep)}")
    return "\n".join(lines) + "\n"
