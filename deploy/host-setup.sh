#!/bin/sh
# Idempotent host set-up for kpr on Debian 12 (run as root): the packages kpr
# needs, the kernel headers kpr ships (for a kernel without its own), bpffs, and
# (with --venv DIR) a virtual environment that sees Debian's BCC bindings.
set -eu

PACKAGES="python3-bpfcc libbpf1 bpftool iproute2 iptables nftables python3-venv gcc make"

missing=""
for p in $PACKAGES; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
	echo "host-setup: installing$missing"
	apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
fi

# The headers BCC compiles kpr's programs against when the node has none of its
# own (this VM's kernel has no headers package): Debian's generic ones, merged at
# /usr/lib/kpr/kernel-headers, as in the image. kpr prefers /lib/modules/$(uname -r)
# and /sys/kernel/kheaders.tar.xz when they are there (kpr/node/host.py).
here=$(dirname "$0")
if ! sh "$here/kernel-headers.sh" 2>/dev/null; then
	apt-get update -q
	sh "$here/kernel-headers.sh"
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
	"$venv/bin/python" -m pip install -q -e ".[test,lab]"
fi
