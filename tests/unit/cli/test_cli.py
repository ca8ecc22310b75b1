"""The command line as an operator meets it: --version, bad flags, and kube-proxy's own
ConfigMap (config.conf and kubeconfig.conf) as a pod mounts it. Ports in use, errors as JSON
and `kpr run` from the ConfigMap need root: tests/kernel/test_cli.py."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from kpr import __version__
from kpr.sources.connection import KubeconfigError, connect
from kpr.sources.kubernetes import KubernetesSource
from tests.support.cli import kpr, mount_kube_proxy_configmap, safe_run_args


def test_version() -> None:
    out = kpr("--version")
    assert (out.returncode, out.stdout.strip()) == (0, f"kpr {__version__}")


def test_a_bad_log_level_lists_the_choices(tmp_path: Path) -> None:
    out = kpr(*safe_run_args(tmp_path), "--log-level", "verbose")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    for choice in ("debug", "info", "warning", "error"):
        assert choice in out.stderr


# --- kube-proxy's ConfigMap, as a pod mounts it ----------------------------------------


def test_kube_proxys_kubeconfig_conf_reaches_the_api_server(tmp_path: Path, api) -> None:
    config_dir = mount_kube_proxy_configmap(tmp_path, api.url)
    connection = connect(str(config_dir / "kubeconfig.conf"), None)
    assert connection.host == api.url
    assert connection.token() == "token-1"
    source = KubernetesSource(connection, "node-1")
    source.start()
    try:
        deadline = time.monotonic() + 20
        while not source.synced:
            assert time.monotonic() < deadline, api.requests
            time.sleep(0.05)
    finally:
        source.stop()


def test_a_rotated_token_file_is_read_again(tmp_path: Path, api, monkeypatch) -> None:
    from kpr.sources import connection

    config_dir = mount_kube_proxy_configmap(tmp_path, api.url)
    monkeypatch.setattr(connection, "TOKEN_REREAD", 0.0)
    api_connection = connect(str(config_dir / "kubeconfig.conf"), None)
    assert api_connection.token() == "token-1"
    token = tmp_path / "var/run/secrets/kubernetes.io/serviceaccount/token"
    token.write_text("token-2\n")  # the kubelet rotates bound tokens in place
    assert api_connection.token() == "token-2"


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
        connect(str(config_dir / "kubeconfig.conf"), None, "clientConnection.kubeconfig")
    message = str(err.value)
    assert message.startswith(f"{config_dir / 'kubeconfig.conf'} (clientConnection.kubeconfig)")
    assert named in message and "\n" not in message


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
