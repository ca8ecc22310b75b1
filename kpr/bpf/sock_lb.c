/* kpr socket load balancing: cgroup sock_addr hooks.
 *
 * A socket connecting (or sending, for unconnected UDP) to a Service's
 * ClusterIP:port is given a backend's address:port before the kernel routes
 * anything: no DNAT, no conntrack entry, no per-packet cost. recvmsg and
 * getpeername translate the backend back to the service address the
 * application used.
 */
#include "kpr.h"
#include <linux/in.h>

#define KPR_EADDRINUSE 98
#define KPR_ECONNREFUSED 111
#define KPR_EHOSTUNREACH 113

enum kpr_pick {
	KPR_PICK_NONE,       /* not a service: leave the socket alone */
	KPR_PICK_BACKEND,    /* backend found */
	KPR_PICK_REFUSE,     /* service without endpoints */
	KPR_PICK_MAP_ERROR,  /* master counts a slot or backend that is absent */
};

static __always_inline void stat_inc(__u32 outcome)
{
	__u64 *counter = kpr_stats.lookup(&outcome);

	if (counter)
		*counter += 1; /* per-CPU: no atomic needed */
}

/* TCP and connected UDP: uniform random. Unconnected UDP: by socket cookie,
 * so one socket's datagrams keep going to one backend. */
static __always_inline __u32 pick_slot(__u32 count, __u64 cookie, bool by_cookie)
{
	__u32 n = by_cookie ? (__u32)(cookie ^ (cookie >> 32)) : bpf_get_prandom_u32();

	return n % count + 1;
}

static __always_inline int verdict(struct bpf_sock_addr *ctx, int pick)
{
	if (pick == KPR_PICK_REFUSE) {
		stat_inc(KPR_STAT_NO_BACKEND);
		bpf_set_retval(-KPR_ECONNREFUSED); /* what kube-proxy's REJECT gives */
		return 0;
	}
	if (pick == KPR_PICK_MAP_ERROR) {
		stat_inc(KPR_STAT_BACKEND_MISSING);
		bpf_set_retval(-KPR_EHOSTUNREACH);
		return 0;
	}
	if (pick == KPR_PICK_BACKEND)
		stat_inc(KPR_STAT_TRANSLATED);
	return 1;
}

/* sessionAffinity ClientIP: the slot this client (its network namespace) used
 * while its timeout lasts, with the backend that was there; 0: none. */
static __always_inline __u32 sticky_slot(struct bpf_sock_addr *ctx,
					 const struct kpr_service *master, __u64 now,
					 __u32 *backend_id)
{
	struct kpr_affinity_key akey = {
		.netns_cookie = bpf_get_netns_cookie(ctx),
		.service_id = master->service_id,
	};
	struct kpr_affinity *sticky = kpr_affinity.lookup(&akey);

	if (!sticky || sticky->slot == 0 || sticky->slot > master->count)
		return 0;
	if (now - sticky->last_used_ns >= (__u64)master->affinity_timeout * 1000000000ULL)
		return 0;
	*backend_id = sticky->backend_id;
	return sticky->slot;
}

/* Each connect renews the affinity, as kube-proxy's `recent` match does. */
static __always_inline void remember_sticky(struct bpf_sock_addr *ctx,
					    const struct kpr_service *master, __u32 slot,
					    __u32 backend_id, __u64 now)
{
	struct kpr_affinity_key akey = {
		.netns_cookie = bpf_get_netns_cookie(ctx),
		.service_id = master->service_id,
	};
	struct kpr_affinity value = { .last_used_ns = now, .backend_id = backend_id, .slot = slot };

	kpr_affinity.update(&akey, &value);
}

/* Compiler barrier: the ring's cookie is written after its slot is filled. */
#define kpr_barrier() asm volatile("" ::: "memory")

/* `words` is 1 for IPv4, 4 for IPv6. */
static __always_inline void fill_peer(struct kpr_sock_peer *peer, const __u32 *service,
				      __u16 service_port, const __u32 *backend,
				      __u16 backend_port, int words)
{
	__u32 *service_out = (__u32 *)peer->service_address;
	__u32 *backend_out = (__u32 *)peer->backend_address;
#pragma unroll
	for (int i = 0; i < 4; i++) {
		service_out[i] = i < words ? service[i] : 0;
		backend_out[i] = i < words ? backend[i] : 0;
	}
	peer->service_port = service_port;
	peer->backend_port = backend_port;
}

/* The socket's slot of the ring (struct kpr_sock_peer_slot), and its cookie. */
static __always_inline struct kpr_sock_peer_slot *ring_slot(struct bpf_sock_addr *ctx,
							    __u64 *cookie)
{
	__u32 index;

	*cookie = bpf_get_socket_cookie(ctx);
	index = (__u32)(*cookie % KPR_SOCK_PEERS_MAX);
	return kpr_sock_peers.lookup(&index);
}

/* Connected sockets (TCP, connected UDP): into the ring slot of their cookie
 * (struct kpr_sock_peer_slot). The cookie goes to 0 while the slot is
 * rewritten, so a reader never takes another socket's half-written entry. */
static __always_inline void remember_connected(struct bpf_sock_addr *ctx, const __u32 *service,
					       __u16 service_port, const __u32 *backend,
					       __u16 backend_port, int words)
{
	__u64 cookie;
	struct kpr_sock_peer_slot *slot = ring_slot(ctx, &cookie);

	if (!slot)
		return;
	slot->cookie = 0;
	kpr_barrier();
	fill_peer(&slot->peer, service, service_port, backend, backend_port, words);
	kpr_barrier();
	slot->cookie = cookie;
}

/* Socket local storage, for unconnected UDP (see remember_on_socket). */
static __always_inline void remember_peer(struct bpf_sock_addr *ctx, const __u32 *service,
					  __u16 service_port, const __u32 *backend,
					  __u16 backend_port, int words)
{
	struct bpf_sock *sk = ctx->sk;
	struct kpr_sock_peer *peer;

	if (!sk)
		return;
	peer = kpr_sock_peer.sk_storage_get(sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!peer) {
		stat_inc(KPR_STAT_REVNAT_FULL);
		return;
	}
	fill_peer(peer, service, service_port, backend, backend_port, words);
}

/* Unconnected UDP: the socket's (service, backend) pair is kept on the socket too,
 * so a resolver's short-lived sockets never fill a shared map: the entry goes when
 * the socket closes. A later send to the same backend for another service takes the
 * place (replies are matched by backend, and the latest send is the one answered, as
 * with the LRU map); only a socket that talks to a second backend needs the LRU map
 * (false: use it). */
static __always_inline bool remember_on_socket(struct bpf_sock_addr *ctx, const __u32 *service,
					       __u16 service_port, const __u32 *backend,
					       __u16 backend_port, int words)
{
	struct bpf_sock *sk = ctx->sk;
	struct kpr_sock_peer *peer;

	if (!sk)
		return false;
	peer = kpr_sock_peer.sk_storage_get(sk, 0, 0);
	if (peer) {
		__u32 *kept_backend = (__u32 *)peer->backend_address;

		if (peer->backend_port != backend_port)
			return false;
#pragma unroll
		for (int i = 0; i < 4; i++)
			if (i < words && kept_backend[i] != backend[i])
				return false;
	}
	remember_peer(ctx, service, service_port, backend, backend_port, words);
	return true;
}

/* If `peer` says `address`:`port` is its backend, put its service there. */
static __always_inline bool put_service(const struct kpr_sock_peer *peer, __u32 *address,
					__u32 *port, int words)
{
	const __u32 *backend = (const __u32 *)peer->backend_address;
	const __u32 *service = (const __u32 *)peer->service_address;

	if (peer->backend_port != bpf_ntohs((__u16)*port))
		return false;
#pragma unroll
	for (int i = 0; i < 4; i++)
		if (i < words && backend[i] != address[i])
			return false;
#pragma unroll
	for (int i = 0; i < 4; i++)
		if (i < words)
			address[i] = service[i];
	*port = bpf_htons(peer->service_port);
	stat_inc(KPR_STAT_REVERSED);
	return true;
}

/* The service of this socket's backend `address`:`port`, from the ring or, for
 * unconnected UDP (and sockets connected by an older kpr), the socket itself. */
static __always_inline bool recall_peer(struct bpf_sock_addr *ctx, __u32 *address, __u32 *port,
					int words)
{
	__u64 cookie;
	struct kpr_sock_peer_slot *slot = ring_slot(ctx, &cookie);
	struct kpr_sock_peer *on_socket;
	struct kpr_sock_peer copy;

	if (slot && slot->cookie == cookie) {
		kpr_barrier();
		__builtin_memcpy(&copy, &slot->peer, sizeof(copy));
		kpr_barrier();
		if (slot->cookie == cookie && put_service(&copy, address, port, words))
			return true;
	}
	if (!ctx->sk)
		return false;
	on_socket = kpr_sock_peer.sk_storage_get(ctx->sk, 0, 0);
	return on_socket && put_service(on_socket, address, port, words);
}

/* The backend id of `slot` from the frontend's slot block; 0: read the slot entry. */
static __always_inline __u32 block_backend(const struct kpr_service *master, __u32 slot)
{
	__u32 service_id = master->service_id;
	struct kpr_slot_block *block;

	if (master->count > KPR_BLOCK_SLOTS)
		return 0;
	block = kpr_slot_blocks.lookup(&service_id);
	return block ? block->backend_ids[(slot - 1) & (KPR_BLOCK_SLOTS - 1)] : 0;
}

/* The one place an IPv4 service address becomes a backend. */
static __always_inline int pick_backend4(struct bpf_sock_addr *ctx, __be32 *address,
					 __u32 *port, bool by_cookie)
{
	struct kpr_service4_key key = {};
	struct kpr_service *master, *slot;
	struct kpr_backend4 *backend;
	__u32 backend_id;
	__u64 cookie;

	__builtin_memcpy(key.address, address, 4);
	key.port = bpf_ntohs((__u16)*port);
	key.protocol = ctx->protocol;
	master = kpr_services4.lookup(&key);
	if (!master)
		return KPR_PICK_NONE;
	if (master->count == 0)
		return KPR_PICK_REFUSE;

	cookie = by_cookie ? bpf_get_socket_cookie(ctx) : 0;
	if (master->affinity_timeout) {
		__u64 now = bpf_ktime_get_ns();
		__u32 sticky_backend = 0;

		key.slot = sticky_slot(ctx, master, now, &sticky_backend);
		slot = key.slot ? kpr_services4.lookup(&key) : NULL;
		if (!slot || slot->backend_id != sticky_backend) {
			key.slot = pick_slot(master->count, cookie, by_cookie);
			slot = kpr_services4.lookup(&key);
		}
		if (!slot)
			return KPR_PICK_MAP_ERROR;
		remember_sticky(ctx, master, key.slot, slot->backend_id, now);
		backend_id = slot->backend_id;
	} else {
		key.slot = pick_slot(master->count, cookie, by_cookie);
		backend_id = block_backend(master, key.slot);
		if (!backend_id) {
			slot = kpr_services4.lookup(&key);
			if (!slot)
				return KPR_PICK_MAP_ERROR;
			backend_id = slot->backend_id;
		}
	}
	backend = kpr_backends4.lookup(&backend_id);
	if (!backend)
		return KPR_PICK_MAP_ERROR;

	if (!by_cookie) {
		remember_connected(ctx, (__u32 *)key.address, key.port, (__u32 *)backend->address,
				   backend->port, 1);
	} else if (!remember_on_socket(ctx, (__u32 *)key.address, key.port,
				       (__u32 *)backend->address, backend->port, 1)) {
		/* unconnected UDP may send to several services: one entry per backend */
		struct kpr_sock_revnat4_key rkey = { .cookie = cookie, .port = backend->port };
		struct kpr_revnat4 rval = { .port = key.port };
		__builtin_memcpy(rkey.address, backend->address, 4);
		__builtin_memcpy(rval.address, key.address, 4);
		if (kpr_sock_revnat4.update(&rkey, &rval))
			stat_inc(KPR_STAT_REVNAT_FULL);
	}

	__builtin_memcpy(address, backend->address, 4);
	*port = bpf_htons(backend->port);
	return KPR_PICK_BACKEND;
}

/* Backend -> service address, for replies and getpeername. */
static __always_inline void reverse4(struct bpf_sock_addr *ctx, __be32 *address, __u32 *port)
{
	struct kpr_sock_revnat4_key rkey = {};
	struct kpr_revnat4 *rval;

	if (recall_peer(ctx, address, port, 1))
		return;
	rkey.cookie = bpf_get_socket_cookie(ctx);
	__builtin_memcpy(rkey.address, address, 4);
	rkey.port = bpf_ntohs((__u16)*port);
	rval = kpr_sock_revnat4.lookup(&rkey);
	if (!rval)
		return;
	__builtin_memcpy(address, rval->address, 4);
	*port = bpf_htons(rval->port);
	stat_inc(KPR_STAT_REVERSED);
}

static __always_inline int pick_backend6(struct bpf_sock_addr *ctx, __u32 address[4],
					 __u32 *port, bool by_cookie)
{
	struct kpr_service6_key key = {};
	struct kpr_service *master, *slot;
	struct kpr_backend6 *backend;
	__u32 backend_id;
	__u64 cookie;

	__builtin_memcpy(key.address, address, 16);
	key.port = bpf_ntohs((__u16)*port);
	key.protocol = ctx->protocol;
	master = kpr_services6.lookup(&key);
	if (!master)
		return KPR_PICK_NONE;
	if (master->count == 0)
		return KPR_PICK_REFUSE;

	cookie = by_cookie ? bpf_get_socket_cookie(ctx) : 0;
	if (master->affinity_timeout) {
		__u64 now = bpf_ktime_get_ns();
		__u32 sticky_backend = 0;

		key.slot = sticky_slot(ctx, master, now, &sticky_backend);
		slot = key.slot ? kpr_services6.lookup(&key) : NULL;
		if (!slot || slot->backend_id != sticky_backend) {
			key.slot = pick_slot(master->count, cookie, by_cookie);
			slot = kpr_services6.lookup(&key);
		}
		if (!slot)
			return KPR_PICK_MAP_ERROR;
		remember_sticky(ctx, master, key.slot, slot->backend_id, now);
		backend_id = slot->backend_id;
	} else {
		key.slot = pick_slot(master->count, cookie, by_cookie);
		backend_id = block_backend(master, key.slot);
		if (!backend_id) {
			slot = kpr_services6.lookup(&key);
			if (!slot)
				return KPR_PICK_MAP_ERROR;
			backend_id = slot->backend_id;
		}
	}
	backend = kpr_backends6.lookup(&backend_id);
	if (!backend)
		return KPR_PICK_MAP_ERROR;

	if (!by_cookie) {
		remember_connected(ctx, (__u32 *)key.address, key.port, (__u32 *)backend->address,
				   backend->port, 4);
	} else if (!remember_on_socket(ctx, (__u32 *)key.address, key.port,
				       (__u32 *)backend->address, backend->port, 4)) {
		struct kpr_sock_revnat6_key rkey = { .cookie = cookie, .port = backend->port };
		struct kpr_revnat6 rval = { .port = key.port };
		__builtin_memcpy(rkey.address, backend->address, 16);
		__builtin_memcpy(rval.address, key.address, 16);
		if (kpr_sock_revnat6.update(&rkey, &rval))
			stat_inc(KPR_STAT_REVNAT_FULL);
	}

	__builtin_memcpy(address, backend->address, 16);
	*port = bpf_htons(backend->port);
	return KPR_PICK_BACKEND;
}

static __always_inline void reverse6(struct bpf_sock_addr *ctx, __u32 address[4], __u32 *port)
{
	struct kpr_sock_revnat6_key rkey = {};
	struct kpr_revnat6 *rval;

	if (recall_peer(ctx, address, port, 4))
		return;
	rkey.cookie = bpf_get_socket_cookie(ctx);
	__builtin_memcpy(rkey.address, address, 16);
	rkey.port = bpf_ntohs((__u16)*port);
	rval = kpr_sock_revnat6.lookup(&rkey);
	if (!rval)
		return;
	__builtin_memcpy(address, rval->address, 16);
	*port = bpf_htons(rval->port);
	stat_inc(KPR_STAT_REVERSED);
}

/* An IPv6 socket may reach an IPv4 service through ::ffff:a.b.c.d. */
static __always_inline bool v4_mapped(const __u32 address[4])
{
	return address[0] == 0 && address[1] == 0 && address[2] == bpf_htonl(0xffff);
}

/* sock_addr fields must be read and written as whole 32-bit words, so the
 * hooks copy them to the stack, work there, and store back. */
static __always_inline int lb4(struct bpf_sock_addr *ctx, bool by_cookie)
{
	__be32 address = ctx->user_ip4;
	__u32 port = ctx->user_port;
	int pick = pick_backend4(ctx, &address, &port, by_cookie);

	if (pick == KPR_PICK_BACKEND) {
		ctx->user_ip4 = address;
		ctx->user_port = port;
	}
	return verdict(ctx, pick);
}

static __always_inline int lb6(struct bpf_sock_addr *ctx, bool by_cookie)
{
	__u32 address[4] = {
		ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3],
	};
	__u32 port = ctx->user_port;
	int pick;

	if (v4_mapped(address))
		pick = pick_backend4(ctx, &address[3], &port, by_cookie);
	else
		pick = pick_backend6(ctx, address, &port, by_cookie);
	if (pick == KPR_PICK_BACKEND) {
		ctx->user_ip6[0] = address[0];
		ctx->user_ip6[1] = address[1];
		ctx->user_ip6[2] = address[2];
		ctx->user_ip6[3] = address[3];
		ctx->user_port = port;
	}
	return verdict(ctx, pick);
}

static __always_inline int reverse_hook4(struct bpf_sock_addr *ctx)
{
	__be32 address = ctx->user_ip4;
	__u32 port = ctx->user_port;

	reverse4(ctx, &address, &port);
	ctx->user_ip4 = address;
	ctx->user_port = port;
	return 1;
}

static __always_inline int reverse_hook6(struct bpf_sock_addr *ctx)
{
	__u32 address[4] = {
		ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3],
	};
	__u32 port = ctx->user_port;

	if (v4_mapped(address))
		reverse4(ctx, &address[3], &port);
	else
		reverse6(ctx, address, &port);
	ctx->user_ip6[0] = address[0];
	ctx->user_ip6[1] = address[1];
	ctx->user_ip6[2] = address[2];
	ctx->user_ip6[3] = address[3];
	ctx->user_port = port;
	return 1;
}

/* Whether the socket is in the node's network namespace (struct kpr_config). */
static __always_inline bool in_node_netns(struct bpf_sock_addr *ctx)
{
	__u32 zero = 0;
	struct kpr_config *config = kpr_config.lookup(&zero);

	if (!config || !config->node_netns_cookie)
		return true; /* not known yet: as if it were */
	return bpf_get_netns_cookie(ctx) == config->node_netns_cookie;
}

/* A socket of the node bound to a NodePort in use would take the port's traffic
 * from the Service (kube-proxy holds these ports open in the node's network
 * namespace for the same reason): bind() fails with EADDRINUSE. A pod has a
 * network namespace of its own, where the number is free. Port 0 (any free
 * port) is never refused. */
static __always_inline int guard_node_port(struct bpf_sock_addr *ctx)
{
	struct kpr_node_port_key key = {
		.port = bpf_ntohs((__u16)ctx->user_port),
		.protocol = ctx->protocol,
	};

	if (key.port == 0 || !kpr_node_ports.lookup(&key) || !in_node_netns(ctx))
		return 1;
	bpf_set_retval(-KPR_EADDRINUSE);
	return 0;
}

int kpr_bind4(struct bpf_sock_addr *ctx) { return guard_node_port(ctx); }
int kpr_bind6(struct bpf_sock_addr *ctx) { return guard_node_port(ctx); }
int kpr_connect4(struct bpf_sock_addr *ctx) { return lb4(ctx, false); }
int kpr_connect6(struct bpf_sock_addr *ctx) { return lb6(ctx, false); }
int kpr_sendmsg4(struct bpf_sock_addr *ctx) { return lb4(ctx, true); }
int kpr_sendmsg6(struct bpf_sock_addr *ctx) { return lb6(ctx, true); }
int kpr_recvmsg4(struct bpf_sock_addr *ctx) { return reverse_hook4(ctx); }
int kpr_recvmsg6(struct bpf_sock_addr *ctx) { return reverse_hook6(ctx); }
int kpr_getpeername4(struct bpf_sock_addr *ctx) { return reverse_hook4(ctx); }
int kpr_getpeername6(struct bpf_sock_addr *ctx) { return reverse_hook6(ctx); }
