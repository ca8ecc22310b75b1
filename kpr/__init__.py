"""kpr: an eBPF replacement for kube-proxy, Services load-balanced at the socket."""

__version__ = "0.1.0"
