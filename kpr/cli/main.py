"""The kpr command line: run, status, cleanup, demo."""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

import kpr
from kpr import __version__
from kpr.agent import runstate
from kpr.node import host

if TYPE_CHECKING:
    pass

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="kpr: Kubernetes Services load-balanced at the socket by eBPF, in place of kube-proxy.",
)

BpffsOption = Annotated[
    Path, typer.Option("--bpffs", help="bpffs directory kpr pins its maps and programs in.")
]


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kpr {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """kpr: Kubernetes Services load-balanced at the socket by eBPF, in place of kube-proxy."""


def _fail(err: Exception) -> None:
    typer.echo(f"kpr: {err}", err=True)
    raise typer.Exit(2)


def source_checkout() -> Path | None:
    """The kpr source checkout this kpr runs from (an editable install of a clone: the lab and
    the bench beside the package), or None (an installed wheel, the image)."""
    root = Path(kpr.__file__).resolve().parents[1]
    found = all((root / package / "__init__.py").is_file() for package in ("lab", "bench"))
    return root if found else None


def _use_checkout(command: str) -> None:
    """Make the checkout's lab and bench importable, however kpr was started (`make demo`
    runs .venv/bin/kpr, whose sys.path has .venv/bin, not the repository); without one, say
    so in one sentence."""
    root = source_checkout()
    if root is None:
        typer.echo(
            f"kpr {command} needs a kpr source checkout: the lab and the bench live at the top"
            " of the repository (lab/, bench/), not in the installed package, so run it from a"
            " clone of the repository after `make setup`.",
            err=True,
        )
        raise typer.Exit(2)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


@app.command()
def run(
    source: Annotated[
        Path | None,
        typer.Option(
            "--source",
            help="Directory of Service and EndpointSlice manifests (YAML as kubectl writes it), "
            "instead of the Kubernetes API.",
        ),
    ] = None,
    config_file: Annotated[
        Path | None,
        typer.Option("--config", help="A KubeProxyConfiguration file (kube-proxy's ConfigMap)."),
    ] = None,
    kubeconfig: Annotated[str | None, typer.Option(help="kubeconfig of the API server.")] = None,
    master: Annotated[
        str | None,
        typer.Option(help="API server address; overrides the kubeconfig's and in-cluster's."),
    ] = None,
    cgroup: Annotated[
        Path | None,
        typer.Option(help="cgroup v2 directory to attach to (default: the cgroup v2 root)."),
    ] = None,
    bpffs: BpffsOption = host.DEFAULT_PIN_DIR,
    node_name: Annotated[
        str | None,
        typer.Option(help="This node's name (default: hostnameOverride, else the hostname)."),
    ] = None,
    proxy_name: Annotated[
        str, typer.Option(help="Also serve Services labelled service-proxy-name=<this>.")
    ] = "kpr",
    healthz_bind_address: Annotated[
        str | None, typer.Option(help='host:port of /healthz and /livez ("" disables).')
    ] = None,
    metrics_bind_address: Annotated[
        str | None, typer.Option(help='host:port of /metrics ("" disables).')
    ] = None,
    min_sync_period: Annotated[
        float | None, typer.Option(help="Seconds: at most one sync per this under churn.")
    ] = None,
    sync_period: Annotated[
        float | None, typer.Option(help="Seconds: a full sync (repairing drift) this often.")
    ] = None,
    netns_dir: Annotated[
        list[Path] | None,
        typer.Option(
            help="Where pods' network namespaces are bound (repeatable; default "
            "$KPR_NETNS_DIRS, else /run/netns and /var/run/netns): entered to end connected "
            "UDP sockets to removed backends when kpr cannot see the pods' processes."
        ),
    ] = None,
    max_services: Annotated[
        int,
        typer.Option(
            help="Capacity: the Services (of 10 endpoints and 2 frontends each, on average) "
            "the maps hold; every Service-dependent map size follows from it. A sync that "
            "would not fit leaves out whole new Services and says what to raise.",
        ),
    ] = 65536,  # abi.MAX_SERVICES (kpr.datapath is imported only when a command runs)
    map_sizes: Annotated[
        str | None,
        typer.Option(
            help="Map capacities in place of those --max-services derives, e.g. "
            "slots=2097152,backends=524288 (keys: services, backends, revnat, sock_revnat, "
            "sock_peers, affinity, ct, source_ranges, slots). "
            "Fixed once the maps are pinned."
        ),
    ] = None,
    devices: Annotated[
        str,
        typer.Option(
            help="Devices to serve NodePort, LoadBalancer and external IPs on (TC), "
            'comma-separated names or patterns (eth*); "auto": those the default routes '
            'leave through and those holding the Node\'s InternalIPs; "none": socket load '
            "balancing only. NodePorts answer on these devices' addresses. Followed at run "
            "time, as the devices and their addresses change."
        ),
    ] = "auto",
    external_ip_cidrs: Annotated[
        str | None,
        typer.Option(
            help="Serve only the externalIPs inside these CIDRs (comma-separated): any user "
            "who may create Services can otherwise claim any address (CVE-2020-8554)."
        ),
    ] = None,
    log_level: Annotated[
        LogLevel, typer.Option(case_sensitive=False, help="How much to log.")
    ] = LogLevel.info,
) -> None:
    """Run the agent: keep the BPF maps equal to the Services of the API server (or --source)."""
    from kpr.cli.serve import RunOptions, exec_agent

    exec_agent(
        RunOptions(
            bpffs=str(bpffs),
            source=None if source is None else str(source),
            config_file=None if config_file is None else str(config_file),
            kubeconfig=kubeconfig,
            master=master,
            cgroup=None if cgroup is None else str(cgroup),
            node_name=node_name,
            proxy_name=proxy_name,
            healthz_bind_address=healthz_bind_address,
            metrics_bind_address=metrics_bind_address,
            min_sync_period=min_sync_period,
            sync_period=sync_period,
            netns_dirs=tuple(str(d) for d in netns_dir or ()),
            max_services=max_services,
            map_sizes=map_sizes,
            devices=devices,
            external_ip_cidrs=external_ip_cidrs,
            log_level=log_level.value,
        )
    )


@app.command()
def status(
    service: Annotated[
        str | None,
        typer.Argument(
            metavar="[NAMESPACE/NAME]",
            help="One Service: its frontends, and each endpoint with why it gets traffic "
            "on this node or not (read from the agent's source now).",
        ),
    ] = None,
    bpffs: BpffsOption = host.DEFAULT_PIN_DIR,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    kubeconfig: Annotated[
        str | None, typer.Option(help="For NAMESPACE/NAME: default, the agent's.")
    ] = None,
    master: Annotated[
        str | None, typer.Option(help="For NAMESPACE/NAME: default, the agent's API server.")
    ] = None,
) -> None:
    """Show what the pinned maps hold (works while the agent is stopped)."""
    from kpr.cli.status import render, render_service, report, service_report

    try:
        host.require_root()
        if service is None:
            data = report(bpffs)
            text = render(data) if not as_json else ""
        else:
            data = service_report(bpffs, service, kubeconfig, master)
            text = render_service(data) if not as_json else ""
    except Exception as err:  # every failure: one line (or JSON), and a non-zero exit
        if as_json:
            typer.echo(json.dumps({"error": str(err), "kind": type(err).__name__}, indent=2))
            raise typer.Exit(2) from None
        _fail(err)
    typer.echo(json.dumps(data, indent=2) if as_json else text)


@app.command()
def cleanup(
    bpffs: BpffsOption = host.DEFAULT_PIN_DIR,
    cgroup: Annotated[
        Path | None,
        typer.Option(help="cgroup to detach from (default: where the agent attached)."),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Also while a `kpr run` of --bpffs is alive (it attaches and pins again at "
            "its next full sync unless it is stopped first).",
        ),
    ] = False,
) -> None:
    """Detach kpr's programs and remove its pins: nothing of kpr stays on the node."""
    from kpr.datapath import loader

    try:
        host.require_root()
    except host.SetupError as err:
        _fail(err)
    state = runstate.load(bpffs)
    running = runstate.agent_running(bpffs)
    if running:
        pid = f" (pid {state.pid} where it runs)" if state else ""
        if not force:
            _fail(
                host.SetupError(
                    f"A kpr agent is running on {bpffs}{pid}. It would attach its programs "
                    f"and pin its maps again at its next full sync (syncPeriod), so nothing "
                    f"is removed. Stop it first (on a cluster: delete the DaemonSet; the "
                    f"programs stay attached and Services keep working until this runs), or "
                    f"pass --force: the agent then stands down until it exits."
                )
            )
        # before removing anything: the agent reads it before every sync
        runstate.mark_removed(bpffs, state)
        typer.echo(
            f"warning: a kpr agent is running on {bpffs}{pid}: it stands down (attaches and "
            f"pins nothing more) until it exits; if it restarts, it attaches again",
            err=True,
        )
    with runstate.sync_lock(bpffs):  # a sync under way ends first
        targets = {p for p in (cgroup, Path(state.cgroup) if state else None) if p}
        if not targets:
            targets = {host.cgroup2_root()}
        for target in sorted(targets):
            count = loader.detach(target)
            typer.echo(f"detached {count} programs from {target}")
        on = [*state.devices, *state.reply_devices] if state else []
        if on:
            from kpr.datapath import tc

            count = tc.detach(on)
            typer.echo(f"detached {count} TC filters from {', '.join(on)}")
        loader.unpin_all(bpffs)
        runstate.remove(bpffs, marker=not running)  # (a running agent removes it at exit)
    typer.echo(f"removed {bpffs}")


@app.command()
def demo(
    pods: Annotated[int, typer.Option(help="Backend pods in the lab.")] = 3,
    connections: Annotated[int, typer.Option(help="Connections to make to the ClusterIP.")] = 300,
) -> None:
    """Bring up a throwaway netns lab, run kpr on the example manifests, connect, clean up."""
    _use_checkout("demo")
    from lab.demo import main

    try:
        sys.exit(main(pods=pods, connections=connections))
    except host.SetupError as err:
        _fail(err)


@app.command()
def bench(
    services: Annotated[
        str, typer.Option(help="Service counts to measure at, comma-separated.")
    ] = "100,1000,10000,30000",
    endpoints: Annotated[int, typer.Option(help="Endpoints per service.")] = 10,
    modes: Annotated[
        str,
        typer.Option(
            help="Comma-separated. Generated rules: direct,iptables,iptables-legacy,nftables,kpr;"
            " fed by a real API server: kube-proxy-iptables,kube-proxy-nftables,kpr-api."
        ),
    ] = "direct,iptables,iptables-legacy,nftables,kpr,kube-proxy-iptables,kube-proxy-nftables,"
    "kpr-api",
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write every figure here.")
    ] = None,
    plot: Annotated[
        Path | None, typer.Option(help="A PNG of latency and programming time.")
    ] = None,
    connections: Annotated[int, typer.Option(help="Connections per measurement.")] = 5000,
    rounds: Annotated[int, typer.Option(help="Rounds; modes are interleaved in each.")] = 3,
    stream_mb: Annotated[int, typer.Option(help="MiB sent over the long connection.")] = 1024,
    changes: Annotated[
        int, typer.Option(help="API-fed modes: endpoint changes timed one at a time.")
    ] = 50,
    churn_rate: Annotated[
        float, typer.Option(help="API-fed modes: endpoint changes a second during churn.")
    ] = 20.0,
    churn_seconds: Annotated[
        float, typer.Option(help="API-fed modes: how long churn lasts.")
    ] = 60.0,
    idle_seconds: Annotated[
        float, typer.Option(help="API-fed modes: how long idle CPU is measured.")
    ] = 300.0,
    time_limit: Annotated[
        float, typer.Option(help="API-fed modes: seconds a proxy gets to program every Service.")
    ] = 900.0,
) -> None:
    """Benchmark kpr against kube-proxy's iptables and nftables rulesets in a throwaway lab."""
    _use_checkout("bench")
    from bench import run as bench_run

    try:
        cfg = bench_run.config_from_options(
            services, endpoints, modes, json_path, plot, connections, rounds, stream_mb,
            changes=changes, churn_rate=churn_rate, churn_s=churn_seconds,
            idle_s=idle_seconds, time_limit_s=time_limit,
        )  # fmt: skip
        sys.exit(bench_run.main(cfg))
    except (bench_run.BenchError, host.SetupError) as err:
        _fail(err)
