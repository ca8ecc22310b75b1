#!/bin/sh
# A worker: join the cluster once the control plane answers. Idempotent.
# Usage: worker.sh CONTROL_PLANE_IP BOOTSTRAP_TOKEN
set -eu

cp_ip=$1
token=$2

if [ -f /etc/kubernetes/kubelet.conf ]; then
	echo "already joined"
	exit 0
fi
# libvirt brings machines up in parallel: wait for the control plane (up to 20 minutes).
tries=0
until curl -ksf "https://$cp_ip:6443/readyz" >/dev/null; do
	tries=$((tries + 1))
	if [ "$tries" -gt 240 ]; then
		echo "worker: no API server at https://$cp_ip:6443 after 20 minutes" >&2
		exit 1
	fi
	sleep 5
done
# A lab: the token is fixed in the Vagrantfile and the CA is not pinned. On a real cluster
# use `kubeadm token create --print-join-command` on the control plane instead.
kubeadm join "$cp_ip:6443" --token "$token" --discovery-token-unsafe-skip-ca-verification
