"""Real Kubernetes in the lab: upstream components built from their Go modules (build),
a control plane on loopback (controlplane), and lab Nodes and Pods made through the API
(objects)."""
