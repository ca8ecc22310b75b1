"""The TC path's UDP flows (kpr_ct, kpr_nat) whose backend no longer serves their frontend.

A flow through a NodePort, LoadBalancer IP or external IP keeps the backend its first
packet got, in kpr_ct, for as long as its client keeps sending. TCP starts over with its
next connection (a SYN on a flow whose backend is gone is a new flow, nodeport.c's
`stale`), but a UDP client that keeps its source port never does: a DNS forwarder or a game
client would send to a deleted pod, or to the old targetPort, for as long as it talks.
kube-proxy deletes the conntrack entries of such UDP flows after each sync
(pkg/proxy/conntrack/cleanup.go); kpr deletes its own flow entries, and the next datagram
is a new flow given a live backend. Established TCP flows are left alone, as there.

Pure: entries as `PinnedMap.dump` reads them in, flows to delete out.
"""

from __future__ import annotations

import socket
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from ipaddress import ip_address

from kpr.datapath import abi
from kpr.model import EXTERNAL, Backend, Frontend, IPAddress

UDP = socket.IPPROTO_UDP


@dataclass(frozen=True)
class Flow:
    """One flow of kpr_ct: where its client sent it, where it goes, and its two keys."""

    frontend: Frontend  # the address and port the client sent to (EXTERNAL scope)
    backend: Backend
    key: bytes  # its kpr_ct entry's key: the client's packets as they arrive
    reply_key: bytes  # its kpr_nat entry's key: the backend's replies as they arrive


def udp_flows(
    keys: bytes, values: bytes, frontends: Collection[Frontend] | None = None
) -> Iterator[Flow]:
    """The UDP flows among packed kpr_ct entries (a `dump` chunk): those to `frontends`,
    or all. Entries of other frontends are passed over as bytes: a full map holds 65,536."""
    wanted = None
    if frontends is not None:
        wanted = {(f.address.packed.ljust(16, b"\0"), f.port) for f in frontends}
    addresses: dict[bytes, IPAddress] = {}  # each distinct address decoded once

    def address(packed: bytes, family: int) -> IPAddress:
        if packed not in addresses:
            addresses[packed] = ip_address(packed[:4] if family == 4 else packed)
        return addresses[packed]

    size = abi.FLOW_KEY.size
    entries = zip(abi.FLOW_KEY.iter_unpack(keys), abi.CT.iter_unpack(values), strict=True)
    for index, (key, value) in enumerate(entries):
        saddr, daddr, sport, dport, protocol, family = key
        if protocol != UDP or (wanted is not None and (daddr, dport) not in wanted):
            continue
        backend_address, nat_address, backend_port, nat_port, _, _, flags, _ = value
        # the replies to the packets as the program sends them on (nodeport.c `follow`):
        # what kpr_nat is keyed by (nodeport.c `reply_key`)
        masqueraded = flags & abi.CT_F_SNAT
        source = nat_address if masqueraded else saddr
        source_port = nat_port if masqueraded else sport
        reply = abi.FLOW_KEY.pack(backend_address, source, backend_port, source_port, UDP, family)
        yield Flow(
            Frontend(address(daddr, family), dport, "UDP", EXTERNAL),
            Backend(address(backend_address, family), backend_port),
            keys[index * size : (index + 1) * size],
            reply,
        )


def stale(flows: Iterable[Flow], serving: Mapping[Frontend, Collection[Backend]]) -> list[Flow]:
    """The flows whose backend is not among those `serving` their frontend: it left the
    Service, its port changed, or the frontend is gone."""
    none: frozenset[Backend] = frozenset()
    return [flow for flow in flows if flow.backend not in serving.get(flow.frontend, none)]
