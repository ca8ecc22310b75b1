"""UDP traffic to backends that stopped serving it, moved on after each sync.

UDP has no connection a proxy sees end: a client that keeps its socket, or its source port,
keeps the backend it was given. kube-proxy deletes the conntrack entries of UDP flows whose
endpoint left the Service or whose port mapping changed, for every kind of frontend
(pkg/proxy/conntrack/cleanup.go). kpr's state of the same kind, and what a sync does to it:

- connected sockets the socket hooks gave a backend at connect() (clients on the node,
  to a ClusterIP or any other frontend): destroyed once no UDP frontend has their backend
  any more (kpr/datapath/sockets.py, by the agent's worker: it enters every namespace);
- flows the TC program follows (kpr_ct and kpr_nat: clients elsewhere, to a NodePort,
  LoadBalancer IP or external IP): deleted when their backend no longer serves their
  frontend (kpr/datapath/flows.py), at once, so the next datagram gets a live backend.
  The first sync after a start checks every flow: changes made while no agent ran.

Established TCP connections are left alone, as kube-proxy leaves them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kpr.datapath import flows, sockets
from kpr.datapath.maps import BpfMaps
from kpr.datapath.plan import ProgrammedState
from kpr.model import EXTERNAL, Backend, Frontend

log = logging.getLogger("kpr")

Serving = dict[Frontend, frozenset[Backend]]
Submit = Callable[[str, Callable[[], None]], None]  # Worker.submit


def udp_serving(programmed: ProgrammedState, frontends: set[Frontend] | None) -> Serving:
    """The backends of UDP frontends (these, or all) as the maps hold them."""
    services, backends = programmed.services, programmed.backends
    chosen = services if frontends is None else (f for f in frontends if f in services)
    return {
        frontend: frozenset(backends[bid] for bid in services[frontend].slots if bid in backends)
        for frontend in chosen
        if frontend.protocol == "UDP"
    }


def _all_backends(serving: Mapping[Frontend, frozenset[Backend]]) -> set[Backend]:
    return set().union(*serving.values())


class StaleUdp:
    """Ends the UDP state a sync left pointing at backends that no longer serve."""

    def __init__(
        self,
        maps: BpfMaps,
        cgroup: Path | None,
        netns_dirs: Sequence[Path] = (),
        submit: Submit | None = None,
    ) -> None:
        self.maps = maps
        self.cgroup = cgroup
        self.netns_dirs = tuple(netns_dirs)
        self._flows_checked = False  # every flow, once after a start
        self._lock = threading.Lock()
        self._to_terminate: set[Backend] = set()
        # the agent's worker (kpr/agent/worker.py); without one, at once
        self._submit: Submit = submit or (lambda _name, job: job())

    def synced(
        self, before: Serving, programmed: ProgrammedState, touched: set[Frontend] | None
    ) -> None:
        """After a sync's writes: `before` is `udp_serving(programmed, touched)` as it was
        before them, `programmed` what the maps hold now."""
        after = udp_serving(programmed, touched)
        every: Serving | None = after if touched is None else None  # walked once, if needed
        if not self._flows_checked and every is None:
            every = udp_serving(programmed, None)
        self._forget_flows(before, after, every)
        gone = _all_backends(before) - _all_backends(after)
        if gone:  # (and used by no other UDP frontend either)
            if every is None:
                every = udp_serving(programmed, None)
            gone -= _all_backends(every)
        if gone and self.cgroup is not None:
            self._terminate(gone)

    def _forget_flows(self, before: Serving, after: Serving, every: Serving | None) -> None:
        if not self._flows_checked:
            assert every is not None  # (synced walked every UDP frontend for it)
            # (flows are to EXTERNAL-scope frontends: only those of `every` are looked up)
            stale = flows.stale(self.maps.udp_flows(), every)
            self._flows_checked = True
        else:
            shrunk = {
                frontend
                for frontend, backends in before.items()
                if frontend.scope == EXTERNAL and not backends <= after.get(frontend, frozenset())
            }
            if not shrunk:
                return
            stale = flows.stale(self.maps.udp_flows(shrunk), after)
        if stale:
            count = self.maps.forget_flows(stale)
            log.info(
                "forgot %d UDP flows to backends that no longer serve their frontend (%s): "
                "their next datagrams get a live backend",
                count,
                ", ".join(sorted({f"{f.frontend} -> {f.backend}" for f in stale})[:5]),
            )

    def _terminate(self, backends: set[Backend]) -> None:
        """Connected sockets to `backends` destroyed off the sync path, by the agent's
        worker; what arrives before the job runs is done by the same job."""
        with self._lock:
            self._to_terminate |= backends
        self._submit("udp-terminate", self._terminate_pending)

    def _terminate_pending(self) -> None:
        with self._lock:
            batch, self._to_terminate = self._to_terminate, set()
        if batch:
            sockets.terminate_udp(batch, self.cgroup, self.netns_dirs)
