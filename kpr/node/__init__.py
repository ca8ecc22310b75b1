"""Facts about the node: its kernel and mounts, its devices and addresses, other proxies' rules."""
