"""`kpr` as a command, and kube-proxy's ConfigMap as a pod mounts it (shared by the CLI
tests in tests/unit/cli and tests/kernel)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

KPR = [sys.executable, "-m", "kpr.cli"]


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
