"""`kpr bench`'s modes fed by a real API server (modes.api_feed): the real kube-proxy, and kpr
beside it.

- ``kube-proxy-iptables`` / ``kube-proxy-nftables``: the lab build's kube-proxy with kubeadm's
  default KubeProxyConfiguration (syncPeriod 30s, minSyncPeriod 1s) in the bench lab's node
  network namespace, reaching the API server through a forwarder on that namespace's loopback;
- ``kpr-api``: ``kpr run`` with its ServiceAccount's token (deploy/'s RBAC), attached to the
  lab's cgroup, fed by the same API server.

Endpoints nothing serves are local addresses of the node namespace (``local 10.128.0.0/9 dev
lo``): a connection the proxy sent there is refused at once, one it did not translate times
out, so "every Service answers" can be checked by connections.

Per mode: full programming (proxy start with every object in the API → the sampled Services
answer; then every Service checked once), as the proxy reports it
(kubeproxy_sync_proxy_rules_duration_seconds), the datapath as the generated modes measure it,
the programming latency of single endpoint changes, the same under churn with the proxy's CPU,
idle CPU, and resident memory. Each mode gets a fresh lab and runs once per size (each takes
minutes); a figure a mode cannot reach within the time limit is reported at the limit.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from bench.config import CHANGE_VIP, FAKE_NET, VIP_FIRST, VIP_NET, ModeFailed
from bench.lab import BenchLab, flat, run_checked
from bench.modes.api_feed import NODE, ApiFeed
from bench.modes.base import Mode
from bench.modes.change_client import ChangeClient
from bench.modes.kpr import kpr_missing, repo_env
from bench.modes.process import cpu_seconds, memory_mb, quantiles, sync_metric
from bench.services import ServiceSet

KUBE_PROXY_METRICS = "http://127.0.0.1:10249/metrics"  # kubeadm's metricsBindAddress
READY_SAMPLE = 24  # Services whose answer marks "programmed", spread over the list
CHANGE_TIMEOUT_S = 30.0


class TimedOut(ModeFailed):
    """A mode did not get as far as the bench's time limit: its figures at the limit."""

    def __init__(self, message: str, figures: dict) -> None:
        super().__init__(message)
        self.figures = figures


class ApiMode(Mode):
    """A proxy fed by the feed's API server; subclasses start and stop it."""

    def __init__(self, feed: ApiFeed) -> None:
        self.feed = feed
        self.process: subprocess.Popen | None = None

    def missing(self) -> str | None:
        return self.feed.missing()

    # what a subclass provides
    def start(self, bl: BenchLab) -> subprocess.Popen:
        raise NotImplementedError

    def metrics(self, bl: BenchLab) -> str:
        raise NotImplementedError

    def stop(self, bl: BenchLab) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def _metric(self, bl: BenchLab) -> dict:
        try:
            return sync_metric(self.metrics(bl))
        except OSError:
            return {"count": 0.0, "sum": 0.0}

    # the measurements
    def program(self, bl: BenchLab, services: ServiceSet) -> dict:
        figures = self.feed.hold(services, bl)
        figures.update(self.start_programmed(bl, services))
        if figures.get("program_timed_out"):
            raise TimedOut(figures["program_timed_out"], figures)
        sweep = bl.client(["sweep", "1000", str(VIP_NET[VIP_FIRST]), str(services.size), "80"])
        figures.update(every_service_answered=sweep["failed"] == 0, sweep=sweep)
        if sweep["failed"]:
            raise ModeFailed(f"{self.name}: programmed, but {sweep['failed']} Services did not "
                             f"answer (first: {sweep['first_failed']})")  # fmt: skip
        return figures

    def start_programmed(self, bl: BenchLab, services: ServiceSet) -> dict:
        """Start the proxy, with every object in the API; wait until the sampled Services
        answer (or the time limit). Its figures; ``program_timed_out`` says why it is not."""
        _add_sink_route(bl)
        limit = self.feed.cfg.time_limit_s
        started = time.time()
        self.process = self.start(bl)
        ready = bl.lab.popen_client(
            [str(bl.tool), "ready", str(int(limit * 1000)), *_ready_targets(services)],
            stdout=subprocess.PIPE,
            text=True,
        )
        first_sync = None
        while ready.poll() is None:
            if first_sync is None and self.process.poll() is None:
                seen = self._metric(bl)
                if seen["count"] >= 1:
                    first_sync = seen
            time.sleep(0.2)
        if self.process.poll() is not None:
            raise ModeFailed(f"{self.name} exited {self.process.returncode}: see its log")
        outcome = json.loads(ready.stdout.read())  # type: ignore[union-attr]
        if first_sync is None:
            first_sync = self._metric(bl)
        figures: dict = {
            "program_s": outcome["at"] - started,
            "proxy_first_sync_s": first_sync["sum"] / first_sync["count"]
            if first_sync["count"]
            else None,
            "proxy_syncs_until_programmed": first_sync["count"],
        }
        if not outcome["ready"]:
            figures["program_s"] = limit
            figures["program_timed_out"] = (
                f"{self.name}: {outcome['reached']} of {outcome['targets']} sampled Services "
                f"answered within the time limit ({limit:.0f} s)"
            )
        return figures

    def change(self, bl: BenchLab, services: ServiceSet, changed: dict) -> dict:
        cfg = self.feed.cfg
        assert self.process is not None
        client = ChangeClient(bl, CHANGE_TIMEOUT_S)
        try:
            before = self._metric(bl)
            quiet = self._changes(client, count=cfg.changes, gap_s=1.0)
            after = self._metric(bl)
            churned: list[int] = []
            stop = threading.Event()
            churn = threading.Thread(target=self._churn, args=(stop, churned), daemon=True)
            cpu = cpu_seconds(self.process.pid)
            wall = time.monotonic()
            churn.start()
            under = self._changes(client, until=wall + cfg.churn_s, gap_s=0.2)
            stop.set()
            churn.join()
            churn_cpu = (cpu_seconds(self.process.pid) - cpu) / (time.monotonic() - wall)
        finally:
            client.close()
        syncs = after["count"] - before["count"]
        return {
            "change_latency_s": quiet["latency"],
            "change_s": quiet["latency"].get("p50"),
            "change_p99_s": quiet["latency"].get("p99"),
            "change_failures": quiet["failures"],
            "proxy_change_sync_s": (after["sum"] - before["sum"]) / syncs if syncs else None,
            "churn_changes": len(churned),
            "churn_rate_per_s": len(churned) / cfg.churn_s,
            "churn_latency_s": under["latency"],
            "churn_p99_s": under["latency"].get("p99"),
            "churn_failures": under["failures"],
            "churn_cpu": churn_cpu,
        }

    def _changes(
        self, client: ChangeClient, gap_s: float, count: int = 0, until: float = 0.0
    ) -> dict:
        """Move the change Service's endpoint to the next pod and time until it answers;
        ``count`` times, or until ``until`` (monotonic)."""
        latencies: list[float] = []
        failures = 0
        pods = len(self.feed.pod_ips)
        k = 0
        while (count and k < count) or (until and time.monotonic() < until):
            k += 1
            time.sleep(gap_s)
            pod = k % pods
            sent = time.time()
            self.feed.move_change_endpoint(pod)
            seen = client.wait_for(pod)
            if seen["ok"]:
                latencies.append(seen["t"] - sent)
            else:  # not seen within the limit: counted at the limit, and said so
                latencies.append(CHANGE_TIMEOUT_S)
                failures += 1
        return {"latency": quantiles(latencies), "failures": failures}

    def _churn(self, stop: threading.Event, done: list[int]) -> None:
        rate = self.feed.cfg.churn_rate
        start = time.monotonic()
        n = 0
        while not stop.is_set():
            delay = start + n / rate - time.monotonic()
            if delay > 0:
                stop.wait(delay)
                continue
            self.feed.churn_step(n)
            done.append(n)
            n += 1

    def cleanup(self, bl: BenchLab) -> None:
        self.stop(bl)
        with contextlib.suppress(RuntimeError):
            run_checked(["ip", "-n", bl.lab.node_netns, "route", "del", "local", str(FAKE_NET),
                      "dev", "lo"])  # fmt: skip


def idle_side_by_side(
    modes: list[ApiMode], services: ServiceSet, idle_s: float, new_lab
) -> dict[str, dict]:
    """Each mode started again in a lab of its own, all at once (idle, they share little but
    the API server); once each has programmed every Service, their CPU over the same
    ``idle_s`` seconds, and their memory. By mode name."""
    labs: dict[str, BenchLab] = {}
    figures: dict[str, dict] = {}
    try:
        for mode in modes:
            labs[mode.name] = new_lab()
            started = mode.start_programmed(labs[mode.name], services)
            if started.get("program_timed_out"):
                figures[mode.name] = {"idle_not_measured": started["program_timed_out"]}
        time.sleep(2.0)
        measured = [m for m in modes if m.name not in figures]
        before = {m.name: cpu_seconds(m.process.pid) for m in measured}  # type: ignore[union-attr]
        wall = time.monotonic()
        time.sleep(idle_s)
        seconds = time.monotonic() - wall
        for mode in measured:
            assert mode.process is not None
            used = cpu_seconds(mode.process.pid) - before[mode.name]
            figures[mode.name] = {"idle_s": seconds, "idle_cpu": used / seconds,
                                  **memory_mb(mode.process.pid)}  # fmt: skip
    finally:
        for mode in modes:
            if mode.name in labs:
                try:
                    mode.cleanup(labs[mode.name])
                finally:
                    labs[mode.name].close()
    return figures


def _add_sink_route(bl: BenchLab) -> None:
    """Endpoints nothing serves refuse at once (local, no listener) instead of timing out."""
    run_checked(["ip", "-n", bl.lab.node_netns, "route", "replace", "local", str(FAKE_NET),
              "dev", "lo"])  # fmt: skip


def _ready_targets(services: ServiceSet) -> list[str]:
    """READY_SAMPLE Services spread over the list, the pod-backed ones among them, the last
    one last: when they answer, the proxy has programmed the lot (each of these proxies writes
    a full sync in one go); the sweep afterwards checks every one."""
    size = services.size
    picks = {round(k * (size - 1) / max(1, READY_SAMPLE - len(services.real) - 1))
             for k in range(READY_SAMPLE - len(services.real))}  # fmt: skip
    picks |= set(services.real)
    picks.discard(size - 1)
    targets = [(str(VIP_NET[VIP_FIRST + i]), 80) for i in sorted(picks)]
    targets.append((str(VIP_NET[VIP_FIRST + size - 1]), 80))
    targets.append((CHANGE_VIP, 81))
    return flat(targets)


class KubeProxy(ApiMode):
    """The real kube-proxy in the node netns, in ``proxy_mode``."""

    def __init__(self, feed: ApiFeed, proxy_mode: str) -> None:
        super().__init__(feed)
        self.name = f"kube-proxy-{proxy_mode}"
        self.proxy_mode = proxy_mode
        self.forwarder = None
        self.config: Path | None = None

    def missing(self) -> str | None:
        tool = "iptables-restore" if self.proxy_mode == "iptables" else "nft"
        if shutil.which(tool) is None:
            return f"{tool} not found"
        return super().missing()

    def _netns(self, bl: BenchLab) -> str:
        return f"/run/netns/{bl.lab.node_netns}"

    def start(self, bl: BenchLab) -> subprocess.Popen:
        from lab.kube.cluster import KUBE_PROXY_CONFIG
        from lab.kube.controlplane import launch_logged
        from lab.kube.forward import Forwarder

        plane = self.feed.plane
        assert plane is not None
        self.forwarder = Forwarder(self._netns(bl), self.feed.apiserver_port)
        directory = self.feed.directory / self.name
        directory.mkdir(exist_ok=True)
        kubeconfig = plane.write_kubeconfig(
            directory / "kubeconfig",
            plane.tokens["kube-proxy"],
            server=f"https://127.0.0.1:{self.forwarder.port}",
        )
        self.config = directory / "config.yaml"
        self.config.write_text(
            KUBE_PROXY_CONFIG.format(mode=self.proxy_mode, kubeconfig=kubeconfig, node=NODE)
        )
        argv = [str(self.feed.bin_dir / "kube-proxy"), f"--config={self.config}", "--v=1"]
        return launch_logged(
            ["nsenter", f"--net={self._netns(bl)}", *argv], directory / "kube-proxy.log"
        )

    def metrics(self, bl: BenchLab) -> str:
        from lab.kube.forward import in_netns

        def scrape() -> str:
            with urllib.request.urlopen(KUBE_PROXY_METRICS, timeout=5) as answer:
                return answer.read().decode()

        return in_netns(self._netns(bl), scrape)

    def stop(self, bl: BenchLab) -> None:
        super().stop(bl)
        if self.forwarder is not None:
            self.forwarder.close()
            self.forwarder = None
        if self.config is not None:  # kube-proxy's own clean-up of its rules
            subprocess.run(
                ["nsenter", f"--net={self._netns(bl)}", str(self.feed.bin_dir / "kube-proxy"),
                 "--cleanup", f"--config={self.config}"],
                capture_output=True, timeout=300, check=False,
            )  # fmt: skip
            self.config = None


class KprApi(ApiMode):
    """`kpr run` fed by the API server with deploy/'s ServiceAccount, on the lab's cgroup."""

    name = "kpr-api"
    pairs_with_direct = True

    def __init__(self, feed: ApiFeed) -> None:
        super().__init__(feed)
        self.pin_dir: Path | None = None
        self.metrics_port = 0

    def missing(self) -> str | None:
        return kpr_missing() or super().missing()

    def start(self, bl: BenchLab) -> subprocess.Popen:
        from lab.kube.controlplane import free_port, launch_logged

        self.pin_dir = Path("/sys/fs/bpf") / f"kpr-bench-api-{uuid.uuid4().hex[:8]}"
        self.metrics_port = free_port()
        return launch_logged(
            [sys.executable, "-m", "kpr.cli", "run", "--devices", "none",
             "--kubeconfig", str(self.feed.kpr_kubeconfig), "--node-name", NODE,
             "--cgroup", str(bl.lab.cgroup), "--bpffs", str(self.pin_dir),
             "--healthz-bind-address", f"127.0.0.1:{free_port()}",
             "--metrics-bind-address", f"127.0.0.1:{self.metrics_port}"],
            self.feed.directory / "kpr-api.log", env=repo_env(),
        )  # fmt: skip

    def metrics(self, bl: BenchLab) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.read().decode()

    def stop(self, bl: BenchLab) -> None:
        super().stop(bl)
        if self.pin_dir is not None:
            subprocess.run(
                [sys.executable, "-m", "kpr.cli", "cleanup", "--bpffs", str(self.pin_dir)],
                capture_output=True, env=repo_env(), timeout=120, check=False,
            )  # fmt: skip
            shutil.rmtree(self.pin_dir, ignore_errors=True)
            self.pin_dir = None


def make_mode(name: str, feed: ApiFeed) -> ApiMode:
    if name == "kpr-api":
        return KprApi(feed)
    return KubeProxy(feed, name.removeprefix("kube-proxy-"))
