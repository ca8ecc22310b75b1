"""The desired state, kept per Service, and the one rule for a contested frontend.

Each Service is translated on its own (`translate_service`); the store merges the
translations. When two Services claim one frontend (the same externalIP and port,
say), the first by namespace then name keeps it and the other gets a problem naming
the one that keeps it (`keeps`). The rule depends on the objects alone, never on
the order they arrived in, so a full translation and any sequence of partial updates
agree on the winner: after a restart, on every node, and when the winner goes (the
next in order takes the frontend over).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from kpr.desired.translate import orphan_slices, port_field, translate_service
from kpr.model import (
    EndpointSlice,
    Frontend,
    FrontendState,
    NodeContext,
    ObjectRef,
    Problem,
    Service,
    ServiceName,
    Translation,
)


def keeps(claimants: Iterable[ServiceName]) -> ServiceName:
    """Which of the Services claiming one frontend keeps it: the first by namespace, then
    name. Not the oldest (the model has no creationTimestamp, manifests rarely carry one),
    nor the one holding it (which a restart forgets): a function of the names alone gives
    every node, and every agent after a restart, the same answer."""
    return min(claimants)


# A Service's claims: each frontend it claims with its state there (None: held), in a
# tuple (104 bytes for one frontend where a dict took 224: one per Service)
Claims = tuple[tuple[Frontend, FrontendState | None], ...]


def translate(
    services: Iterable[Service], slices: Iterable[EndpointSlice], node: NodeContext
) -> Translation:
    """The whole desired datapath state for this node."""
    state = DesiredState()
    state.update(services, slices, node)
    return state.translation


class DesiredState:
    """Every Service's translation, merged into `translation` (what the datapath is
    planned from); `update` folds in the Services that changed."""

    def __init__(self) -> None:
        self.translation = Translation()
        # each Service's own frontends: its state for each (None: held)
        self._claims: dict[ServiceName, Claims] = {}
        self._problems: dict[ServiceName, list[Problem]] = {}  # only Services with some
        self._rivals: dict[Frontend, set[ServiceName]] = {}  # contested frontends' claimants
        self._services: dict[ServiceName, Service] = {}  # to name a loser's port
        self._node = NodeContext()

    def update(
        self,
        services: Iterable[Service],
        slices: Iterable[EndpointSlice],
        node: NodeContext,
        changed: Collection[ServiceName] | None = None,
    ) -> set[Frontend] | None:
        """Fold in the objects of the `changed` Services (`services` and `slices` hold all
        of theirs that exist), or with None the whole state. The frontends whose desired
        state may have changed (None: all of them)."""
        by_key = {(s.namespace, s.name): s for s in services}
        slices_of: dict[ServiceName, list[EndpointSlice]] = {}
        for endpoint_slice in slices:
            if endpoint_slice.service_name is not None:
                key = (endpoint_slice.namespace, endpoint_slice.service_name)
                slices_of.setdefault(key, []).append(endpoint_slice)
        if changed is None:  # the whole state: start again
            self.translation = Translation()
            self._claims, self._problems, self._rivals, self._services = {}, {}, {}, {}
            keys: Collection[ServiceName] = by_key.keys() | slices_of.keys()
        else:
            keys = changed
        self._node = node
        touched: set[Frontend] = set()
        if changed is not None:
            for key in keys:
                touched.update(self._withdraw(key))
        for key in keys:
            service = by_key.get(key)
            if service is None:  # gone; slices left name it: a problem of that name
                orphans = orphan_slices(slices_of.get(key, ()))
                if orphans:
                    self._problems[key] = orphans
                continue
            self._services[key] = service
            translation = translate_service(service, slices_of.get(key, ()), node)
            if translation.problems:
                self._problems[key] = translation.problems
            touched.update(self._claim(key, translation))
        for frontend in touched:
            self._resolve(frontend)
        self._collect_problems()
        return None if changed is None else touched

    def _withdraw(self, key: ServiceName) -> Iterable[Frontend]:
        """Take back everything one Service contributed; the frontends it claimed."""
        desired = self.translation
        desired.health_checks.pop(key, None)
        desired.no_local_endpoints.pop(key, None)
        desired.local_endpoints.pop(key, None)
        self._problems.pop(key, None)
        self._services.pop(key, None)
        frontends = [frontend for frontend, _ in self._claims.pop(key, ())]
        owners = desired.owners
        for frontend in frontends:
            rivals = self._rivals.get(frontend)
            if rivals is None:
                del owners[frontend]
                continue
            rivals.discard(key)
            owners[frontend] = keeps(rivals)  # (an owner is always a claimant)
            if len(rivals) == 1:
                del self._rivals[frontend]
        return frontends

    def _claim(self, key: ServiceName, translation: Translation) -> Iterable[Frontend]:
        """Record one Service's translation; the frontends it claims."""
        desired = self.translation
        claims: dict[Frontend, FrontendState | None] = dict(translation.frontends)
        claims.update(dict.fromkeys(translation.held))
        if claims:
            self._claims[key] = tuple(claims.items())
        owners = desired.owners
        for frontend in claims:
            rivals = self._rivals.get(frontend)
            if rivals is not None:
                rivals.add(key)
                continue
            owner = owners.setdefault(frontend, key)
            if owner != key:
                self._rivals[frontend] = {owner, key}
        if key in translation.health_checks:
            desired.health_checks[key] = translation.health_checks[key]
        if key in translation.no_local_endpoints:
            desired.no_local_endpoints[key] = translation.no_local_endpoints[key]
        if key in translation.local_endpoints:
            desired.local_endpoints[key] = translation.local_endpoints[key]
        return claims

    def _resolve(self, frontend: Frontend) -> None:
        """Give a frontend whose claims changed to the Service that keeps it (its state
        from that Service's translation), or remove it when no Service claims it."""
        desired = self.translation
        rivals = self._rivals.get(frontend)
        owner = keeps(rivals) if rivals is not None else desired.owners.get(frontend)
        if owner is None:
            desired.frontends.pop(frontend, None)
            desired.held.discard(frontend)
            return
        desired.owners[frontend] = owner
        state = dict(self._claims[owner])[frontend]
        if state is None:
            desired.frontends.pop(frontend, None)
            desired.held.add(frontend)
        else:
            desired.frontends[frontend] = state
            desired.held.discard(frontend)

    def _collect_problems(self) -> None:
        """Each Service's problems, and one for each Service that lost a frontend (with
        its ref, so that its next change replaces it)."""
        problems = [p for key in sorted(self._problems) for p in self._problems[key]]
        for frontend, rivals in sorted(self._rivals.items()):
            owner = keeps(rivals)
            for loser in sorted(rivals - {owner}):
                problems.append(
                    Problem(
                        f"{frontend} is also claimed by Service {owner[0]}/{owner[1]}, "
                        "which keeps it",
                        ObjectRef("Service", *loser),
                        port_field(self._services[loser], frontend, self._node),
                    )
                )
        self.translation.problems = problems
