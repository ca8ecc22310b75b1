#!/bin/sh
# Idempotent host set-up for kpr on Debian 12 (run as root): the packages kpr
# needs, the kernel-headers layout BCC compiles against, bpffs, and (with
# --venv DIR) a virtual environment that sees Debian's BCC bindings.
set -eu

PACKAGES="python3-bpfcc libbpf1 bpftool iproute2 iptables nftables python3-venv gcc make linux-headers-amd64"

missing=""
for p in $PACKAGES; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
	echo "host-setup: installing$missing"
	apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
fi

# BCC looks for headers at /lib/modules/$(uname -r)/build (and source). When
# the running kernel has no headers package (as on our VMs), point it at
# Debian's generic headers: the UAPI structs kpr uses are stable ABI.
kver=$(uname -r)
moddir=/lib/modules/$kver
if [ ! -e "$moddir/build/include/linux/kconfig.h" ] && [ -z "${BCC_KERNEL_SOURCE:-}" ]; then
	arch_dir=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n1)
	common_dir=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n1)
	if [ -z "$arch_dir" ] || [ -z "$common_dir" ]; then
		echo "host-setup: no kernel headers under /usr/src; install linux-headers-amd64" >&2
		exit 1
	fi
	mkdir -p "$moddir"
	ln -sfn "$arch_dir" "$moddir/build"
	ln -sfn "$common_dir" "$moddir/source"
	echo "host-setup: $moddir/build -> $arch_dir"
fi

if ! grep -q " /sys/fs/bpf bpf " /proc/mounts; then
	mount -t bpf bpf /sys/fs/bpf
fi

if [ "${1:-}" = "--venv" ]; then
	venv=$2
	shift 2
	if [ ! -x "$venv/bin/python" ]; then
		/usr/bin/python3 -m venv --system-site-packages "$venv"
	fi
	"$venv/bin/python" -m pip install -q --upgrade pip
	"$venv/bin/python" -m pip install -q -e ".[test]"
fi
