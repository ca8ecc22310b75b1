/* kpr: the kernel/user ABI: the map layouts and the maps.
 *
 * kpr/datapath/abi.py mirrors these structs with ctypes; change both in the
 * same commit (tests/kernel/test_abi.py compares them with what BCC compiles).
 *
 * Every constant and map size is defined in kpr/datapath/abi.py only and
 * handed to the compile as -D flags by kpr/datapath/loader.py (abi.cflags):
 *   KPR_PIN_DIR          bpffs directory the maps are pinned in ("/sys/fs/bpf/kpr")
 *   KPR_ABI_VERSION      pinned map names start with "v<version>_"
 *   KPR_BLOCK_SLOTS, KPR_SVC_F_*, KPR_SCOPE_*, KPR_STAT_*, KPR_CT_F_*, KPR_DEVICE_F_*
 *   KPR_<SIZE>_MAX       max_entries (abi.MapSizes, --map-sizes): KPR_SERVICES_MAX,
 *                        KPR_SLOTS_MAX, KPR_BACKENDS_MAX, KPR_REVNAT_MAX, KPR_SOCK_REVNAT_MAX,
 *                        KPR_SOCK_PEERS_MAX, KPR_AFFINITY_MAX, KPR_CT_MAX,
 *                        KPR_SOURCE_RANGES_MAX; fixed ones: KPR_DEVICES_MAX,
 *                        KPR_NODE_PORTS_MAX, KPR_LOCAL_ENDPOINTS_MAX
 * No defaults here: a default would be a second definition that could drift
 * from abi.py's. A compile without the flags stops at the #error below (and
 * any single missing one at its first use, as an undeclared identifier).
 */
#ifndef KPR_H
#define KPR_H

#include <uapi/linux/bpf.h>

#ifndef KPR_ABI_VERSION
#error "kpr.h takes its constants from kpr/datapath/abi.py: compile through kpr.datapath.loader"
#endif

/* KPR_BLOCK_SLOTS: a frontend with at most this many backends also has its
 * slots in kpr_slot_blocks (struct kpr_slot_block: one cache line).
 *
 * Frontend flags (struct kpr_service.flags, master entry):
 *   KPR_SVC_F_SOURCE_RANGES  only sources in kpr_source_ranges
 *   KPR_SVC_F_DROP           no endpoint (count 0) because of externalTrafficPolicy
 *                            Local while other nodes have some: dropped, as
 *                            kube-proxy does, instead of refused
 *
 * Which clients a frontend entry serves (frontend key .scope). A NodePort,
 * LoadBalancer IP or external IP has an entry in each: processes and pods on
 * the node reach every endpoint, while external traffic follows
 * externalTrafficPolicy (Local: this node's endpoints only).
 *   KPR_SCOPE_SOCKET    cgroup hooks: connect/sendmsg on this node
 *   KPR_SCOPE_EXTERNAL  TC: packets arriving on the node's devices
 *
 * Outcome counters, indexes into the per-CPU stats array (abi.STAT_NAMES):
 *   KPR_STAT_TRANSLATED        connect/sendmsg given a backend
 *   KPR_STAT_NO_BACKEND        service without endpoints: refused
 *   KPR_STAT_BACKEND_MISSING   slot or backend entry absent: map error
 *   KPR_STAT_REVERSED          recvmsg/getpeername shown the service address
 *   KPR_STAT_REVNAT_FULL       per-socket reverse entry could not be written
 *   KPR_STAT_EXTERNAL_TRANSLATED  TC: a new external flow given a backend
 *   KPR_STAT_EXTERNAL_REJECTED    TC: no endpoints (or no NAT port): ICMP unreachable
 *   KPR_STAT_EXTERNAL_DROPPED     TC: source outside loadBalancerSourceRanges, or
 *                                 no local endpoint (KPR_SVC_F_DROP): dropped
 *   KPR_STAT_MAX               entries of kpr_stats
 */

/* Addresses are byte arrays in network order and ports are in host order, so
 * `bpftool map dump` shows them as people read them ([10,96,0,10], 80). */

/* kpr_services4/6: a frontend -> its master entry. One entry per frontend: its
 * slots are in its slot block (at most KPR_BLOCK_SLOTS backends) or in kpr_slots
 * (more), under its service id, for both families alike. */
struct kpr_frontend4_key {
	__u8 address[4];  /* ClusterIP, node address, LoadBalancer IP or external IP */
	__u16 port;
	__u8 protocol;    /* IPPROTO_TCP / IPPROTO_UDP */
	__u8 scope;       /* KPR_SCOPE_* */
};

struct kpr_frontend6_key {
	__u8 address[16];
	__u16 port;
	__u8 protocol;
	__u8 scope;
};

/* A frontend's master entry: slots 1..count hold its backends. */
struct kpr_service {
	__u32 count;
	__u32 service_id;       /* names its slots, reverse entry, affinity, source ranges */
	__u32 flags;            /* KPR_SVC_F_* */
	__u32 affinity_timeout; /* seconds; 0: no session affinity */
};

/* kpr_slots: (service id, slot 1..count) -> backend id, for frontends of both
 * families and both scopes with more than KPR_BLOCK_SLOTS backends. The agent
 * writes a frontend's slots before its master's count covers them, so a reader
 * that sees the count finds them. */
struct kpr_slot_key {
	__u32 service_id;
	__u32 slot;
};

/* The slots of a frontend with at most KPR_BLOCK_SLOTS backends (most), at
 * index service_id of an array, and nowhere else: one array access instead of a
 * hash lookup whose random bucket in a large map costs a TLB miss on our VM, and
 * one entry a frontend for the agent to write and check instead of one a slot.
 * A block is written whole, before the master counts it. Backend id 0 (a block
 * cleared once its frontend's slots moved to kpr_slots, a service id past the
 * array) sends the reader to the kpr_slots entry. */
struct kpr_slot_block {
	__u32 backend_ids[KPR_BLOCK_SLOTS]; /* slot 1 at index 0 */
};

/* kpr_backends4/6: backend id -> address (kpr_backends4 an array: port 0, no
 * backend there). */
struct kpr_backend4 {
	__u8 address[4];
	__u16 port;
	__u16 pad;
};

struct kpr_backend6 {
	__u8 address[16];
	__u16 port;
	__u16 pad;
};

/* kpr_revnat4/6: service_id -> the frontend it serves (status; kpr_revnat4 an
 * array: port 0, no frontend has that id). */
struct kpr_revnat4 {
	__u8 address[4];
	__u16 port;
	__u16 pad;
};

struct kpr_revnat6 {
	__u8 address[16];
	__u16 port;
	__u16 pad;
};

/* Per-socket reverse entry: which service address a socket sent to, so
 * recvmsg and getpeername show it instead of the backend. */
struct kpr_sock_revnat4_key {
	__u64 cookie;     /* socket cookie */
	__u8 address[4];  /* backend */
	__u16 port;
	__u16 pad;
};

struct kpr_sock_revnat6_key {
	__u64 cookie;
	__u8 address[16];
	__u16 port;
	__u16 pad;
	__u32 pad2;
};

/* A socket's service and backend, so getpeername and recvmsg can show the
 * service. Unconnected UDP keeps it on the socket (socket local storage,
 * gone when the socket closes). IPv4 uses the first 4 bytes of each address. */
struct kpr_sock_peer {
	__u8 service_address[16];
	__u8 backend_address[16];
	__u16 service_port;
	__u16 backend_port;
	__u32 pad;
};

/* Connected sockets (TCP, connected UDP) write theirs to slot (cookie %
 * KPR_SOCK_PEERS_MAX) of a ring: a plain array write costs connect() almost
 * nothing, where creating socket local storage cost more than the three map
 * lookups together on our VM. A slot is reused after that many newer
 * connects; the cookie tells a reader whether the slot is still its socket's
 * (cookie 0: being rewritten). */
struct kpr_sock_peer_slot {
	__u64 cookie;
	struct kpr_sock_peer peer;
};

/* sessionAffinity ClientIP at the socket: the client is its network namespace
 * (a pod), so one pod keeps its backend for affinity_timeout seconds. */
struct kpr_affinity_key {
	__u64 netns_cookie;
	__u32 service_id;
	__u32 pad;
};

struct kpr_affinity {
	__u64 last_used_ns;  /* bpf_ktime_get_ns() of the last connect */
	__u32 backend_id;
	__u32 slot;          /* where backend_id was: checked again before reuse */
};

/* --- TC datapath (bpf/nodeport.c): NodePort, LoadBalancer, external IPs --- */

/* One flow's addresses as a packet carries them. Both families share the
 * layout (IPv4 in the first 4 bytes of each address, the rest zero). */
struct kpr_flow_key {
	__u8 saddr[16];
	__u8 daddr[16];
	__u16 sport;
	__u16 dport;
	__u8 protocol;
	__u8 family;      /* 4 or 6 */
	__u16 pad;
};

/* flags: KPR_CT_F_SNAT, source translated to a node address (remote backend) */

/* kpr_ct: client -> frontend flow as it arrives -> where its packets go.
 * Every packet of a flow follows its first packet's choice. */
struct kpr_ct {
	__u8 backend_address[16];
	__u8 nat_address[16];  /* KPR_CT_F_SNAT: the node address the backend sees */
	__u16 backend_port;
	__u16 nat_port;
	__u32 backend_id;
	__u32 service_id;
	__u32 flags;
	__u64 last_seen_ns;
};

/* kpr_nat: backend -> client (or -> nat address:port) reply as it arrives ->
 * the frontend (and client) to restore. */
struct kpr_nat {
	__u8 frontend_address[16];
	__u8 client_address[16];
	__u16 frontend_port;
	__u16 client_port;
	__u32 flags;
	__u64 last_seen_ns;
};

/* kpr_devices: ifindex -> the address a flow masqueraded out of that device gets
 * as its source (externalTrafficPolicy Cluster to a backend on another node), the
 * egress device's own address, as iptables' MASQUERADE picks. Every device the TC
 * program is on has an entry; index 0 holds the node's address, for devices that
 * have none of a family. Zero address there too: that family is not masqueraded. */
/* flags: KPR_DEVICE_F_REPLIES, not a --devices device: the TC program is there
 * for the replies of masqueraded flows only, no frontend is served on it */

struct kpr_device {
	__u8 address4[4];
	__u8 address6[16];
	__u32 flags;      /* KPR_DEVICE_F_*; was padding */
};

/* kpr_local_endpoints: the addresses of this node's endpoints (EndpointSlice
 * nodeName) of Services with external frontends. An external flow to one keeps
 * the client's address; to any other it is masqueraded (externalTrafficPolicy
 * Cluster), as kube-proxy masquerades every one. */
struct kpr_local_endpoint_key {
	__u8 address[16]; /* IPv4 in the first 4 bytes */
	__u8 family;      /* 4 or 6 */
	__u8 pad[3];
};

/* sessionAffinity ClientIP on the TC path: the client is its source address. */
struct kpr_affinity_ext_key {
	__u8 address[16];
	__u32 service_id;
};

/* loadBalancerSourceRanges, an LPM trie: prefixlen counts the 32 bits of
 * service_id plus the range's prefix length. */
struct kpr_source_range_key {
	__u32 prefixlen;
	__u32 service_id;
	__u8 address[16];
};

/* NodePorts in use (bind4/bind6 refuse local binds that would shadow them). */
struct kpr_node_port_key {
	__u16 port;
	__u8 protocol;
	__u8 pad;
};

/* Written by the agent at start; index 0 of a one-entry array. */
struct kpr_config {
	/* the node's network namespace (the agent's): the only one whose binds to a
	 * NodePort number are refused. 0: not known, refused in every namespace */
	__u64 node_netns_cookie;
};

#define KPR_STR_(x) #x
#define KPR_STR(x) KPR_STR_(x)
/* "<KPR_PIN_DIR>/v<KPR_ABI_VERSION>_<name>", as abi.PIN_PREFIX */
#define KPR_PIN(name) KPR_PIN_DIR "/v" KPR_STR(KPR_ABI_VERSION) "_" name

BPF_TABLE_PINNED("hash", struct kpr_frontend4_key, struct kpr_service, kpr_services4,
		 KPR_SERVICES_MAX, KPR_PIN("services4"), BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", struct kpr_frontend6_key, struct kpr_service, kpr_services6,
		 KPR_SERVICES_MAX, KPR_PIN("services6"), BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", struct kpr_slot_key, __u32, kpr_slots, KPR_SLOTS_MAX, KPR_PIN("slots"),
		 BPF_F_NO_PREALLOC);
/* The IPv4 maps indexed by an id kpr gives out (backend id, service id) are arrays
 * the agent can mmap (BPF_F_MMAPABLE): its full sync checks them at memory speed,
 * where a batch read costs about 0.35 us an entry. An unused index is all zeros
 * (port 0). The IPv6 ones stay hash maps: an array is preallocated, and one for
 * IPv6 (20 bytes a value) would hold 20 MB at the default size in the many
 * clusters that have no IPv6 endpoint. */
BPF_TABLE_PINNED("array", __u32, struct kpr_backend4, kpr_backends4,
		 KPR_BACKENDS_MAX, KPR_PIN("backends4"), BPF_F_MMAPABLE);
BPF_TABLE_PINNED("hash", __u32, struct kpr_backend6, kpr_backends6,
		 KPR_BACKENDS_MAX, KPR_PIN("backends6"), BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("array", __u32, struct kpr_revnat4, kpr_revnat4,
		 KPR_REVNAT_MAX, KPR_PIN("revnat4"), BPF_F_MMAPABLE);
BPF_TABLE_PINNED("hash", __u32, struct kpr_revnat6, kpr_revnat6,
		 KPR_REVNAT_MAX, KPR_PIN("revnat6"), BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("lru_hash", struct kpr_sock_revnat4_key, struct kpr_revnat4,
		 kpr_sock_revnat4, KPR_SOCK_REVNAT_MAX, KPR_PIN("sock_revnat4"), BPF_F_NO_COMMON_LRU);
BPF_TABLE_PINNED("lru_hash", struct kpr_sock_revnat6_key, struct kpr_revnat6,
		 kpr_sock_revnat6, KPR_SOCK_REVNAT_MAX, KPR_PIN("sock_revnat6"), BPF_F_NO_COMMON_LRU);
BPF_TABLE_PINNED("lru_hash", struct kpr_affinity_key, struct kpr_affinity, kpr_affinity,
		 KPR_AFFINITY_MAX, KPR_PIN("affinity"));
BPF_TABLE_PINNED("sk_storage", int, struct kpr_sock_peer, kpr_sock_peer, 0,
		 KPR_PIN("sock_peer"), BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("array", __u32, struct kpr_sock_peer_slot, kpr_sock_peers, KPR_SOCK_PEERS_MAX,
		 KPR_PIN("sock_peers"));
BPF_TABLE_PINNED("array", __u32, struct kpr_slot_block, kpr_slot_blocks, KPR_REVNAT_MAX,
		 KPR_PIN("slot_blocks"), BPF_F_MMAPABLE);
BPF_TABLE_PINNED("percpu_array", __u32, __u64, kpr_stats, KPR_STAT_MAX,
		 KPR_PIN("stats"));
BPF_TABLE_PINNED("lru_hash", struct kpr_flow_key, struct kpr_ct, kpr_ct, KPR_CT_MAX,
		 KPR_PIN("ct"));
BPF_TABLE_PINNED("lru_hash", struct kpr_flow_key, struct kpr_nat, kpr_nat, KPR_CT_MAX,
		 KPR_PIN("nat"));
BPF_TABLE_PINNED("hash", __u32, struct kpr_device, kpr_devices, KPR_DEVICES_MAX, KPR_PIN("devices"),
		 BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("lru_hash", struct kpr_affinity_ext_key, struct kpr_affinity,
		 kpr_affinity_ext, KPR_AFFINITY_MAX, KPR_PIN("affinity_ext"));
BPF_TABLE_PINNED("lpm_trie", struct kpr_source_range_key, __u8, kpr_source_ranges,
		 KPR_SOURCE_RANGES_MAX, KPR_PIN("source_ranges"), BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", struct kpr_node_port_key, __u8, kpr_node_ports, KPR_NODE_PORTS_MAX,
		 KPR_PIN("node_ports"), BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("array", __u32, struct kpr_config, kpr_config, 1, KPR_PIN("config"));
BPF_TABLE_PINNED("hash", struct kpr_local_endpoint_key, __u8, kpr_local_endpoints,
		 KPR_LOCAL_ENDPOINTS_MAX,
		 KPR_PIN("local_endpoints"), BPF_F_NO_PREALLOC);

#endif /* KPR_H */
