#!/bin/sh
# Every node: containerd, kubelet/kubeadm/kubectl from pkgs.k8s.io, a pod network of plain
# bridges and routes (no CNI daemon: it would need the kubernetes Service, which kpr serves),
# and what kpr needs from the host (kernel headers, bpffs) via deploy/host-setup.sh.
# Usage: common.sh NODE_IP NODE_INDEX ALL_NODE_IPS(comma-separated) K8S_MINOR   (idempotent)
set -eu

node_ip=$1
index=$2
all_ips=$3
k8s_minor=$4
pod_prefix=10.244 # node N's pods: 10.244.N.0/24

export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends \
	ca-certificates curl gpg containerd iptables conntrack socat ethtool

# --- kubelet, kubeadm, kubectl from pkgs.k8s.io ---
keyring=/etc/apt/keyrings/kubernetes-apt-keyring.gpg
if [ ! -s "$keyring" ]; then
	mkdir -p /etc/apt/keyrings
	curl -fsSL "https://pkgs.k8s.io/core:/stable:/$k8s_minor/deb/Release.key" |
		gpg --dearmor -o "$keyring"
fi
echo "deb [signed-by=$keyring] https://pkgs.k8s.io/core:/stable:/$k8s_minor/deb/ /" \
	>/etc/apt/sources.list.d/kubernetes.list
apt-get update -q
apt-get install -y -q kubelet kubeadm kubectl kubernetes-cni
apt-mark hold kubelet kubeadm kubectl

# --- kernel settings kubeadm checks; no swap ---
swapoff -a
sed -i '/\sswap\s/s/^[^#]/#&/' /etc/fstab
printf 'overlay\nbr_netfilter\n' >/etc/modules-load.d/k8s.conf
modprobe overlay
modprobe br_netfilter
cat >/etc/sysctl.d/k8s.conf <<SYSCTL
net.ipv4.ip_forward = 1
net.bridge.bridge-nf-call-iptables = 1
net.bridge.bridge-nf-call-ip6tables = 1
SYSCTL
sysctl -q --system

# --- containerd: systemd cgroups, the pause image kubeadm wants ---
pause=$(kubeadm config images list --kubernetes-version "$(kubeadm version -o short)" 2>/dev/null |
	grep /pause: || echo registry.k8s.io/pause:3.10)
mkdir -p /etc/containerd
containerd config default |
	sed -e 's/SystemdCgroup = false/SystemdCgroup = true/' \
		-e "s|sandbox_image = .*|sandbox_image = \"$pause\"|" \
		>/etc/containerd/config.toml
systemctl restart containerd
printf 'runtime-endpoint: unix:///run/containerd/containerd.sock\n' >/etc/crictl.yaml

# The kubelet on the private network, not Vagrant's NAT interface.
echo "KUBELET_EXTRA_ARGS=--node-ip=$node_ip" >/etc/default/kubelet
systemctl enable kubelet

# --- pod network: a bridge per node, routes to the other nodes' pod subnets ---
mkdir -p /etc/cni/net.d
cat >/etc/cni/net.d/10-kpr-lab.conflist <<CNI
{
  "cniVersion": "1.0.0",
  "name": "kpr-lab",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$pod_prefix.$index.0/24"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}},
    {"type": "loopback"}
  ]
}
CNI
routes=""
i=0
for ip in $(echo "$all_ips" | tr ',' ' '); do
	if [ "$i" != "$index" ]; then
		routes="$routes ip route replace $pod_prefix.$i.0/24 via $ip;"
	fi
	i=$((i + 1))
done
cat >/etc/systemd/system/kpr-lab-net.service <<UNIT
[Unit]
Description=kpr lab: routes to the other nodes' pods, NAT for pods leaving the cluster
After=network-online.target
Wants=network-online.target
Before=kubelet.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c '$routes iptables -t nat -C POSTROUTING -s $pod_prefix.0.0/16 ! -d $pod_prefix.0.0/16 -j MASQUERADE 2>/dev/null || iptables -t nat -A POSTROUTING -s $pod_prefix.0.0/16 ! -d $pod_prefix.0.0/16 -j MASQUERADE'

[Install]
WantedBy=multi-user.target
UNIT
systemctl daemon-reload
systemctl enable --now kpr-lab-net.service
systemctl restart kpr-lab-net.service

# --- what kpr needs from the host: kernel headers (linked where BCC looks) and bpffs ---
sh /kpr/deploy/host-setup.sh
