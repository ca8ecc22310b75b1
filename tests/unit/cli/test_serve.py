"""`kpr run` hands its parsed flags to the agent's process (kpr/cli/serve.py) as JSON."""

from __future__ import annotations

from kpr.cli.serve import RunOptions


def test_every_flag_survives_the_hand_over():
    options = RunOptions(
        bpffs="/sys/fs/bpf/kpr",
        source=None,
        config_file="/var/lib/kube-proxy/config.conf",
        kubeconfig=None,
        master="https://192.0.2.1:6443",
        cgroup="/sys/fs/cgroup",
        node_name="node-1",
        proxy_name="kpr",
        healthz_bind_address="",
        metrics_bind_address="127.0.0.1:10249",
        min_sync_period=1.0,
        sync_period=30.0,
        netns_dirs=("/run/netns", "/var/run/netns"),
        max_services=131072,
        map_sizes="slots=2097152",
        devices="eth*,ens*",
        external_ip_cidrs="192.0.2.0/24",
        log_level="debug",
    )
    assert RunOptions.from_json(options.to_json()) == options
    assert RunOptions.from_json(RunOptions(bpffs="/b").to_json()) == RunOptions(bpffs="/b")
