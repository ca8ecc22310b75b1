"""The command line as an operator meets it: --version, bad flags, ports in use, errors as
JSON, and kube-proxy's own ConfigMap (config.conf and kubeconfig.conf) as a pod mounts it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kpr import __version__
from kpr.sources.kubernetes import KubeconfigError, KubernetesSource, api_client

KPR = [sys.executable, "-m", "kpr.cli"]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="kpr run and status need root")


def kpr(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*KPR, *args], capture_output=True, text=True, timeout=timeout)


def safe_run_args(tmp_path: Path) -> list[str]:
    """`kpr run` arguments that can never touch the machine: a manifest directory, no
    devices, a pin directory and a cgroup that do not exist (so set-up stops there)."""
    (tmp_path / "manifests").mkdir(exist_ok=True)
    return [
        "run",
        "--source", str(tmp_path / "manifests"),
        "--devices", "none",
        "--cgroup", str(tmp_path / "no-such-cgroup"),
        "--bpffs", str(tmp_path / "no-such-bpffs"),
    ]  # fmt: skip


def test_version() -> None:
    out = kpr("--version")
    assert (out.returncode, out.stdout.strip()) == (0, f"kpr {__version__}")


def test_a_bad_log_level_lists_the_choices(tmp_path: Path) -> None:
    out = kpr(*safe_run_args(tmp_path), "--log-level", "verbose")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    for choice in ("debug", "info", "warning", "error"):
        assert choice in out.stderr


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


def mount_kube_proxy_configmap(root: Path, server: str, token: str = "token-1") -> Path:
    """What kubeadm's kube-proxy ConfigMap and the ServiceAccount volume put in a pod:
    /var/lib/kube-proxy/{config.conf,kubeconfig.conf} and the token and CA they name."""
    secrets = root / "var/run/secrets/kubernetes.io/serviceaccount"
    secrets.mkdir(parents=True)
    (secrets / "token").write_text(token)
    (secrets / "ca.crt").write_text("")  # not read over plain HTTP
    config_dir = root / "var/lib/kube-proxy"
    config_dir.mkdir(parents=True)
    (config_dir / "kubeconfig.conf").write_text(
        textwrap.dedent(
            f"""\
            apiVersion: v1
            kind: Config
            clusters:
            - cluster:
                certificate-authority: {secrets}/ca.crt
                server: {server}
              name: default
            contexts:
            - context:
                cluster: default
                namespace: default
                user: default
              name: default
            current-context: default
            users:
            - name: default
              user:
                tokenFile: {secrets}/token
            """
        )
    )
    (config_dir / "config.conf").write_text(
        textwrap.dedent(
            f"""\
            apiVersion: kubeproxy.config.k8s.io/v1alpha1
            kind: KubeProxyConfiguration
            clientConnection:
              kubeconfig: {config_dir}/kubeconfig.conf
            clusterCIDR: 10.244.0.0/16
            mode: ""
            """
        )
    )
    return config_dir


def test_kube_proxys_kubeconfig_conf_reaches_the_api_server(tmp_path: Path, api) -> None:
    config_dir = mount_kube_proxy_configmap(tmp_path, api.url)
    client = api_client(str(config_dir / "kubeconfig.conf"), None)
    assert client.configuration.host == api.url
    assert client.configuration.api_key["BearerToken"] == "Bearer token-1"
    source = KubernetesSource(client, "node-1")
    source.start()
    try:
        deadline = time.monotonic() + 20
        while not source.synced:
            assert time.monotonic() < deadline, api.requests
            time.sleep(0.05)
    finally:
        source.stop()


def test_a_rotated_token_file_is_read_again(tmp_path: Path, api, monkeypatch) -> None:
    from kpr.sources import kubernetes

    config_dir = mount_kube_proxy_configmap(tmp_path, api.url)
    monkeypatch.setattr(kubernetes, "TOKEN_REREAD", 0.0)
    client = api_client(str(config_dir / "kubeconfig.conf"), None)
    token = tmp_path / "var/run/secrets/kubernetes.io/serviceaccount/token"
    token.write_text("token-2\n")  # the kubelet rotates bound tokens in place
    client.configuration.refresh_api_key_hook(client.configuration)
    assert client.configuration.api_key["BearerToken"] == "Bearer token-2"


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda d, s: (d / "kubeconfig.conf").unlink(), "kubeconfig.conf"),
        (lambda d, s: (d / "kubeconfig.conf").write_text("clusters: [\n"), "not valid YAML"),
        (lambda d, s: (s / "token").unlink(), "tokenFile"),
        (lambda d, s: (s / "ca.crt").unlink(), "certificate-authority"),
    ],
    ids=["missing", "not-yaml", "no-token", "no-ca"],
)
def test_a_bad_kubeconfig_is_one_paragraph_naming_the_file(tmp_path: Path, damage, named):
    config_dir = mount_kube_proxy_configmap(tmp_path, "https://192.0.2.1:6443")
    damage(config_dir, tmp_path / "var/run/secrets/kubernetes.io/serviceaccount")
    with pytest.raises(KubeconfigError) as err:
        api_client(str(config_dir / "kubeconfig.conf"), None, "clientConnection.kubeconfig")
    message = str(err.value)
    assert message.startswith(f"{config_dir / 'kubeconfig.conf'} (clientConnection.kubeconfig)")
    assert named in message and "\n" not in message


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


def test_nothing_listens_here_by_accident() -> None:
    """(The port-holder lookup is also right when nothing holds the port.)"""
    from kpr.node.host import port_holders

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening
        assert port_holders(port) == []
        s.listen()
        assert port_holders(port) == [
            f"pid {os.getpid()} ({Path('/proc/self/comm').read_text().strip()})"
        ]


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
    finally:
        agent.kill()
        subprocess.run([*KPR, "cleanup", "--bpffs", str(pin_dir)], capture_output=True)
    log = (tmp_path / "agent.log").read_text()
    assert "clusterCIDR 10.244.0.0/16 is not used" in log


def test_status_reads_one_service_and_its_slices_from_the_api_server(api) -> None:
    """`kpr status NAMESPACE/NAME` against an API source: list with selectors (the verbs
    kpr's ClusterRole grants), other Services' slices left out, invalid slices named."""
    from kpr.cli.status import service_objects
    from tests.support.kube import endpoint_slice, service

    api.apply(service("web", ["10.96.0.10"], [("http", 80, "TCP")]))
    api.apply(service("web", ["10.96.0.11"], [("http", 80, "TCP")], namespace="other"))
    api.apply(endpoint_slice("web", ["10.244.0.5"], [("http", 8080, "TCP")]))
    api.apply(endpoint_slice("web", ["10.244.9.9"], [("http", 8080, "TCP")], namespace="other"))
    bad = endpoint_slice("web", ["10.244.0.6"], [("http", 8080, "TCP")], name="web-bad")
    bad["endpoints"][0]["addresses"] = ["not-an-ip"]
    api.apply(bad)
    found, slices, problems = service_objects(f"kubernetes:{api.url}", "default", "web", None, None)
    assert found is not None and (found.namespace, found.name) == ("default", "web")
    assert [s.name for s in slices] == ["web-ipv4"]
    assert len(problems) == 1 and problems[0].startswith("EndpointSlice default/web-bad:")
    verbs = {params.get("watch") for _, _, params in api.requests}
    assert verbs == {None}  # lists only
