"""The benchmarks, all in one place: `kpr bench` (below); the NodePort bench (nodeport:
``python -m bench.nodeport``); the figures at scale of the socket datapath (scale: ``python -m
bench.scale``, `make scale`); the control plane against the test API server (control_plane:
``python -m bench.control_plane``, on tests/support/apiserver.py); the agent's own cost by
cluster size (agent_cost: ``python -m bench.agent_cost``, on the same server) and what it is
made of (agent_parts: ``python -m bench.agent_parts``); and the
network programming latency SLI on the lab's real control plane (sli: ``python -m bench.sli``).
They run from a
checkout of the repository, beside the lab they use (lab/); neither is in the installed package.

`kpr bench`: kpr against kube-proxy's iptables and nftables modes, on this machine, in one run.

For each service count N, every mode is programmed from the same N services × M endpoints in
a throwaway network-namespace lab (lab.netns.Lab: a node netns, M pods, a client cgroup):

- ``direct``: clients connect straight to the pods, the physical limit;
- ``iptables`` / ``iptables-legacy``: kube-proxy's nat table (bench.kubeproxy_rules)
  loaded with ``iptables-restore`` (nf_tables back end) / ``iptables-legacy-restore`` in the
  node netns, hooked from nat OUTPUT as kube-proxy hooks it;
- ``nftables``: kube-proxy's ``ip kube-proxy`` table loaded with ``nft -f`` in the node netns;
- ``kpr``: the real agent (kpr.agent.loop.Agent over a ManifestSource) compiling, attaching to the
  lab's cgroup and writing the real pinned maps;
- ``kube-proxy-iptables`` / ``kube-proxy-nftables`` / ``kpr-api``: the real kube-proxy, and
  ``kpr run``, fed by a real API server holding the same Services.

A few services ("real" ones, spread evenly through the list so a linear rule scan meets them
half way on average) have the pods as endpoints; the rest point at addresses nothing listens on.
Per mode and N: connect latency p50/p99 (lab.latency's C client), short-connection rate
(connect, 1-byte request, 1-byte answer, close) and one connection's streaming throughput (a
small C tool built here, with its own servers in the pods), full programming time, the time
one endpoint change takes to apply as that proxy applies it, and memory. Every datapath figure
is divided by a ``direct`` measurement in the same lab: for kpr, direct alternates with kpr in
the same run, from a sibling cgroup its programs do not see (``measure_paired``); the NAT
modes' rules catch every connect in the netns, so their direct is measured just before they
are loaded.

The modules, each importing only those listed above it (kubeproxy_rules, kube-proxy's rulesets
as text, stands alone; nodeport, scale (and control_plane, which takes its objects) and sli are
benches of their own):

- config: the options (BenchConfig), the modes' names, the address plan, the errors;
- services, manifests: the generated Services; as Kubernetes objects and YAML files;
- lab (and loadgen.c): the lab with the load tool's servers in the pods; the load tool;
- modes: base (what a mode is, and direct), nat (the generated rulesets), kpr (the agent over
  manifests), api_feed, change_client, process and api (the modes fed by an API server);
- measure: the measurements through a mode's datapath, alone or paired with direct;
- report: a mode's samples summed up, the machine, several runs merged;
- rounds: sizes, rounds and slots; the report;
- render, plot: the report as tables (text, Markdown), and as a plot;
- run: the entry points, `kpr bench` and ``python -m bench.run markdown|plot``."""
