"""The lab: throwaway network-namespace labs (netns, cluster), the probes and the pod server
they run, the connect-latency client, `kpr demo` (demo), and real Kubernetes (kube). It runs
from a checkout of the repository (lab/ beside kpr/): it is not in the installed package, and
kpr never imports it but for `kpr demo`."""
