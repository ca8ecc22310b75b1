"""The kpr command line: run, status, cleanup, demo."""

from __future__ import annotations

import json
import logging
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Annotated

import typer

from kpr import host, runstate
from kpr.model import NodeContext

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="kpr: Kubernetes Services load-balanced at the socket by eBPF, in place of kube-proxy.",
)

BpffsOption = Annotated[
    Path, typer.Option("--bpffs", help="bpffs directory kpr pins its maps and programs in.")
]


def _fail(err: Exception) -> None:
    typer.echo(f"kpr: {err}", err=True)
    raise typer.Exit(2)


@app.command()
def run(
    source: Annotated[
        Path,
        typer.Option(
            "--source",
            help="Directory of Service and EndpointSlice manifests (YAML as kubectl writes it).",
        ),
    ],
    cgroup: Annotated[
        Path | None,
        typer.Option(help="cgroup v2 directory to attach to (default: the cgroup v2 root)."),
    ] = None,
    bpffs: BpffsOption = host.DEFAULT_PIN_DIR,
    node_name: Annotated[
        str | None, typer.Option(help="This node's name (default: the hostname).")
    ] = None,
    proxy_name: Annotated[
        str, typer.Option(help="Also serve Services labelled service-proxy-name=<this>.")
    ] = "kpr",
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Run the agent: keep the BPF maps equal to the Services in --source."""
    from kpr.agent import Agent, AgentConfig
    from kpr.sources.manifests import ManifestSource

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = AgentConfig(
        pin_dir=bpffs,
        cgroup=cgroup,
        node=NodeContext(name=node_name or socket.gethostname(), proxy_name=proxy_name),
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        host.require_root()
        agent = Agent(ManifestSource(source), config)
        agent.start()
    except (host.SetupError, FileNotFoundError, NotADirectoryError) as err:
        _fail(err)
    agent.run(stop)


@app.command()
def status(
    bpffs: BpffsOption = host.DEFAULT_PIN_DIR,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Show what the pinned maps hold (works while the agent is stopped)."""
    from kpr.status import render, report

    try:
        host.require_root()
        data = report(bpffs)
    except (host.SetupError, FileNotFoundError) as err:
        _fail(err)
    typer.echo(json.dumps(data, indent=2) if as_json else render(data))


@app.command()
def cleanup(
    bpffs: BpffsOption = host.DEFAULT_PIN_DIR,
    cgroup: Annotated[
        Path | None,
        typer.Option(help="cgroup to detach from (default: where the agent attached)."),
    ] = None,
) -> None:
    """Detach kpr's programs and remove its pins: nothing of kpr stays on the node."""
    from kpr.datapath import loader

    try:
        host.require_root()
    except host.SetupError as err:
        _fail(err)
    state = runstate.load(bpffs)
    targets = {p for p in (cgroup, Path(state.cgroup) if state else None) if p}
    if not targets:
        targets = {host.cgroup2_root()}
    for target in sorted(targets):
        count = loader.detach(target)
        typer.echo(f"detached {count} programs from {target}")
    loader.unpin_all(bpffs)
    runstate.remove(bpffs)
    typer.echo(f"removed {bpffs}")


@app.command()
def demo(
    pods: Annotated[int, typer.Option(help="Backend pods in the lab.")] = 3,
    connections: Annotated[int, typer.Option(help="Connections to make to the ClusterIP.")] = 300,
) -> None:
    """Bring up a throwaway netns lab, run kpr on the example manifests, connect, clean up."""
    from kpr.lab.demo import main

    try:
        sys.exit(main(pods=pods, connections=connections))
    except host.SetupError as err:
        _fail(err)


if __name__ == "__main__":
    app()
