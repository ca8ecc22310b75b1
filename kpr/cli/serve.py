"""The agent's process: `kpr run` parses its flags, then replaces itself (execv, the same pid)
with `python -m kpr.cli.serve OPTIONS_JSON`, so the agent does not carry the command line's
framework (typer, click, rich, pydantic: 7 MB of every node's memory, bench.agent_parts) for
as long as it runs.
Nothing here imports them (pyproject's import contracts)."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import asdict, dataclass
from ipaddress import ip_network
from pathlib import Path
from typing import TYPE_CHECKING

from kpr.agent import runstate
from kpr.model import NodeContext
from kpr.node import host

if TYPE_CHECKING:
    from kpr.agent.loop import Source
    from kpr.serving import BackgroundServer

SWITCH_INTERVAL = 0.0005  # seconds (Python's default: 0.005)


@dataclass(frozen=True)
class RunOptions:
    """`kpr run`'s flags, as parsed (kpr/cli/main.py says what each means)."""

    bpffs: str
    source: str | None = None
    config_file: str | None = None
    kubeconfig: str | None = None
    master: str | None = None
    cgroup: str | None = None
    node_name: str | None = None
    proxy_name: str = "kpr"
    healthz_bind_address: str | None = None
    metrics_bind_address: str | None = None
    min_sync_period: float | None = None
    sync_period: float | None = None
    netns_dirs: tuple[str, ...] = ()
    max_services: int = 65536
    map_sizes: str | None = None
    devices: str = "auto"
    external_ip_cidrs: str | None = None
    log_level: str = "info"

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RunOptions:
        fields = json.loads(text)
        fields["netns_dirs"] = tuple(fields.get("netns_dirs") or ())
        return cls(**fields)


def exec_agent(options: RunOptions) -> None:
    """Replace this process with the agent's (never returns). -P: the modules come from
    where kpr is installed, never from the working directory."""
    os.execv(sys.executable, [sys.executable, "-P", "-m", "kpr.cli.serve", options.to_json()])


def _bind(server: BackgroundServer, flag: str, address: str) -> None:
    """Take a listening port before anything is compiled or pinned; a port in use is a
    set-up error naming the port and the process holding it (often kube-proxy)."""
    try:
        server.bind()
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise host.port_in_use(flag, address, server.requested_port) from None
        raise host.SetupError(f"{flag} {address}: cannot listen there: {err}") from None


def _cidrs(flag: str, text: str | None) -> tuple | None:
    if text is None:
        return None
    try:
        return tuple(ip_network(part.strip(), strict=False) for part in text.split(",") if part)
    except ValueError as err:
        raise ValueError(f"{flag}: {err}") from None


def serve(options: RunOptions) -> int:
    """Run the agent until SIGTERM or SIGINT; 2 (and the reason on stderr) when it cannot
    start."""
    from kpr.agent.loop import Agent, AgentConfig
    from kpr.agent.telemetry import Telemetry
    from kpr.cli.config import ConfigError, ProxyConfig, load_config, split_host_port
    from kpr.datapath import abi
    from kpr.health.proxier import HealthServer, ProxyHealth
    from kpr.health.services import HealthCheckServers
    from kpr.node.devices import choose_devices, node_port_addresses
    from kpr.observe.metrics import Metrics, MetricsServer

    logging.basicConfig(
        level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("kpr")
    bpffs = Path(options.bpffs)
    servers: list[BackgroundServer] = []  # bound before the agent starts; closed again if it cannot
    try:
        host.require_root()
        # held until this process exits: `kpr cleanup` refuses while it is (kept in a local
        # that lives as long as the agent runs below)
        agent_lock = runstate.hold_agent_lock(bpffs)
        proxy = ProxyConfig()
        if options.config_file is not None:
            try:
                text = Path(options.config_file).read_text()
            except OSError as err:
                reason = err.strerror or err
                raise ConfigError(f"--config {options.config_file}: {reason}") from None
            proxy, notes = load_config(text, options.config_file)
            for note in notes:
                log.info("config: %s", note)
            for line in proxy.unused(os.cpu_count() or 1):
                log.info("config: %s: %s", options.config_file, line)
        flags = ("healthz_bind_address", "metrics_bind_address", "min_sync_period", "sync_period")
        for name in flags:
            if getattr(options, name) is not None:
                setattr(proxy, name, getattr(options, name))
        node = options.node_name or proxy.hostname_override or socket.gethostname()
        metrics = Metrics()
        feed: Source
        if options.source is not None:
            from kpr.sources.manifests import ManifestSource

            feed = ManifestSource(Path(options.source))
        else:
            from kpr.sources.connection import connect
            from kpr.sources.kubernetes import KubernetesSource

            def report(what: str, resource: str) -> None:
                counter = (
                    metrics.relists_total if what == "relist" else metrics.watch_restarts_total
                )
                counter.labels(resource=resource).inc()

            origin = (
                "--kubeconfig"
                if options.kubeconfig
                else f"clientConnection.kubeconfig in {options.config_file}"
            )
            feed = KubernetesSource(
                connect(options.kubeconfig or proxy.kubeconfig, options.master, origin),
                node,
                options.proxy_name,
                on_invalid=lambda kind: metrics.invalid_objects_total.labels(kind=kind).inc(),
                report=report,
            )
        chosen = choose_devices(options.devices)
        sizes = abi.MapSizes.for_services(options.max_services, options.map_sizes)
        log.info("%s", sizes.describe(options.max_services))
        config = AgentConfig(
            pin_dir=bpffs,
            cgroup=Path(options.cgroup) if options.cgroup else None,
            sizes=sizes,
            max_services=options.max_services,
            node=NodeContext(
                name=node,
                proxy_name=options.proxy_name,
                node_port_addresses=node_port_addresses(
                    list(chosen.serve), proxy.node_port_addresses
                ),
                localhost_node_ports=proxy.localhost_node_ports,
                external_ip_cidrs=_cidrs("--external-ip-cidrs", options.external_ip_cidrs),
            ),
            devices=chosen.serve,
            reply_devices=chosen.replies,
            device_spec=options.devices,
            node_port_cidrs=list(proxy.node_port_addresses),
            min_sync_period=proxy.min_sync_period,
            sync_period=proxy.sync_period,
            kubeconfig=options.kubeconfig or proxy.kubeconfig,
            **(
                {"netns_dirs": tuple(Path(d) for d in options.netns_dirs)}
                if options.netns_dirs
                else {}
            ),
        )
        health = ProxyHealth(proxy.sync_period)
        server: BackgroundServer
        if proxy.healthz_bind_address:
            server = HealthServer(health, metrics, *split_host_port(proxy.healthz_bind_address))
            _bind(server, "--healthz-bind-address", proxy.healthz_bind_address)
            servers.append(server)
        if proxy.metrics_bind_address:
            server = MetricsServer(
                metrics, *split_host_port(proxy.metrics_bind_address), configz=proxy.configz()
            )
            _bind(server, "--metrics-bind-address", proxy.metrics_bind_address)
            servers.append(server)
        addresses = (
            [str(a) for a in config.node.node_port_addresses] if proxy.node_port_addresses else None
        )
        agent = Agent(feed, config, health_checks=HealthCheckServers(addresses, health.healthy))
        agent.start()
        assert agent.maps is not None  # (started)
        agent.observers.append(
            Telemetry(health, metrics, agent.kernel_headers, datapath_reader=agent.maps.stats)
        )
        for server in servers:
            server.start()
    except (host.SetupError, ConfigError, ValueError, OSError) as err:
        for server in servers:
            server.stop()
        print(f"kpr: {err}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    # the stop wakes the idle run loop from its wait for the source (from a thread: a
    # signal handler that took the source's lock could find its own thread holding it)
    def wake_on_stop() -> None:
        stop.wait()
        agent.source.wake()

    threading.Thread(target=wake_on_stop, name="kpr-stop", daemon=True).start()
    # a thread that gives up the GIL for a syscall (each map write does) waits for it up to
    # the switch interval while another thread computes (the run-state file's serializer):
    # 5 ms by default, 10 map writes of a change made 100 ms of it at 100,000 Services
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        agent.run(stop)
    finally:
        os.close(agent_lock)
        for server in servers:
            server.stop()
        if agent.health_checks is not None:
            agent.health_checks.close()
    return 0


if __name__ == "__main__":
    sys.exit(serve(RunOptions.from_json(sys.argv[1])))
