"""`kpr bench`: kpr side by side with kube-proxy's iptables and nftables modes."""
