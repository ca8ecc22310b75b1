"""`kpr status`: what the pinned maps hold, read without the agent.

`report()` gathers; `drift()` is pure; `render()` formats for a terminal.
"""

from __future__ import annotations

import time
from pathlib import Path

from kpr.agent import runstate
from kpr.datapath import abi, loader, tc
from kpr.datapath.maps import BpfMaps
from kpr.datapath.plan import ProgrammedState
from kpr.desired.drift import Entry
from kpr.desired.drift import drift as find_drift
from kpr.model import EndpointSlice, Service
from kpr.node import host


def programmed_view(programmed: ProgrammedState) -> dict[str, list[str]]:
    """str(frontend) -> backends as the maps hold them, in slot order."""
    return {
        str(frontend): [
            str(programmed.backends[b]) if b in programmed.backends else f"<missing #{b}>"
            for b in service.slots
        ]
        for frontend, service in programmed.services.items()
    }


def drift(desired: dict[str, dict], held: list[str], programmed: dict[str, list[str]]) -> list[str]:
    """Differences between what the agent last wanted and what the maps hold (the agent's
    own measure of drift, kpr/desired/drift.py, on the run state file's strings)."""
    wanted = {f: Entry(tuple(w["backends"]), service=w["service"]) for f, w in desired.items()}
    have = {f: Entry(tuple(backends)) for f, backends in programmed.items()}
    return [str(d) for d in find_drift(wanted, have, held)]


def report(pin_dir: Path) -> dict:
    if not pin_dir.is_dir():
        raise FileNotFoundError(
            f"No kpr maps are pinned at {pin_dir}: kpr has not run here (or `kpr cleanup` "
            f"removed them). Start it with `kpr run`, or pass the --bpffs it runs with."
        )
    try:
        maps = BpfMaps(pin_dir)
    except OSError as err:
        raise FileNotFoundError(
            f"A kpr pin under {pin_dir} is missing ({err}): removed behind kpr's back? A "
            f"running agent pins it again at its next full sync (syncPeriod); otherwise "
            f"`kpr run` makes it anew."
        ) from None
    try:
        programmed = maps.read()
        counters = maps.stats()
        fill = maps.fill()
    finally:
        maps.close()
    view = programmed_view(programmed)
    state = runstate.load(pin_dir)
    desired = runstate.load_desired(pin_dir) if state else {}
    ids = {str(f): s.service_id for f, s in programmed.services.items()}
    services = []
    for frontend in sorted(view):
        want = desired.get(frontend, {})
        entry = {
            "frontend": frontend,
            "kind": want.get("kind", "ClusterIP"),
            "service": want.get("service", "?"),
            "service_id": ids[frontend],
            "backends": view[frontend],
        }
        for extra in ("source_ranges", "drop"):
            if extra in want:
                entry[extra] = want[extra]
        services.append(entry)
    agent = None
    if state:
        agent = {
            "version": state.version or None,
            "pid": state.pid,
            "running": host.process_alive(state.pid),
            "source": state.source,
            "cgroup": state.cgroup,
            "last_sync": state.last_sync,
            "problems": state.problems,
            "watches": state.watches,
            "conflicts": state.conflicts,
            "conflicts_not_checked": state.conflicts_not_checked,
            "failed": state.failed,
            # desired but not programmed: they do not fit the maps (not drift)
            "left_out": {
                "services": state.left_out_services,
                "frontends": len(state.left_out),
                "why": state.left_out_why,
                "examples": state.left_out[:10],
            },
            "node_port_addresses": state.node_port_addresses,
            "kernel_headers": state.kernel_headers,
        }
    devices, reply_devices = {}, {}
    if state and (state.devices or state.reply_devices):
        on = tc.attached([*state.devices, *state.reply_devices], pin_dir)
        devices = {
            name: {"addresses": addresses, "attached": on[name]}
            for name, addresses in state.devices.items()
        }
        # where masqueraded flows may leave, for their replies: no frontend served there
        reply_devices = {
            name: {"addresses": addresses, "attached": on[name]}
            for name, addresses in state.reply_devices.items()
        }
    left_out = set(state.left_out) if state else set()
    return {
        "pin_dir": str(pin_dir),
        "agent": agent,
        "attached": loader.attached_hooks(Path(state.cgroup), pin_dir) if state else {},
        "devices": devices,
        "reply_devices": reply_devices,
        "services": services,
        "maps": {
            name: {"entries": used, "max_entries": size, "fill": round(used / size, 4)}
            for name, (used, size) in fill.items()
        },
        "counters": counters,
        "drift": drift({f: w for f, w in desired.items() if f not in left_out}, state.held, view)
        if state
        else [],
    }


def render(status: dict) -> str:
    lines = []
    agent = status["agent"]
    if agent:
        when = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(agent["last_sync"]))
            if agent["last_sync"]
            else "never"
        )
        running = "running" if agent["running"] else "not running"
        version = f"kpr {agent['version']}" if agent.get("version") else "kpr (version unknown)"
        lines.append(f"agent:     {version}, pid {agent['pid']} ({running}), last sync {when}")
        lines.append(f"source:    {agent['source']}")
        if agent.get("kernel_headers"):
            lines.append(f"headers:   {agent['kernel_headers']}")
        watches = agent.get("watches") or {}
        if watches:
            down = [name for name, w in watches.items() if not w.get("connected")]
            relists = sum(w.get("relists", 0) for w in watches.values())
            restarts = sum(w.get("restarts", 0) for w in watches.values())
            health = "healthy" if not down else f"NOT CONNECTED: {', '.join(sorted(down))}"
            lines.append(f"watch:     {health} ({restarts} restarts, {relists} relists)")
        attached = status["attached"]
        hooks = ", ".join(h for h, ok in attached.items() if ok) or "none"
        lines.append(f"cgroup:    {agent['cgroup']}")
        lines.append(f"attached:  {hooks}")
        missing = [h for h, ok in attached.items() if not ok]
        if missing:
            lines.append(f"DETACHED:  {', '.join(missing)}")
        for name, device in status["devices"].items():
            # TC filters are per network namespace: `kpr status` must run in the agent's
            on = "TC attached" if device["attached"] else "TC NOT ATTACHED (or another netns)"
            lines.append(f"device:    {name} ({', '.join(device['addresses'])}): {on}")
        for name, device in status.get("reply_devices", {}).items():
            on = "TC attached" if device["attached"] else "TC NOT ATTACHED (or another netns)"
            where = ", ".join(device["addresses"])
            lines.append(f"device:    {name} ({where}): {on}, masqueraded flows' replies only")
        if agent.get("node_port_addresses"):
            lines.append(f"nodeports: on {', '.join(agent['node_port_addresses'])}")
    else:
        lines.append("agent:     no record (maps only)")
    lines.append(f"pins:      {status['pin_dir']}")
    left_out = (agent or {}).get("left_out") or {}
    if left_out.get("frontends"):
        lines.append(
            f"LEFT OUT:  {left_out['services']} Services ({left_out['frontends']} frontends) "
            f"do not fit the maps: {left_out['why']}"
        )
    lines.append("")
    lines.append(f"services ({len(status['services'])} frontends):")
    for svc in status["services"]:
        empty = "no local endpoint: dropped" if svc.get("drop") else "no endpoints: refused"
        backends = ", ".join(svc["backends"]) or empty
        kind = svc["kind"]
        if svc.get("source_ranges"):
            kind += f" from {','.join(svc['source_ranges'])}"
        lines.append(f"  {svc['frontend']:<28} {kind:<13} {svc['service']:<24} -> {backends}")
    lines.append("")
    lines.append("maps:")
    for name, m in status["maps"].items():
        warning = "  NEARLY FULL" if m["fill"] >= abi.MAP_PRESSURE else ""
        lines.append(
            f"  {name:<18} {m['entries']:>8} / {m['max_entries']:<8} {m['fill']:.1%}{warning}"
        )
    lines.append("")
    lines.append("counters:  " + ", ".join(f"{k}={v}" for k, v in status["counters"].items()))
    lines.append("")
    if status["drift"]:
        lines.append(f"drift ({len(status['drift'])}):")
        lines.extend(f"  {d}" for d in status["drift"][:50])
    else:
        lines.append("drift:     none (maps match what the agent wants)")
    if agent and agent.get("conflicts"):
        lines.append(f"CONFLICTS ({len(agent['conflicts'])}):")
        lines.extend(f"  {c}" for c in agent["conflicts"])
    if agent and agent.get("conflicts_not_checked"):
        lines.append("conflict check NOT RUN: kube-proxy's rules could be there unseen:")
        lines.extend(f"  {c}" for c in agent["conflicts_not_checked"])
    if agent and agent["problems"]:
        lines.append(f"problems ({len(agent['problems'])}):")
        lines.extend(f"  {p}" for p in agent["problems"][:50])
    return "\n".join(lines)


def service_objects(
    source: str, namespace: str, name: str, kubeconfig: str | None, master: str | None
) -> tuple[Service | None, list[EndpointSlice], list[str]]:
    """One Service and its EndpointSlices as they are now in the agent's source (a manifest
    directory, or the API server), with the problems that keep objects out."""
    from kpr.sources.objects import ObjectError, parse_endpoint_slice, parse_service

    if source.startswith("manifests:"):
        from kpr.sources.manifests import ManifestSource

        snapshot = ManifestSource(Path(source.removeprefix("manifests:"))).poll()
        assert snapshot is not None  # the first poll always has one
        services = [s for s in snapshot.services if (s.namespace, s.name) == (namespace, name)]
        slices = [s for s in snapshot.slices if (s.namespace, s.service_name) == (namespace, name)]
        mine = {f"Service {namespace}/{name}"} | {
            f"EndpointSlice {namespace}/{s.name}" for s in slices
        }
        problems = [str(p) for p in snapshot.problems if p.ref and str(p.ref) in mine]
        return (services[0] if services else None), slices, problems
    import json

    from kpr.sources.connection import connect
    from kpr.sources.kubernetes import LIST_ENDPOINT_SLICES, LIST_SERVICES, lister
    from kpr.sources.objects import SERVICE_NAME_LABEL

    host_in_state = source.removeprefix("kubernetes:") if source.startswith("kubernetes:") else None
    api = connect(kubeconfig, master or (None if kubeconfig else host_in_state))
    # list with selectors: the verbs kpr's ClusterRole grants (no get)
    found = lister(api, LIST_SERVICES)(
        field_selector=f"metadata.namespace={namespace},metadata.name={name}",
        _request_timeout=30,
    )
    listed = lister(api, LIST_ENDPOINT_SLICES)(
        label_selector=f"{SERVICE_NAME_LABEL}={name}",
        field_selector=f"metadata.namespace={namespace}",
        _request_timeout=30,
    )
    problems = []
    service = None
    for obj in json.loads(found.data).get("items") or []:
        try:
            service = parse_service(obj)
        except ObjectError as err:
            problems.append(f"Service {namespace}/{name}: {err}; not used")
    slices = []
    for obj in json.loads(listed.data).get("items") or []:
        try:
            slices.append(parse_endpoint_slice(obj))
        except ObjectError as err:
            slice_name = (obj.get("metadata") or {}).get("name")
            problems.append(f"EndpointSlice {namespace}/{slice_name}: {err}; not used")
    return service, slices, problems


def service_report(
    pin_dir: Path, namespaced_name: str, kubeconfig: str | None = None, master: str | None = None
) -> dict:
    """`kpr status NAMESPACE/NAME`: the Service's frontends with what the maps hold, and
    each endpoint with why it does or does not get traffic on this node."""
    from kpr.agent.loop import node_context
    from kpr.desired.explain import explain

    namespace, sep, name = namespaced_name.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise ValueError(f"{namespaced_name!r} is not NAMESPACE/NAME")
    state = runstate.load(pin_dir)
    if state is None:
        raise FileNotFoundError(
            f"No record of a kpr agent for {pin_dir}: `kpr status NAMESPACE/NAME` needs the "
            f"agent's source and node, which it records when it runs (pass its --bpffs)."
        )
    service, slices, problems = service_objects(
        state.source, namespace, name, kubeconfig or state.kubeconfig, master
    )
    if service is None:
        raise LookupError(f"Service {namespace}/{name} is not in {state.source}")
    explained = explain(service, slices, node_context(state.node))
    programmed = programmed_view(read_programmed(pin_dir))
    for port in explained["ports"]:
        for frontend in port["frontends"]:
            frontend["maps"] = programmed.get(frontend["frontend"])
    explained["node"] = state.node
    explained["problems"] = problems + [
        p for p in state.problems if f"{namespace}/{name}" in p and p not in problems
    ]
    return explained


def read_programmed(pin_dir: Path) -> ProgrammedState:
    """What the pinned maps hold now."""
    maps = BpfMaps(pin_dir)
    try:
        return maps.read()
    finally:
        maps.close()


def render_service(report: dict) -> str:
    from kpr.desired.explain import render

    programmed = {
        f["frontend"]: f["maps"]
        for port in report["ports"]
        for f in port["frontends"]
        if f.get("maps") is not None
    }
    node = report.get("node") or {}
    lines = [render(report, programmed)]
    lines.append(f"  (as seen on node {node.get('name')}, zone {node.get('zone') or '-'})")
    if report["problems"]:
        lines.append(f"  problems ({len(report['problems'])}):")
        lines.extend(f"    {p}" for p in report["problems"])
    return "\n".join(lines)
