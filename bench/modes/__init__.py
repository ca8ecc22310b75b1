"""The bench's modes, each a way of carrying a ClusterIP to the pods: base (what a mode is, and
direct), nat (kube-proxy's rulesets as generated, loaded by iptables-restore / nft), kpr (the
agent over a manifest directory), api (the real kube-proxy, and kpr, fed by an API server:
api_feed, what that server holds; change_client, the client timing a change; process, what the
proxy process costs)."""
