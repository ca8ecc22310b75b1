/* kpr: the kernel/user ABI. The one place that defines the map layouts.
 *
 * kpr/datapath/abi.py mirrors these structs with ctypes; change both in the
 * same commit (tests/test_abi.py compares them with what BCC compiles).
 *
 * Set by the loader through cflags:
 *   KPR_PIN_DIR        bpffs directory the maps are pinned in ("/sys/fs/bpf/kpr")
 *   KPR_SERVICE_MAX    entries of each service map (masters + slots)
 *   KPR_BACKEND_MAX    entries of each backend map
 *   KPR_REVNAT_MAX     entries of each service-id -> frontend map
 *   KPR_SOCK_REVNAT_MAX  entries of each per-socket reverse map (LRU)
 *   KPR_AFFINITY_MAX   entries of the session affinity map (LRU)
 */
#ifndef KPR_H
#define KPR_H

#include <uapi/linux/bpf.h>

/* Pinned map names start with this; a changed layout gets a new version. */
#define KPR_ABI_VERSION 1

/* Backends one service frontend may have (slots 1..KPR_MAX_SLOTS). */
#define KPR_MAX_SLOTS 4096

/* Frontend flags (struct kpr_service.flags, master entry). */
#define KPR_SVC_F_NONE 0

/* Outcome counters: index into the per-CPU stats array. */
enum kpr_outcome {
	KPR_STAT_TRANSLATED = 0,    /* connect/sendmsg given a backend */
	KPR_STAT_NO_BACKEND = 1,    /* service without endpoints: refused */
	KPR_STAT_BACKEND_MISSING = 2, /* slot or backend entry absent: map error */
	KPR_STAT_REVERSED = 3,      /* recvmsg/getpeername shown the service address */
	KPR_STAT_REVNAT_FULL = 4,   /* per-socket reverse entry could not be written */
	KPR_STAT_MAX = 8,
};

/* Addresses are byte arrays in network order and ports are in host order, so
 * `bpftool map dump` shows them as people read them ([10,96,0,10], 80). */
struct kpr_service4_key {
	__u8 address[4];  /* ClusterIP */
	__u16 port;
	__u8 protocol;    /* IPPROTO_TCP / IPPROTO_UDP */
	__u8 pad;
	__u16 slot;       /* 0: master entry, 1..count: backend slots */
	__u16 pad2;
};

struct kpr_service6_key {
	__u8 address[16];
	__u16 port;
	__u8 protocol;
	__u8 pad;
	__u16 slot;
	__u16 pad2;
};

/* Master entry (slot 0): count, service_id, flags. Slot entry: backend_id. */
struct kpr_service {
	__u32 backend_id;
	__u32 count;
	__u32 service_id;
	__u32 flags;
	__u32 affinity_timeout; /* seconds; 0: no session affinity */
	__u32 pad;
};

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

/* service_id -> the frontend it serves (reply path, status). */
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

/* A connected socket's service and backend, kept on the socket itself (socket
 * local storage): getpeername and recvmsg read it, and it goes when the
 * socket closes. IPv4 uses the first 4 bytes of each address. */
struct kpr_sock_peer {
	__u8 service_address[16];
	__u8 backend_address[16];
	__u16 service_port;
	__u16 backend_port;
	__u32 pad;
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
	__u16 slot;          /* where backend_id was: checked again before reuse */
	__u16 pad;
};

#define KPR_PIN(name) KPR_PIN_DIR "/v1_" name

BPF_TABLE_PINNED("hash", struct kpr_service4_key, struct kpr_service, kpr_services4,
		 KPR_SERVICE_MAX, KPR_PIN("services4"), BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", struct kpr_service6_key, struct kpr_service, kpr_services6,
		 KPR_SERVICE_MAX, KPR_PIN("services6"), BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", __u32, struct kpr_backend4, kpr_backends4,
		 KPR_BACKEND_MAX, KPR_PIN("backends4"), BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", __u32, struct kpr_backend6, kpr_backends6,
		 KPR_BACKEND_MAX, KPR_PIN("backends6"), BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", __u32, struct kpr_revnat4, kpr_revnat4,
		 KPR_REVNAT_MAX, KPR_PIN("revnat4"), BPF_F_NO_PREALLOC);
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
BPF_TABLE_PINNED("percpu_array", __u32, __u64, kpr_stats, KPR_STAT_MAX,
		 KPR_PIN("stats"));

#endif /* KPR_H */
