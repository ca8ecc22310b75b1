#!/bin/sh
# Install the kernel headers kpr ships, for nodes that have none of their own (COS,
# Bottlerocket, Talos, Flatcar, AL2023, or a kernel without a headers package):
#   deploy/kernel-headers.sh [TARGET]     (default /usr/lib/kpr/kernel-headers; run as root)
# They are Debian's generic linux-headers of this release and architecture, include/ and
# arch/<arch>/include of the -common and the -<flavour> package merged into the one tree that
# BCC_KERNEL_SOURCE names (BCC reads a split tree only from /lib/modules). kpr's BPF programs
# use UAPI structs only, which later kernels keep; kpr/node/host.py (find_kernel_headers) prefers
# the node's own headers and the kernel's kheaders to these.
# The packages are downloaded and unpacked, not installed (-flavour would pull in gcc). Needs
# apt's package lists; does nothing when TARGET already holds the candidate version.
set -eu

target=${1:-/usr/lib/kpr/kernel-headers}
meta=linux-headers-$(dpkg --print-architecture)
flavour=$(apt-cache depends "$meta" 2>/dev/null | sed -n 's/^ *Depends: \(linux-headers-.*\)$/\1/p' | head -n1)
common=$(apt-cache depends "$flavour" 2>/dev/null | sed -n 's/^ *Depends: \(linux-headers-.*-common\)$/\1/p' | head -n1)
if [ -z "$flavour" ] || [ -z "$common" ]; then
	echo "kernel-headers: apt knows no $meta and its -common package (run apt-get update)" >&2
	exit 1
fi
version=$(apt-cache show --no-all-versions "$flavour" | sed -n 's/^Version: //p')
stamp="$flavour $version"
if [ -f "$target/include/linux/kconfig.h" ] && [ "$(cat "$target/SOURCE" 2>/dev/null)" = "$stamp" ]; then
	exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# apt's download sandbox user cannot write into root's mktemp directory
(cd "$work" && apt-get download -q -o APT::Sandbox::User=root "$flavour" "$common")
for deb in "$work"/*.deb; do
	dpkg-deb -x "$deb" "$work/root"
done
src=$work/root/usr/src
karch=$(ls "$src/$flavour/arch") # the one architecture the flavour is for: x86, arm64
new=$work/tree
mkdir -p "$new/arch/$karch"
cp -a "$src/$common/include" "$new/"
cp -a "$src/$flavour/include/generated" "$new/include/"
cp -a "$src/$common/arch/$karch/include" "$new/arch/$karch/"
cp -a "$src/$flavour/arch/$karch/include/generated" "$new/arch/$karch/include/"
echo "$stamp" >"$new/SOURCE"
chmod 755 "$new"

# replaced whole, so a kpr starting meanwhile sees the old tree or the new one
mkdir -p "$(dirname "$target")"
rm -rf "$target.new" "$target.old"
cp -a "$new" "$target.new"
if [ -e "$target" ]; then mv "$target" "$target.old"; fi
mv "$target.new" "$target"
rm -rf "$target.old"
echo "kernel-headers: $target from $stamp"
