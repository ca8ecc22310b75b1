"""The command line as an operator meets it, where `kpr run` and `kpr status` need root:
ports in use, errors as JSON, and `kpr run` from kube-proxy's own ConfigMap (the rest of
the CLI's checks are in tests/unit/cli/test_cli.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.cli import KPR, kpr, mount_kube_proxy_configmap, safe_run_args

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="kpr run and status need root")


# --- listening ports: checked first, the holder named ---------------------------------


HOLDER = textwrap.dedent(
    """
    import ctypes, socket, sys, time
    ctypes.CDLL(None).prctl(15, b"kube-proxy", 0, 0, 0)  # PR_SET_NAME: look like it
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    print(s.getsockname()[1], flush=True)
    time.sleep(60)
    """
)


@needs_root
@pytest.mark.parametrize("flag", ["--healthz-bind-address", "--metrics-bind-address"])
def test_a_port_in_use_is_named_with_its_process_before_anything_is_loaded(
    tmp_path: Path, flag: str
) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(holder.stdout.readline())
        began = time.monotonic()
        out = kpr(*safe_run_args(tmp_path), flag, f"127.0.0.1:{port}")
        elapsed = time.monotonic() - began
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert f"{flag} 127.0.0.1:{port}: port {port} is already in use" in out.stderr
    assert f"pid {holder.pid} (kube-proxy)" in out.stderr
    assert "stop it on this node first" in out.stderr
    # before the cgroup is even looked at, so before any compile or pin
    assert "cgroup" not in out.stderr
    assert not (tmp_path / "no-such-bpffs").exists()
    assert elapsed < 20


# --- kpr status: errors as JSON, and non-zero ------------------------------------------


@needs_root
@pytest.mark.parametrize("target", [[], ["default/web"], ["not-a-name"]])
def test_status_errors_are_json_with_json_and_exit_non_zero(tmp_path: Path, target) -> None:
    out = kpr("status", *target, "--bpffs", str(tmp_path / "none"), "--json")
    assert out.returncode == 2
    error = json.loads(out.stdout)
    assert error["error"] and "Traceback" not in out.stderr
    plain = kpr("status", *target, "--bpffs", str(tmp_path / "none"))
    assert plain.returncode == 2 and plain.stderr.startswith("kpr: ")


# --- kube-proxy's ConfigMap, as a pod mounts it ----------------------------------------


@needs_root
def test_run_with_a_configmap_whose_kubeconfig_is_missing_fails_in_one_paragraph(
    tmp_path: Path,
) -> None:
    config_dir = mount_kube_proxy_configmap(tmp_path, "https://192.0.2.1:6443")
    (config_dir / "kubeconfig.conf").unlink()
    out = kpr(
        "run", "--config", str(config_dir / "config.conf"), "--devices", "none",
        "--cgroup", str(tmp_path / "no-such-cgroup"), "--bpffs", str(tmp_path / "no-bpffs"),
    )  # fmt: skip
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert f"kpr: {config_dir / 'kubeconfig.conf'} (clientConnection.kubeconfig in " in out.stderr
    # the fields read and not acted on are named in the log before that
    assert "clusterCIDR 10.244.0.0/16 is not used" in out.stderr
    assert "conntrack is not applied: kube-proxy would set" in out.stderr


def test_run_with_kube_proxys_configmap_lists_from_the_server_it_names(
    lab, api, pin_dir, tmp_path: Path
) -> None:
    """The whole path: --config → clientConnection.kubeconfig → kubeconfig.conf's server
    and tokenFile → the first sync, with no --master."""
    from tests.support.scripted import KubeAgent

    config_dir = mount_kube_proxy_configmap(tmp_path, api.url)
    agent = KubeAgent(lab, api, pin_dir, tmp_path / "agent.log")
    at = agent.args.index("--master")
    agent.args[at : at + 2] = ["--config", str(config_dir / "config.conf")]
    agent.start()
    try:
        state = agent.wait_synced()
        assert state.source == f"kubernetes:{api.url}"
        assert state.kubeconfig == str(config_dir / "kubeconfig.conf")
        code, body = agent.get(agent.metrics, "/configz")
        shown = json.loads(body)["kubeproxy.config.k8s.io"]
        assert code == 200 and shown["clusterCIDR"] == "10.244.0.0/16"
        # the agent runs in the process `kpr run` started (the same pid), as kpr/cli/serve.py:
        # the command line's framework (typer, and pydantic with it) is not in its memory
        assert agent.process is not None
        pid = agent.process.pid
        assert b"kpr.cli.serve" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert "pydantic_core" not in Path(f"/proc/{pid}/maps").read_text()
    finally:
        agent.kill()
        subprocess.run([*KPR, "cleanup", "--bpffs", str(pin_dir)], capture_output=True)
    log = (tmp_path / "agent.log").read_text()
    assert "clusterCIDR 10.244.0.0/16 is not used" in log
