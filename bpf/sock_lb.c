/* kpr socket load balancing: cgroup sock_addr hooks.
 *
 * A socket connecting (or sending, for unconnected UDP) to a Service's
 * ClusterIP:port is given a backend's address:port before the kernel routes
 * anything: no DNAT, no conntrack entry, no per-packet cost. recvmsg and
 * getpeername translate the backend back to the service address the
 * application used.
 */
#include "kpr.h"
#include "lb.h"
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

/* TCP and connected UDP: uniform random. Unconnected UDP: by socket cookie, so
 * one socket's datagrams keep going to one backend. */
static __always_inline __u32 client_hash(__u64 cookie, bool by_cookie)
{
	return by_cookie ? (__u32)(cookie ^ (cookie >> 32)) : bpf_get_prandom_u32();
}

static __always_inline int verdict(struct bpf_sock_addr *ctx, int pick)
{
	if (pick == KPR_PICK_REFUSE) {
		kpr_stat_inc(KPR_STAT_NO_BACKEND);
		bpf_set_retval(-KPR_ECONNREFUSED); /* what kube-proxy's REJECT gives */
		return 0;
	}
	if (pick == KPR_PICK_MAP_ERROR) {
		kpr_stat_inc(KPR_STAT_BACKEND_MISSING);
		bpf_set_retval(-KPR_EHOSTUNREACH);
		return 0;
	}
	if (pick == KPR_PICK_BACKEND)
		kpr_stat_inc(KPR_STAT_TRANSLATED);
	return 1;
}

/* A backend for this socket (kpr_pick_slot). With sessionAffinity ClientIP the
 * client is its network namespace (a pod): it keeps its backend for
 * affinity_timeout seconds after its last connect. */
static __always_inline struct kpr_choice choose(struct bpf_sock_addr *ctx,
						const struct kpr_service *master, __u32 n)
{
	struct kpr_affinity_key akey = {};
	struct kpr_affinity value;
	struct kpr_choice choice;
	__u64 now;

	if (!master->affinity_timeout)
		return kpr_pick_slot(master, n, NULL, 0);
	akey.netns_cookie = bpf_get_netns_cookie(ctx);
	akey.service_id = master->service_id;
	now = bpf_ktime_get_ns();
	choice = kpr_pick_slot(master, n, kpr_affinity.lookup(&akey), now);
	if (choice.backend_id) {
		value = kpr_affinity_of(choice, now);
		kpr_affinity.update(&akey, &value);
	}
	return choice;
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
		kpr_stat_inc(KPR_STAT_REVNAT_FULL);
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

/* Write `from`:`from_port` (port in host order) where the hook keeps its address
 * and port (network order). */
static __always_inline void put_address(__u32 *address, __u32 *port, const __u32 *from,
					__u16 from_port, int words)
{
#pragma unroll
	for (int i = 0; i < 4; i++)
		if (i < words)
			address[i] = from[i];
	*port = bpf_htons(from_port);
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
	put_address(address, port, service, peer->service_port, words);
	kpr_stat_inc(KPR_STAT_REVERSED);
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

/* Unconnected UDP may send to several services: one entry per backend, kept by
 * socket cookie in the LRU map of the family. */
static __always_inline void remember_revnat(__u64 cookie, const __u32 *service,
					    __u16 service_port, const __u32 *backend,
					    __u16 backend_port, int words)
{
	long err;

	if (words == 1) {
		struct kpr_sock_revnat4_key rkey = { .cookie = cookie, .port = backend_port };
		struct kpr_revnat4 rval = { .port = service_port };

		__builtin_memcpy(rkey.address, backend, 4);
		__builtin_memcpy(rval.address, service, 4);
		err = kpr_sock_revnat4.update(&rkey, &rval);
	} else {
		struct kpr_sock_revnat6_key rkey = { .cookie = cookie, .port = backend_port };
		struct kpr_revnat6 rval = { .port = service_port };

		__builtin_memcpy(rkey.address, backend, 16);
		__builtin_memcpy(rval.address, service, 16);
		err = kpr_sock_revnat6.update(&rkey, &rval);
	}
	if (err)
		kpr_stat_inc(KPR_STAT_REVNAT_FULL);
}

/* The service address `address`:`port` (backend, network order) was sent to by
 * this socket, from the LRU map of the family; false: none there. */
static __always_inline bool recall_revnat(__u64 cookie, __u32 *address, __u32 *port, int words)
{
	__u16 backend_port = bpf_ntohs((__u16)*port);
	const __u32 *service;
	__u16 service_port;

	if (words == 1) {
		struct kpr_sock_revnat4_key rkey = { .cookie = cookie, .port = backend_port };
		struct kpr_revnat4 *rval;

		__builtin_memcpy(rkey.address, address, 4);
		rval = kpr_sock_revnat4.lookup(&rkey);
		if (!rval)
			return false;
		service = (const __u32 *)rval->address;
		service_port = rval->port;
	} else {
		struct kpr_sock_revnat6_key rkey = { .cookie = cookie, .port = backend_port };
		struct kpr_revnat6 *rval;

		__builtin_memcpy(rkey.address, address, 16);
		rval = kpr_sock_revnat6.lookup(&rkey);
		if (!rval)
			return false;
		service = (const __u32 *)rval->address;
		service_port = rval->port;
	}
	put_address(address, port, service, service_port, words);
	return true;
}

/* The one place a service address becomes a backend. `words` is 1 for IPv4, 4
 * for IPv6; address and port as the hook holds them (network order), rewritten
 * to the backend's when one is picked. */
static __always_inline int pick_backend(struct bpf_sock_addr *ctx, __u32 *address, __u32 *port,
					int words, bool by_cookie)
{
	__u16 service_port = bpf_ntohs((__u16)*port);
	struct kpr_service *master = kpr_master(words == 4, address, service_port, ctx->protocol,
						KPR_SCOPE_SOCKET);
	__u32 backend[4] = {};
	struct kpr_choice choice;
	__u16 backend_port = 0;
	__u64 cookie;

	if (!master)
		return KPR_PICK_NONE;
	if (master->count == 0)
		return KPR_PICK_REFUSE;

	cookie = by_cookie ? bpf_get_socket_cookie(ctx) : 0;
	choice = choose(ctx, master, client_hash(cookie, by_cookie));
	if (!choice.backend_id || !kpr_backend(words == 4, choice.backend_id, backend, &backend_port))
		return KPR_PICK_MAP_ERROR;

	if (!by_cookie)
		remember_connected(ctx, address, service_port, backend, backend_port, words);
	else if (!remember_on_socket(ctx, address, service_port, backend, backend_port, words))
		remember_revnat(cookie, address, service_port, backend, backend_port, words);

	put_address(address, port, backend, backend_port, words);
	return KPR_PICK_BACKEND;
}

/* Backend -> service address, for replies and getpeername. */
static __always_inline void reverse(struct bpf_sock_addr *ctx, __u32 *address, __u32 *port,
				    int words)
{
	if (recall_peer(ctx, address, port, words))
		return;
	if (recall_revnat(bpf_get_socket_cookie(ctx), address, port, words))
		kpr_stat_inc(KPR_STAT_REVERSED);
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
	int pick = pick_backend(ctx, &address, &port, 1, by_cookie);

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
		pick = pick_backend(ctx, &address[3], &port, 1, by_cookie);
	else
		pick = pick_backend(ctx, address, &port, 4, by_cookie);
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

	reverse(ctx, &address, &port, 1);
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
		reverse(ctx, &address[3], &port, 1);
	else
		reverse(ctx, address, &port, 4);
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
