"""`kpr status`: what the pinned maps hold, read without the agent.

`report()` gathers; `drift()` is pure; `render()` formats for a terminal.
"""

from __future__ import annotations

import time
from pathlib import Path

from kpr import host, runstate
from kpr.datapath import abi, loader, tc
from kpr.datapath.maps import BpfMaps
from kpr.datapath.plan import ProgrammedState


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
    """Differences between what the agent last wanted and what the maps hold."""
    out = []
    for frontend, want in sorted(desired.items()):
        have = programmed.get(frontend)
        if have is None:
            out.append(f"{frontend} ({want['service']}): missing from the maps")
        elif sorted(have) != sorted(want["backends"]):
            out.append(
                f"{frontend} ({want['service']}): maps hold {len(have)} backends "
                f"{sorted(set(have) - set(want['backends']))[:5]} extra, "
                f"{sorted(set(want['backends']) - set(have))[:5]} missing"
            )
    for frontend in sorted(programmed.keys() - desired.keys() - set(held)):
        out.append(f"{frontend}: in the maps but not wanted")
    return out


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
            "pid": state.pid,
            "running": host.process_alive(state.pid),
            "source": state.source,
            "cgroup": state.cgroup,
            "last_sync": state.last_sync,
            "problems": state.problems,
            "watches": state.watches,
            "conflicts": state.conflicts,
            "failed": state.failed,
            "node_port_addresses": state.node_port_addresses,
        }
    devices = {}
    if state and state.devices:
        on = tc.attached(list(state.devices), pin_dir)
        devices = {
            name: {"addresses": addresses, "attached": on[name]}
            for name, addresses in state.devices.items()
        }
    return {
        "pin_dir": str(pin_dir),
        "agent": agent,
        "attached": loader.attached_hooks(Path(state.cgroup), pin_dir) if state else {},
        "devices": devices,
        "services": services,
        "maps": {
            name: {"entries": used, "max_entries": size, "fill": round(used / size, 4)}
            for name, (used, size) in fill.items()
        },
        "counters": counters,
        "drift": drift(desired, state.held if state else [], view) if state else [],
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
        lines.append(f"agent:     pid {agent['pid']} ({running}), last sync {when}")
        lines.append(f"source:    {agent['source']}")
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
        if agent.get("node_port_addresses"):
            lines.append(f"nodeports: on {', '.join(agent['node_port_addresses'])}")
    else:
        lines.append("agent:     no record (maps only)")
    lines.append(f"pins:      {status['pin_dir']}")
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
    if agent and agent["problems"]:
        lines.append(f"problems ({len(agent['problems'])}):")
        lines.extend(f"  {p}" for p in agent["problems"][:50])
    return "\n".join(lines)
