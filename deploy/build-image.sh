#!/bin/sh
# Build the kpr image from deploy/Dockerfile with buildah (no Docker engine, no daemon) and write
# it to ARCHIVE as an OCI archive; `ctr images import --all-platforms ARCHIVE` names it IMAGE.
# Used by vagrant/provision/kpr-image.sh and the kubelet lab (lab/kube/images.py), which adds
# options for `buildah bud` after the two arguments (it builds with no registry: --pull=never).
#   deploy/build-image.sh IMAGE ARCHIVE [BUD-OPTION...]
set -eu

image=$1
archive=$2
shift 2
repo=$(cd "$(dirname "$0")/.." && pwd)

buildah bud --layers "$@" -f "$repo/deploy/Dockerfile" -t "$image" "$repo"
rm -f "$archive"
buildah push "$image" "oci-archive:$archive:$image"
