#!/bin/sh
# The control plane: kubeadm init without kube-proxy, then kpr from deploy/ (through the
# vagrant/kustomize overlay: this lab's API server address and image). Idempotent.
# Usage: control-plane.sh NODE_IP BOOTSTRAP_TOKEN
set -eu

node_ip=$1
token=$2

if [ ! -f /etc/kubernetes/admin.conf ]; then
	# addon/kube-proxy skipped: kpr is the Service proxy. The token never expires: a lab.
	kubeadm init \
		--apiserver-advertise-address "$node_ip" \
		--token "$token" --token-ttl 0 \
		--skip-phases addon/kube-proxy
fi
for home in /root /home/vagrant; do
	mkdir -p "$home/.kube"
	cp /etc/kubernetes/admin.conf "$home/.kube/config"
done
chown -R vagrant:vagrant /home/vagrant/.kube
export KUBECONFIG=/etc/kubernetes/admin.conf

until kubectl get --raw /readyz >/dev/null 2>&1; do sleep 2; done
kubectl apply -k /kpr/vagrant/kustomize
# The workers' pods come up as they join and import the image; wait for this node's.
here="spec.nodeName=$(hostname)"
until kubectl -n kube-system get pods -l app.kubernetes.io/name=kpr --field-selector "$here" \
	-o name | grep -q .; do
	sleep 2
done
kubectl -n kube-system wait pod -l app.kubernetes.io/name=kpr --field-selector "$here" \
	--for=condition=Ready --timeout=10m
# CoreDNS reaches the API server through the kubernetes Service: it gets ready only
# once kpr serves that ClusterIP.
kubectl -n kube-system rollout status deployment/coredns --timeout=10m
kubectl get nodes -o wide
