"""`kpr run` as a process: restart without loss, adoption, bad input while running,
status and cleanup, and the set-up errors a user can hit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kpr
from kpr.agent import runstate
from kpr.datapath import abi, loader
from kpr.datapath.abi import PIN_PREFIX
from kpr.datapath.maps import BpfMaps
from lab.netns import Lab
from tests.support import kube
from tests.support.agent import (
    KPR,
    POD_PORTS,
    PORTS,
    VIP4,
    VIP6,
    AgentProcess,
    echo,
    status_json,
    tcp_results,
)
from tests.support.paths import REPO


@pytest.fixture
def agent(lab, tmp_path, pin_dir):
    source = tmp_path / "manifests"
    source.mkdir()
    process = AgentProcess(lab, source, pin_dir, tmp_path / "agent.log")
    yield process
    process.kill()
    subprocess.run([*KPR, "cleanup", "--bpffs", str(pin_dir)], capture_output=True)


def loop_client(lab: Lab, seconds: float) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "lab.probe",
        "loop-tcp",
        VIP4,
        "80",
        "--duration",
        str(seconds),
    ]
    return lab.popen_client(argv, stdout=subprocess.PIPE, text=True)


def snapshot_maps(pin_dir: Path):
    maps = BpfMaps(pin_dir)
    try:
        state = maps.read()
        return state.services, state.backends, state.revnat
    finally:
        maps.close()


def test_services_keep_working_while_the_agent_is_killed_and_restart_adopts_without_writes(
    lab, agent
):
    echo(lab, agent.log.parent / "manifests")
    agent.start()
    agent.wait_synced()
    before = snapshot_maps(agent.pin_dir)
    client = loop_client(lab, 4)
    time.sleep(0.5)
    agent.kill(signal.SIGKILL)
    time.sleep(1.5)  # down: the pinned maps and attached programs keep serving
    agent.start()
    agent.wait_synced()
    summary = json.loads(client.communicate(timeout=30)[0])
    assert summary["errors"] == []
    assert len(summary["counts"]) == 3
    assert snapshot_maps(agent.pin_dir) == before  # same ids: adopted, not rewritten
    assert "map operations" not in agent.log.read_text().split("programs pinned in")[-1]


def test_restart_applies_changes_made_while_the_agent_was_down(lab, agent):
    source = agent.log.parent / "manifests"
    echo(lab, source)
    agent.start()
    agent.wait_synced()
    agent.kill(signal.SIGTERM)
    echo(lab, source, pods=(2,))
    agent.start()
    agent.wait_synced()
    results = tcp_results(lab, 30)
    assert {r["pod"] for r in results} == {lab.pods[2].name}


def test_a_bad_edit_is_reported_and_what_was_programmed_keeps_working(lab, agent):
    source = agent.log.parent / "manifests"
    echo(lab, source)
    agent.start()
    first = agent.wait_synced()
    (source / "broken.yaml").write_text("kind: Service\nmetadata: {name: [oops\n")
    bad = kube.service("bad", ["10.96.0.99"], [("http", 65536, "TCP")])
    kube.write(source, "bad.yaml", bad)
    state = agent.wait_synced(after=first.last_sync)
    problems = "\n".join(state.problems)
    assert "broken.yaml" in problems
    assert "Service default/bad" in problems and "spec.ports[0].port" in problems
    results = tcp_results(lab, 20)
    assert all("pod" in r for r in results)
    assert "broken.yaml" in agent.log.read_text()


def test_status_reads_the_pinned_maps_with_the_agent_stopped(lab, agent):
    echo(lab, agent.log.parent / "manifests")
    agent.start()
    agent.wait_synced()
    agent.kill(signal.SIGKILL)
    status = status_json(agent.pin_dir)
    assert status["agent"]["running"] is False
    assert status["agent"]["version"] == kpr.__version__  # which kpr made these maps
    assert all(status["attached"].values())
    frontends = {s["frontend"]: s for s in status["services"]}
    assert frontends[f"{VIP4}:80/TCP"]["service"] == "default/echo:http"
    assert sorted(frontends[f"{VIP4}:80/TCP"]["backends"]) == [f"{p.ipv4}:8080" for p in lab.pods]
    assert f"[{VIP6}]:53/UDP" in frontends
    assert status["drift"] == []
    text = subprocess.run(
        [*KPR, "status", "--bpffs", str(agent.pin_dir)], capture_output=True, text=True
    ).stdout
    assert "default/echo:http" in text and "drift:     none" in text
    assert f"agent:     kpr {kpr.__version__}, pid " in text
    assert "NEARLY FULL" not in text  # one small Service: no map is near its capacity


def test_a_conflict_check_that_cannot_run_is_said_in_the_log_and_by_status(lab, agent, monkeypatch):
    """Without iptables-save and nft (the image had neither) kube-proxy's rules cannot be
    looked for: the agent says so, naming each tool, and `kpr status` shows it."""
    from tests.support.conflicts import IPTABLES_AND_NFT, path_without

    monkeypatch.setenv("PATH", path_without(agent.log.parent, *IPTABLES_AND_NFT))
    echo(lab, agent.log.parent / "manifests")
    agent.start()
    agent.wait_synced()
    log = agent.log.read_text()
    for tool in IPTABLES_AND_NFT:
        assert f"conflict check for kube-proxy's rules could not run: {tool}: not found" in log
    monkeypatch.undo()
    assert len(status_json(agent.pin_dir)["agent"]["conflicts_not_checked"]) == 5
    text = subprocess.run(
        [*KPR, "status", "--bpffs", str(agent.pin_dir)], capture_output=True, text=True
    ).stdout
    assert "conflict check NOT RUN" in text and "  nft: not found in PATH" in text, text


def test_status_reports_drift_made_behind_the_agents_back(lab, agent):
    echo(lab, agent.log.parent / "manifests")
    agent.start()
    agent.wait_synced()
    agent.kill(signal.SIGKILL)
    maps = BpfMaps(agent.pin_dir)
    state = maps.read()
    frontend = next(f for f in state.services if str(f) == f"{VIP4}:80/TCP")
    maps.delete_masters([frontend])
    maps.close()
    status = status_json(agent.pin_dir)
    assert any(f"{VIP4}:80/TCP" in d and "missing" in d for d in status["drift"])


def test_cleanup_detaches_and_removes_every_pin(lab, agent):
    echo(lab, agent.log.parent / "manifests")
    agent.start()
    agent.wait_synced()
    agent.kill(signal.SIGTERM)
    out = subprocess.run(
        [*KPR, "cleanup", "--bpffs", str(agent.pin_dir)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert f"detached {len(loader.HOOKS)} programs" in out.stdout
    assert not agent.pin_dir.exists()
    assert runstate.load(agent.pin_dir) is None
    results = tcp_results(lab, 1)
    assert "error" in results[0]  # the ClusterIP means nothing without kpr


def test_cleanup_refuses_while_the_agent_runs_and_force_detaches_anyway(lab, agent):
    """A live agent would attach and pin again at its next full sync: `kpr cleanup` says so
    and removes nothing; with --force it removes everything, warning that the agent stands
    down only until it restarts."""
    echo(lab, agent.log.parent / "manifests")
    agent.start()
    agent.wait_synced()
    cleanup = [*KPR, "cleanup", "--bpffs", str(agent.pin_dir)]
    out = subprocess.run(cleanup, capture_output=True, text=True)
    assert out.returncode != 0
    assert f"A kpr agent is running on {agent.pin_dir} (pid {agent.process.pid} " in out.stderr
    assert "--force" in out.stderr
    assert all(loader.attached_hooks(lab.cgroup, agent.pin_dir).values())  # nothing removed
    assert {r["pod"] for r in tcp_results(lab, 20)} == {p.name for p in lab.pods}
    forced = subprocess.run([*cleanup, "--force"], capture_output=True, text=True)
    assert forced.returncode == 0, forced.stderr
    assert "warning: a kpr agent is running" in forced.stderr
    assert not agent.pin_dir.exists()
    agent.kill(signal.SIGKILL)  # the kernel drops its lock with it: a plain cleanup runs
    out = subprocess.run(cleanup, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_cleanup_force_makes_the_running_agent_stand_down_and_leave_nothing_when_it_stops(
    lab, agent
):
    """docs/operations.md's rollback and removal: `kpr cleanup --force` in each pod, then the
    DaemonSet deleted. Until its pod stops, the agent's full syncs (here every second) attach
    and pin nothing again, however long the loop over the nodes takes; when it stops it
    writes no run state: nothing of kpr stays on the node."""
    echo(lab, agent.log.parent / "manifests")
    agent.args += ["--sync-period", "1"]
    agent.start()
    agent.wait_synced()
    forced = subprocess.run(
        [*KPR, "cleanup", "--bpffs", str(agent.pin_dir), "--force"], capture_output=True, text=True
    )
    assert forced.returncode == 0, forced.stderr
    assert "it stands down" in forced.stderr
    time.sleep(3.5)  # three full syncs' time: each would have attached and pinned again
    attached = subprocess.run(
        ["bpftool", "-j", "cgroup", "show", str(lab.cgroup)], capture_output=True, text=True
    )
    assert json.loads(attached.stdout.strip() or "[]") == [], attached.stdout
    assert not agent.pin_dir.exists()
    assert "error" in tcp_results(lab, 1)[0]  # not served: the hooks stay empty
    agent.process.send_signal(signal.SIGTERM)
    assert agent.process.wait(timeout=20) == 0
    log = agent.log.read_text()
    assert "kpr cleanup removed this agent's programs and pins" in log
    assert "pins removed behind kpr's back" not in log
    leftovers = [p.name for p in runstate.RUN_DIR.glob(runstate.path_for(agent.pin_dir).stem + "*")]
    assert leftovers == []


# --- set-up errors: one paragraph saying what to do ------------------------------------


def run_kpr(*args: str, env: dict | None = None, user: str | None = None):
    argv = [*KPR, *args]
    if user:
        argv = ["setpriv", f"--reuid={user}", "--regid=65534", "--clear-groups", *argv]
    return subprocess.run(
        argv, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=60
    )


def test_missing_kernel_headers_say_how_to_fix_it(tmp_path, pin_dir, cgroup):
    out = run_kpr(
        "run", "--devices", "none", "--source", str(tmp_path), "--cgroup", str(cgroup),
        "--bpffs", str(pin_dir), env={"BCC_KERNEL_SOURCE": str(tmp_path / "no-headers")},
    )  # fmt: skip
    assert out.returncode == 2
    assert "Kernel headers not found" in out.stderr and "host-setup.sh" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_directory_that_is_not_a_cgroup_is_refused(tmp_path, pin_dir):
    out = run_kpr(
        "run",
        "--devices",
        "none",
        "--source",
        str(tmp_path),
        "--cgroup",
        str(tmp_path),
        "--bpffs",
        str(pin_dir),
    )
    assert out.returncode == 2
    assert "is not a cgroup v2 directory" in out.stderr


def test_a_pin_directory_off_bpffs_is_refused(tmp_path, cgroup):
    out = run_kpr(
        "run",
        "--devices",
        "none",
        "--source",
        str(tmp_path),
        "--cgroup",
        str(cgroup),
        "--bpffs",
        str(tmp_path / "p"),
    )
    assert out.returncode == 2
    assert "not on a BPF filesystem" in out.stderr


def test_not_root_is_refused_with_a_clear_message(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user")
    out = run_kpr("run", "--devices", "none", "--source", str(tmp_path), user="nobody")
    assert out.returncode == 2
    assert "must run as root" in out.stderr


def test_a_missing_source_directory_is_named(tmp_path, pin_dir, cgroup):
    missing = tmp_path / "nope"
    out = run_kpr(
        "run",
        "--devices",
        "none",
        "--source",
        str(missing),
        "--cgroup",
        str(cgroup),
        "--bpffs",
        str(pin_dir),
    )
    assert out.returncode == 2
    assert str(missing) in out.stderr


def test_a_config_that_does_not_parse_is_refused_naming_the_field(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("kpr run checks for root first")
    config = tmp_path / "kube-proxy.yaml"
    config.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\n"
        "kind: KubeProxyConfiguration\n"
        "iptables:\n  syncPeriod: 3x\n"
    )
    out = run_kpr("run", "--devices", "none", "--source", str(tmp_path), "--config", str(config))
    assert out.returncode == 2
    assert "iptables.syncPeriod" in out.stderr and "3x" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_service_that_does_not_fit_is_left_out_whole_before_writing(lab, agent):
    source = agent.log.parent / "manifests"
    chosen = [str(p.ipv4) for p in lab.pods]
    wide = [f"10.250.0.{i}" for i in range(1, 18)]  # more than a slot block holds
    kube.write(
        source,
        "services.yaml",
        kube.service("echo", [VIP4], [("http", 80, "TCP")]),
        kube.endpoint_slice("echo", chosen, [("http", 8080, "TCP")]),
        kube.service("wide", ["10.96.0.50"], [("http", 80, "TCP")]),
        kube.endpoint_slice("wide", wide, [("http", 8080, "TCP")]),
    )
    # echo's 3 slots are in its slot block, wide's 17 would be kpr_slots entries
    agent.args += ["--map-sizes", "slots=12"]
    agent.start()
    agent.wait_synced()
    results = tcp_results(lab, 20)
    assert all("pod" in r for r in results)
    log = agent.log.read_text()
    assert "1 Services (1 frontends) left out, they do not fit the maps (default/wide)" in log
    assert "kpr_slots needs 17 entries, max_entries 12" in log
    assert "map write" not in log  # nothing was tried that does not fit
    # the start-up line: the knob's sizes, and the override
    assert "map sizes for 65536 Services x 10 endpoints (2 frontends each): " in log
    assert "; --map-sizes overrides slots=12 (derived 262144)" in log
    status = status_json(agent.pin_dir)
    maps = status["maps"]
    # wide left nothing behind: echo's master only (its slots: its block)
    assert maps[f"{PIN_PREFIX}services4"]["entries"] == 1
    assert maps[f"{PIN_PREFIX}slots"]["entries"] == 0
    assert status["agent"]["failed"] == []
    left_out = status["agent"]["left_out"]
    assert (left_out["services"], left_out["frontends"]) == (1, 1)
    assert left_out["examples"] == ["10.96.0.50:80/TCP"]
    assert status["drift"] == []


def test_map_sizes_that_do_not_parse_are_refused(tmp_path, pin_dir, cgroup):
    out = run_kpr(
        "run", "--devices", "none", "--source", str(tmp_path), "--cgroup", str(cgroup),
        "--bpffs", str(pin_dir), "--map-sizes", "servces=10",
    )  # fmt: skip
    assert out.returncode == 2 and "unknown map 'servces'" in out.stderr


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--devices", "no-such-dev0", "no device 'no-such-dev0'"),
        ("--external-ip-cidrs", "10.0.0.0/33", "--external-ip-cidrs"),
    ],
)
def test_bad_devices_and_cidrs_are_refused_naming_the_flag(
    tmp_path, pin_dir, cgroup, flag, value, said
):
    out = run_kpr(
        "run", "--source", str(tmp_path), "--cgroup", str(cgroup), "--bpffs", str(pin_dir),
        flag, value, *([] if flag == "--devices" else ["--devices", "none"]),
    )  # fmt: skip
    assert out.returncode == 2 and said in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


BIND = "import socket,sys; s=socket.socket(); s.bind(('0.0.0.0', int(sys.argv[1])))"


def bind_in_pod(lab: Lab, port: int) -> subprocess.CompletedProcess:
    """bind() to `port` in a pod's network namespace, from the lab's cgroup (kpr's hooks)."""
    argv = ["nsenter", f"--net=/run/netns/{lab.pods[0].netns}", sys.executable, "-c", BIND]
    options = lab._client_options({"capture_output": True, "text": True})
    return subprocess.run([*argv, str(port)], timeout=30, **options)


def test_node_ports_answer_on_localhost_and_local_binds_cannot_shadow_them(lab, agent):
    source = agent.log.parent / "manifests"
    svc = kube.service("np", [VIP4], [], type="NodePort")
    svc["spec"]["ports"] = [
        {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30080}
    ]
    kube.write(
        source, "np.yaml", svc, kube.endpoint_slice("np", [str(lab.pods[1].ipv4)], POD_PORTS)
    )
    # the agent in the node's network namespace, as the DaemonSet's (hostNetwork) runs
    agent.args = ["nsenter", f"--net=/run/netns/{lab.node_netns}", *agent.args]
    agent.start()
    agent.wait_synced()
    # localhostNodePorts (kube-proxy's default): processes on the node reach 127.0.0.1:nodePort
    argv = [sys.executable, "-m", "lab.probe", "tcp", "127.0.0.1", "30080", "--count", "5"]
    results = json.loads(lab.run_client(argv).stdout)["results"]
    assert {r.get("pod") for r in results} == {lab.pods[1].name}, results
    taken = lab.run_client([sys.executable, "-c", BIND, "30080"])
    assert taken.returncode != 0 and "Address already in use" in taken.stderr
    assert lab.run_client([sys.executable, "-c", BIND, "30081"]).returncode == 0
    # a pod (another network namespace, same cgroup hooks) may use the number: a pod's
    # port 30080 takes nothing from the node's NodePort
    in_pod = bind_in_pod(lab, 30080)
    assert in_pod.returncode == 0, in_pod.stderr
    # the Service gone, the port is free again
    (source / "np.yaml").unlink()
    agent.wait_synced(after=time.time())
    assert lab.run_client([sys.executable, "-c", BIND, "30080"]).returncode == 0


def test_upgrade_to_a_new_map_layout_has_no_moment_without_service(lab, agent):
    """A new kpr version with another ABI version (`v<N>_` pins) starts next to the old
    version's attached programs and maps: it fills its own maps, then swaps the programs,
    then unpins the old ones. Simulated by renaming the pins of this version to v0_: the
    attached programs use their maps by reference, as an older build's would (the real
    upgrade from the previous ABI: test_upgrade_from_abi_v1...)."""
    echo(lab, agent.log.parent / "manifests")
    agent.start()
    agent.wait_synced()
    agent.kill(signal.SIGKILL)
    for pin in agent.pin_dir.glob(f"{PIN_PREFIX}*"):
        pin.rename(pin.with_name("v0_" + pin.name.removeprefix(PIN_PREFIX)))
    client = loop_client(lab, 10)  # outlasts the start: compile, first sync, attach
    time.sleep(0.5)
    agent.start()  # fresh, empty maps: attaching them at once would refuse every connect
    agent.wait_synced()
    summary = json.loads(client.communicate(timeout=30)[0])
    assert summary["errors"] == [] and len(summary["counts"]) == 3, summary
    assert not list(agent.pin_dir.glob("v0_*"))  # the old version's pins are gone
    assert "unpinned" in agent.log.read_text() and "of another kpr version" in agent.log.read_text()
    assert {r["pod"] for r in tcp_results(lab, 30)} == {p.name for p in lab.pods}
    cgroup_programs = subprocess.run(
        ["bpftool", "cgroup", "show", str(lab.cgroup)], capture_output=True, text=True
    ).stdout
    assert cgroup_programs.count("kpr_connect4") == 1  # the old program was replaced


# Agents of ABI v1 (`v1_` pins: slots in the services maps, keyed by frontend and slot):
# its last commit, and the last whose service keys and affinity values had a 16-bit slot
# and padding (pinned maps the later v1 builds kept as they were).
LAST_V1 = "179f930de1fb79935c6e894061fa628809d149b3"
SIXTEEN_BIT_SLOTS = "dc47974078eb68f6314e676cf571bca02e04f357"
# ABI v2's last commit (`v2_` pins: backend and reverse maps were hash maps)
LAST_V2 = "b8616a17d7d5899ff2ac5779465ff5c5b60d1bcf"


def previous_tree(commit: str, into: Path) -> Path:
    """That commit's tree, to run an agent of it from (skips when not in this checkout)."""
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"commit {commit} is not in this checkout: {archive.stderr}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    if (into / "bpf").is_dir() and not (into / "kpr" / "bpf").exists():
        # (its bpf/ is the package kpr.bpf through the install's mapping, which names this
        # checkout's: a link makes `kpr.bpf` its own when it runs from its tree)
        (into / "kpr" / "bpf").symlink_to("../bpf")
    return into


# Connects, says so, and at a line on stdin prints the socket's getpeername.
HELD_CONNECTION = """
import json, socket, sys
s = socket.create_connection((sys.argv[1], 80), timeout=5)
print("connected", flush=True)
sys.stdin.readline()
print(json.dumps(list(s.getpeername())))
"""


@pytest.mark.parametrize(
    ("commit", "version"),
    [(LAST_V1, 1), (SIXTEEN_BIT_SLOTS, 1), (LAST_V2, 2)],
    ids=["v1", "v1-16-bit-slots", "v2"],
)
def test_upgrade_from_an_older_abi_serves_throughout_and_unpins_the_old_maps(
    lab, agent, tmp_path, commit, version
):
    """An older ABI's agent (that commit, run from its own tree) pins `v<version>_` maps
    and serves; the new one fills its own maps while the old programs keep serving from
    the old ones, swaps the programs with no moment without service, unpins every old
    pin, and then writes changes into its own maps."""
    assert version < abi.ABI_VERSION
    previous = previous_tree(commit, tmp_path / "previous")
    source = agent.log.parent / "manifests"
    echo(lab, source)
    new_args = agent.args
    # run from the old tree: `python -m` looks in the working directory first
    agent.args = ["sh", "-c", 'cd "$0" && exec "$@"', str(previous), *new_args]
    agent.start()
    agent.wait_synced()
    assert (agent.pin_dir / f"v{version}_services4").exists()
    assert not list(agent.pin_dir.glob(f"{PIN_PREFIX}*"))
    # a connection made through the old programs, held open across the upgrade
    held = lab.popen_client(
        [sys.executable, "-c", HELD_CONNECTION, VIP4],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert held.stdout is not None and held.stdout.readline().strip() == "connected"
    agent.kill(signal.SIGKILL)
    client = loop_client(lab, 10)  # outlasts the start: compile, first sync, swap
    time.sleep(0.5)
    agent.args = new_args
    agent.start()
    agent.wait_synced()
    summary = json.loads(client.communicate(timeout=30)[0])
    assert summary["errors"] == [] and len(summary["counts"]) == 3, summary
    # its per-connection state was carried over: it still shows the Service, not the pod
    shown = json.loads(held.communicate("\n", timeout=10)[0])
    assert shown == [VIP4, 80], shown
    assert "per-connection map of the previous version kept" in agent.log.read_text()
    assert not list(agent.pin_dir.glob(f"v{version}_*"))  # the old version's pins are gone
    assert "of another kpr version" in agent.log.read_text()
    cgroup_programs = subprocess.run(
        ["bpftool", "cgroup", "show", str(lab.cgroup)], capture_output=True, text=True
    ).stdout
    assert cgroup_programs.count("kpr_connect4") == 1  # the old program was replaced
    status = status_json(agent.pin_dir)
    # 2 VIPs x 2 ports, each with its slots in its slot block: none in kpr_slots
    assert status["maps"][f"{PIN_PREFIX}slots"]["entries"] == 0
    assert len(status["services"]) == 2 * 2
    echo(lab, source, pods=(2,))  # slot 1 rewritten, slots 2 and 3 deleted
    agent.wait_synced(after=time.time())
    assert {r["pod"] for r in tcp_results(lab, 20)} == {lab.pods[2].name}
    frontends = {s["frontend"]: s for s in status_json(agent.pin_dir)["services"]}
    assert frontends[f"{VIP4}:80/TCP"]["backends"] == [f"{lab.pods[2].ipv4}:8080"]


def test_changing_map_sizes_swaps_in_new_maps_without_a_moment_without_service(lab, agent):
    echo(lab, agent.log.parent / "manifests")
    agent.start()
    agent.wait_synced()
    agent.kill(signal.SIGKILL)
    agent.args += ["--map-sizes", "services=8192,backends=4096,slots=16384"]
    client = loop_client(lab, 10)  # outlasts the start: compile, first sync, swap
    time.sleep(0.5)
    agent.start()
    agent.wait_synced()
    summary = json.loads(client.communicate(timeout=30)[0])
    assert summary["errors"] == [] and len(summary["counts"]) == 3, summary
    maps = status_json(agent.pin_dir)["maps"]
    sizes = {name: maps[f"{PIN_PREFIX}{name}"]["max_entries"] for name in ("services4", "slots")}
    assert sizes == {"services4": 8192, "slots": 16384}
    assert maps[f"{PIN_PREFIX}backends4"]["max_entries"] == 4096
    # refilled: 2 ports, a master each (and the IPv6 VIP's as many), their slots in
    # their blocks
    assert maps[f"{PIN_PREFIX}services4"]["entries"] == 2
    assert maps[f"{PIN_PREFIX}slots"]["entries"] == 0
    assert not list(agent.pin_dir.glob("retired_*"))
    assert f"pinned map replaced: {PIN_PREFIX}services4" in agent.log.read_text()


# --- kpr status NAMESPACE/NAME: why an endpoint gets traffic or not ---------------------


def test_status_of_one_service_says_why_each_endpoint_gets_traffic_or_not(lab, agent):
    pods = [str(p.ipv4) for p in lab.pods[:3]]
    web = kube.service("echo", [VIP4], PORTS, internalTrafficPolicy="Local")
    web_slice = kube.endpoint_slice("echo", pods, POD_PORTS)
    web_slice["endpoints"][1]["conditions"]["ready"] = False
    web_slice["endpoints"][2]["nodeName"] = "node-2"
    web_slice["endpoints"][2]["zone"] = "zone-b"
    kube.write(agent.log.parent / "manifests", "echo.yaml", web, web_slice)
    agent.args += ["--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", ""]
    agent.start()
    agent.wait_synced()
    out = subprocess.run(
        [*KPR, "status", "default/echo", "--bpffs", str(agent.pin_dir), "--json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    http = next(p for p in report["ports"] if p["name"] == "http")
    [frontend] = http["frontends"]
    assert (frontend["frontend"], frontend["policy"]) == (f"{VIP4}:80/TCP", "Local")
    assert frontend["maps"] == [f"{pods[0]}:8080"]  # what the pinned maps hold
    why = {e["address"]: e["traffic"]["Local"] for e in http["endpoints"]}
    assert why[f"{pods[0]}:8080"] is None
    assert why[f"{pods[1]}:8080"] == "not ready"
    assert why[f"{pods[2]}:8080"].startswith("on node node-2, not this node (node-1)")
    remote = next(e for e in http["endpoints"] if e["address"] == f"{pods[2]}:8080")
    assert (remote["node"], remote["zone"], remote["ready"]) == ("node-2", "zone-b", True)
    text = subprocess.run(
        [*KPR, "status", "default/echo", "--bpffs", str(agent.pin_dir)],
        capture_output=True,
        text=True,
    )
    assert text.returncode == 0, text.stderr
    assert "no traffic, not ready" in text.stdout and "gets traffic" in text.stdout
    missing = subprocess.run(
        [*KPR, "status", "default/nope", "--bpffs", str(agent.pin_dir), "--json"],
        capture_output=True,
        text=True,
    )
    assert missing.returncode != 0
    assert "default/nope" in json.loads(missing.stdout)["error"]
