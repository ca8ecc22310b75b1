#!/bin/sh
# Build the kpr image from deploy/Dockerfile on this node and import it into containerd's
# k8s.io namespace, where the kubelet finds it: there is no registry image of kpr. buildah
# builds without a daemon (deploy/build-image.sh); the DaemonSet (vagrant/kustomize) uses
# localhost/kpr:dev with imagePullPolicy IfNotPresent. Idempotent (layers are cached); re-run
# after `vagrant rsync` with `vagrant provision --provision-with kpr-image`.
set -eu

image=localhost/kpr:dev
archive=/var/tmp/kpr-image.tar

export DEBIAN_FRONTEND=noninteractive
if ! command -v buildah >/dev/null; then
	apt-get update -q
	apt-get install -y -q --no-install-recommends buildah
fi
sh /kpr/deploy/build-image.sh "$image" "$archive"
ctr -n k8s.io images import --all-platforms "$archive"
rm -f "$archive"
ctr -n k8s.io images ls -q | grep -F "$image"
