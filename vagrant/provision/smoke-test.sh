#!/bin/sh
# Smoke test of kpr on the lab cluster, run on cp:
#   vagrant provision cp --provision-with smoke-test
# Checks a ClusterIP Service from a pod, DNS through the cluster DNS Service, and NodePort
# from a node (served by kpr's TC program on the worker), then prints
# `kpr status` from every kpr pod. Exits non-zero when a check that should pass fails.
# KEEP=1 leaves the kpr-smoke namespace in place for a look around.
set -eu

export KUBECONFIG=/etc/kubernetes/admin.conf
ns=kpr-smoke
failures=0

pass() { echo "PASS: $*"; }
fail() {
	echo "FAIL: $*" >&2
	failures=$((failures + 1))
}

kubectl -n kube-system rollout status daemonset/kpr --timeout=10m
kubectl get nodes -o wide

kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f -
kubectl -n "$ns" apply -f - <<'YAML'
apiVersion: apps/v1
kind: Deployment
metadata:
  name: echo
spec:
  replicas: 3
  selector:
    matchLabels: {app: echo}
  template:
    metadata:
      labels: {app: echo}
    spec:
      containers:
        - name: echo
          image: registry.k8s.io/e2e-test-images/agnhost:2.52
          args: [netexec, --http-port=8080, --udp-port=-1]
          ports: [{containerPort: 8080}]
          readinessProbe:
            httpGet: {path: /healthz, port: 8080}
---
apiVersion: v1
kind: Service
metadata:
  name: echo
spec:
  selector: {app: echo}
  ports: [{port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Service
metadata:
  name: echo-nodeport
spec:
  type: NodePort
  selector: {app: echo}
  ports: [{port: 80, targetPort: 8080, nodePort: 30080}]
---
apiVersion: v1
kind: Pod
metadata:
  name: client
spec:
  containers:
    - name: client
      image: busybox:1.36
      command: [sleep, "86400"]
YAML
kubectl -n "$ns" rollout status deployment/echo --timeout=5m
kubectl -n "$ns" wait pod/client --for=condition=Ready --timeout=5m
cluster_ip=$(kubectl -n "$ns" get service echo -o jsonpath='{.spec.clusterIP}')

# 1. ClusterIP from a pod: every connection answered, and by more than one backend
backends=""
for _ in 1 2 3 4 5 6 7 8 9 10 11 12; do
	if name=$(kubectl -n "$ns" exec client -- wget -qO- -T 5 "http://$cluster_ip/hostname"); then
		backends="$backends
$name"
	else
		fail "ClusterIP $cluster_ip:80 from a pod: no answer"
	fi
done
distinct=$(echo "$backends" | sed '/^$/d' | sort -u | wc -l)
if [ "$distinct" -ge 2 ]; then
	pass "ClusterIP $cluster_ip:80 from a pod: answered by $distinct backends"
else
	fail "ClusterIP $cluster_ip:80 from a pod: answered by $distinct backend(s), expected >= 2"
fi

# 2. DNS through the cluster DNS Service: the pod's resolver is the kube-dns ClusterIP,
#    which kpr sends to a CoreDNS pod (UDP), and the name then works for a connection
fqdn="echo.$ns.svc.cluster.local"
if kubectl -n "$ns" exec client -- nslookup "$fqdn" | grep -qF "$cluster_ip"; then
	pass "DNS: $fqdn resolves to $cluster_ip through the cluster DNS Service"
else
	fail "DNS: $fqdn did not resolve to $cluster_ip"
fi
if kubectl -n "$ns" exec client -- wget -qO- -T 5 "http://$fqdn/hostname" >/dev/null; then
	pass "DNS: http://$fqdn answers"
else
	fail "DNS: http://$fqdn does not answer"
fi

# 3. NodePort from a node (this host, to a worker): the packets arrive on the worker's
#    device, where kpr's TC program serves the NodePort.
worker_ip=$(kubectl get nodes -l '!node-role.kubernetes.io/control-plane' \
	-o jsonpath='{.items[0].status.addresses[?(@.type=="InternalIP")].address}')
if curl -sf -m 5 "http://$worker_ip:30080/hostname" >/dev/null; then
	pass "NodePort: http://$worker_ip:30080 answers"
else
	fail "NodePort: http://$worker_ip:30080 does not answer"
fi

# What kpr holds on every node
for pod in $(kubectl -n kube-system get pods -l app.kubernetes.io/name=kpr -o name); do
	echo "--- $pod"
	kubectl -n kube-system exec "$pod" -- kpr status || fail "kpr status in $pod"
done

if [ "${KEEP:-0}" != 1 ]; then
	kubectl delete namespace "$ns" --wait=false
fi
if [ "$failures" -gt 0 ]; then
	echo "smoke test: $failures check(s) failed" >&2
	exit 1
fi
echo "smoke test: all checks passed"
