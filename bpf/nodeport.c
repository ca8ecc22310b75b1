/* kpr NodePort / LoadBalancer / externalIPs: TC programs on the node's devices.
 *
 * Packets from outside the node never pass the cgroup socket hooks (no socket
 * on this node sent them), so frontends that serve external clients are
 * translated here, per packet, with a connection table:
 *
 * kpr_tc_ingress (clsact ingress of each node device):
 *   reply of a masqueraded flow (kpr_nat, SNAT) -> frontend -> client, sent on
 *   known flow (kpr_ct)                        -> its backend, as first chosen
 *   new flow to an EXTERNAL-scope frontend      -> pick a backend, record both ways
 * kpr_tc_egress (clsact egress of each node device):
 *   reply of a local backend to a client (kpr_nat, no SNAT) -> source = frontend
 *
 * A backend on another node (externalTrafficPolicy Cluster) must send its
 * replies back here, whatever device the route to it leaves by (the node network,
 * a second NIC, an overlay: VXLAN, Geneve, IPIP, WireGuard): the flow is
 * masqueraded to that egress device's address (kpr_devices, as iptables'
 * MASQUERADE picks it) and a port from [61000, 65535]. The program is also on
 * those devices, for the replies (KPR_DEVICE_F_REPLIES: nothing else is served
 * there). A backend on this node (kpr_local_endpoints) sees the client's own
 * address.
 *
 * Packets kpr does not translate get TC_ACT_UNSPEC, not TC_ACT_OK: in
 * direct-action mode TC_ACT_OK ends the filter chain, and other tools' filters
 * after kpr's must still see the packet.
 */
#include "kpr.h"
#include "lb.h"
#include <linux/in.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>

#define KPR_PASS TC_ACT_UNSPEC /* untouched, or translated for the kernel to deliver */

#define KPR_AF_INET 2
#define KPR_AF_INET6 10
#define KPR_IP_MF 0x2000
#define KPR_IP_OFFSET 0x1fff
#define KPR_TCP_SYN 0x02
#define KPR_TCP_ACK 0x10
#define KPR_NAT_PORT_MIN 61000
#define KPR_NAT_PORTS (65535 - KPR_NAT_PORT_MIN + 1)
#define KPR_NAT_TRIES 8
#define KPR_ICMP_TTL 64

/* BCC 0.26's helpers.h declares bpf_redirect_neigh without its plen argument. */
static long (*kpr_redirect_neigh)(__u32 ifindex, struct bpf_redir_neigh *params, int plen,
				  __u64 flags) = (void *)BPF_FUNC_redirect_neigh;

/* A TCP or UDP packet as parsed: its tuple (the map key) and where things are. */
struct flow {
	struct kpr_flow_key key; /* addresses as carried, ports in host order */
	__u32 l3_len;            /* IPv4 header with options, or the fixed IPv6 header */
	__u32 l4_off;
	__u32 csum_off;          /* the L4 checksum field */
	__u64 csum_flags;        /* UDP: a zero checksum means "none" and must stay so */
	__u8 tcp_flags;
};

/* The 8 bytes ICMP and ICMPv6 destination unreachable messages share. */
struct icmp_unreach {
	__u8 type;
	__u8 code;
	__u16 csum;
	__u32 unused;
};

static __always_inline bool is_v6(const struct flow *f)
{
	return f->key.family == 6;
}

/* Addresses as flow keys hold them: 16 bytes, IPv4 in the first 4, the rest zero. */
static __always_inline bool same_address(const __u8 *a, const __u8 *b)
{
	const __u32 *x = (const __u32 *)a, *y = (const __u32 *)b;

	return ((x[0] ^ y[0]) | (x[1] ^ y[1]) | (x[2] ^ y[2]) | (x[3] ^ y[3])) == 0;
}

static __always_inline bool is_zero(const __u8 *a)
{
	const __u32 *x = (const __u32 *)a;

	return (x[0] | x[1] | x[2] | x[3]) == 0;
}

static __always_inline __u16 fold_csum(__u32 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)~sum;
}

/* Ethernet -> IPv4 or IPv6 -> TCP or UDP. Anything else (ARP, ICMP, IPv4
 * fragments, IPv6 extension headers, truncated or inconsistent headers) is not
 * ours: -1, and the packet passes untouched. */
static __always_inline int parse(struct __sk_buff *skb, struct flow *f)
{
	__u32 tot_len, l4_len, csum_field;
	__be16 proto, ports[2];

	__builtin_memset(f, 0, sizeof(*f));
	if (bpf_skb_load_bytes(skb, offsetof(struct ethhdr, h_proto), &proto, 2) < 0)
		return -1;
	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr ip;

		if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)) < 0)
			return -1;
		if (ip.version != 4 || ip.ihl < 5)
			return -1;
		/* only a first fragment has ports, and only together are they a
		 * packet: the kernel reassembles them first (or drops them) */
		if (ip.frag_off & bpf_htons(KPR_IP_MF | KPR_IP_OFFSET))
			return -1;
		f->l3_len = ip.ihl * 4;
		tot_len = bpf_ntohs(ip.tot_len);
		f->key.family = 4;
		f->key.protocol = ip.protocol;
		__builtin_memcpy(f->key.saddr, &ip.saddr, 4);
		__builtin_memcpy(f->key.daddr, &ip.daddr, 4);
	} else if (proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr ip6;

		if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip6, sizeof(ip6)) < 0)
			return -1;
		if (ip6.version != 6)
			return -1;
		f->l3_len = sizeof(ip6);
		tot_len = sizeof(ip6) + bpf_ntohs(ip6.payload_len);
		f->key.family = 6;
		f->key.protocol = ip6.nexthdr; /* an extension header is neither TCP nor UDP */
		__builtin_memcpy(f->key.saddr, &ip6.saddr, 16);
		__builtin_memcpy(f->key.daddr, &ip6.daddr, 16);
	} else {
		return -1;
	}

	if (f->key.protocol == IPPROTO_TCP) {
		l4_len = 20;
		csum_field = 16;
	} else if (f->key.protocol == IPPROTO_UDP) {
		l4_len = 8;
		csum_field = 6;
		f->csum_flags = BPF_F_MARK_MANGLED_0;
	} else {
		return -1;
	}
	/* the L4 header inside the IP packet, the IP packet inside the frame
	 * (which may be longer: Ethernet padding) */
	if (tot_len < f->l3_len + l4_len || ETH_HLEN + tot_len > skb->len)
		return -1;
	f->l4_off = ETH_HLEN + f->l3_len;
	f->csum_off = f->l4_off + csum_field;
	if (bpf_skb_load_bytes(skb, f->l4_off, ports, sizeof(ports)) < 0)
		return -1;
	f->key.sport = bpf_ntohs(ports[0]);
	f->key.dport = bpf_ntohs(ports[1]);
	if (f->key.protocol == IPPROTO_TCP &&
	    bpf_skb_load_bytes(skb, f->l4_off + 13, &f->tcp_flags, 1) < 0)
		return -1;
	return 0;
}

static __always_inline __u32 saddr_off(const struct flow *f)
{
	return ETH_HLEN + (is_v6(f) ? offsetof(struct ipv6hdr, saddr) : offsetof(struct iphdr, saddr));
}

static __always_inline __u32 daddr_off(const struct flow *f)
{
	return ETH_HLEN + (is_v6(f) ? offsetof(struct ipv6hdr, daddr) : offsetof(struct iphdr, daddr));
}

/* Write an address at `off`, fixing the IPv4 header checksum and the L4
 * checksum, whose pseudo-header covers the addresses. */
static __always_inline int set_addr(struct __sk_buff *skb, const struct flow *f, __u32 off,
				    const __u8 *from, const __u8 *to)
{
	if (!is_v6(f)) {
		__be32 old, new;

		__builtin_memcpy(&old, from, 4);
		__builtin_memcpy(&new, to, 4);
		if (old == new)
			return 0;
		if (bpf_l3_csum_replace(skb, ETH_HLEN + offsetof(struct iphdr, check), old, new,
					4) < 0)
			return -1;
		if (bpf_l4_csum_replace(skb, f->csum_off, old, new,
					BPF_F_PSEUDO_HDR | 4 | f->csum_flags) < 0)
			return -1;
		return bpf_skb_store_bytes(skb, off, &new, 4, 0);
	}
	__u8 old6[16], new6[16];

	__builtin_memcpy(old6, from, 16);
	__builtin_memcpy(new6, to, 16);
	/* no header checksum in IPv6; the L4 one takes the difference of 16 bytes */
	__s64 diff = bpf_csum_diff((void *)old6, 16, (void *)new6, 16, 0);

	if (diff < 0)
		return -1;
	if (bpf_l4_csum_replace(skb, f->csum_off, 0, diff, BPF_F_PSEUDO_HDR | f->csum_flags) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, new6, 16, 0);
}

/* Write a port (host order) at `off`; ports are not in the pseudo-header. */
static __always_inline int set_port(struct __sk_buff *skb, const struct flow *f, __u32 off,
				    __u16 from, __u16 to)
{
	__be16 old = bpf_htons(from), new = bpf_htons(to);

	if (old == new)
		return 0;
	if (bpf_l4_csum_replace(skb, f->csum_off, old, new, 2 | f->csum_flags) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, 2, 0);
}

/* Give the packet the addresses and ports of `to`. A failure may leave it half
 * written: the caller drops it then, never sends it on. */
static __always_inline int rewrite(struct __sk_buff *skb, const struct flow *f,
				   const struct kpr_flow_key *to)
{
	if (set_addr(skb, f, saddr_off(f), f->key.saddr, to->saddr) < 0 ||
	    set_addr(skb, f, daddr_off(f), f->key.daddr, to->daddr) < 0 ||
	    set_port(skb, f, f->l4_off, f->key.sport, to->sport) < 0 ||
	    set_port(skb, f, f->l4_off + 2, f->key.dport, to->dport) < 0)
		return -1;
	return 0;
}

/* The route from `saddr` to `daddr` as if the packet were forwarded from the
 * device it arrived on. */
static __always_inline int route(struct __sk_buff *skb, const struct flow *f, const __u8 *saddr,
				 const __u8 *daddr, struct bpf_fib_lookup *p)
{
	__builtin_memset(p, 0, sizeof(*p));
	p->ifindex = skb->ingress_ifindex;
	p->l4_protocol = f->key.protocol;
	if (is_v6(f)) {
		p->family = KPR_AF_INET6;
		__builtin_memcpy(p->ipv6_src, saddr, 16);
		__builtin_memcpy(p->ipv6_dst, daddr, 16);
	} else {
		p->family = KPR_AF_INET;
		__builtin_memcpy(&p->ipv4_src, saddr, 4);
		__builtin_memcpy(&p->ipv4_dst, daddr, 4);
	}
	return bpf_fib_lookup(skb, p, sizeof(*p), 0);
}

static __always_inline bool routed(int fib_ret)
{
	return fib_ret == BPF_FIB_LKUP_RET_SUCCESS || fib_ret == BPF_FIB_LKUP_RET_NO_NEIGH;
}

/* Send a packet whose source is now a local address out where `route` said.
 * Returning it to the kernel would not do: forwarding drops a packet with a
 * local source as a martian. */
static __always_inline int send_on(struct __sk_buff *skb, const struct flow *f, int fib_ret,
				   struct bpf_fib_lookup *p)
{
	if (fib_ret == BPF_FIB_LKUP_RET_SUCCESS) {
		if (bpf_skb_store_bytes(skb, offsetof(struct ethhdr, h_dest), p->dmac, ETH_ALEN,
					0) < 0 ||
		    bpf_skb_store_bytes(skb, offsetof(struct ethhdr, h_source), p->smac, ETH_ALEN,
					0) < 0)
			return TC_ACT_SHOT;
		return bpf_redirect(p->ifindex, 0);
	}
	if (fib_ret == BPF_FIB_LKUP_RET_NO_NEIGH) {
		/* route found, next hop's MAC not yet known: the kernel resolves it */
		struct bpf_redir_neigh nh = {};

		if (is_v6(f)) {
			nh.nh_family = KPR_AF_INET6;
			__builtin_memcpy(nh.ipv6_nh, p->ipv6_dst, 16);
		} else {
			nh.nh_family = KPR_AF_INET;
			nh.ipv4_nh = p->ipv4_dst;
		}
		return kpr_redirect_neigh(p->ifindex, &nh, sizeof(nh), 0);
	}
	return TC_ACT_SHOT; /* no route: the rewritten packet can go nowhere */
}

static __always_inline int route_and_send(struct __sk_buff *skb, const struct flow *f,
					  const struct kpr_flow_key *to)
{
	struct bpf_fib_lookup p;
	int ret = route(skb, f, to->saddr, to->daddr, &p);

	return send_on(skb, f, ret, &p);
}

/* ICMP replies are built here: with the rest, they do not fit the 512-byte stack
 * (BCC inlines everything into one frame). Private to this program, not pinned. */
struct reply4 {
	struct iphdr ip;
	struct icmp_unreach icmp;
	__u8 quote[60 + 8]; /* IPv4 header with options + 8 bytes of L4 */
};

struct reply6 {
	struct ipv6hdr ip;
	struct icmp_unreach icmp;
	__u8 quote[40 + 8];
};

union reply {
	struct reply4 v4;
	struct reply6 v6;
};

BPF_PERCPU_ARRAY(kpr_tc_scratch, union reply, 1);

/* Build the IPv4 reply in r; its length, or 0. */
static __always_inline __u32 build_reply4(struct __sk_buff *skb, const struct flow *f,
					  struct reply4 *r)
{
	/* the quote: the original IP header and the first 8 bytes of L4 (RFC 792) */
	__u32 quote_len = (f->l3_len + 8) & 0x7c;
	__u32 len;

	if (quote_len < 28 || quote_len > sizeof(r->quote))
		return 0;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, r->quote, quote_len) < 0)
		return 0;
	len = sizeof(r->ip) + sizeof(r->icmp) + quote_len;
	r->ip.version = 4;
	r->ip.ihl = 5;
	r->ip.tot_len = bpf_htons(len);
	r->ip.ttl = KPR_ICMP_TTL;
	r->ip.protocol = IPPROTO_ICMP;
	__builtin_memcpy(&r->ip.saddr, f->key.daddr, 4); /* the frontend the client used */
	__builtin_memcpy(&r->ip.daddr, f->key.saddr, 4);
	r->ip.check = fold_csum(bpf_csum_diff(0, 0, (void *)&r->ip, sizeof(r->ip), 0));
	r->icmp.type = 3; /* destination unreachable */
	r->icmp.code = 3; /* port unreachable */
	r->icmp.csum =
		fold_csum(bpf_csum_diff(0, 0, (void *)&r->icmp, sizeof(r->icmp) + quote_len, 0));
	return len;
}

/* Build the IPv6 reply in r; its length, or 0. */
static __always_inline __u32 build_reply6(struct __sk_buff *skb, const struct flow *f,
					  struct reply6 *r)
{
	struct {
		__be32 len;
		__be32 nexthdr;
	} pseudo = {
		.len = bpf_htonl(sizeof(r->icmp) + sizeof(r->quote)),
		.nexthdr = bpf_htonl(IPPROTO_ICMPV6),
	};
	__s64 sum;

	/* RFC 4443 allows quoting more; the header and 8 bytes name the flow */
	if (bpf_skb_load_bytes(skb, ETH_HLEN, r->quote, sizeof(r->quote)) < 0)
		return 0;
	r->ip.version = 6;
	r->ip.payload_len = bpf_htons(sizeof(r->icmp) + sizeof(r->quote));
	r->ip.nexthdr = IPPROTO_ICMPV6;
	r->ip.hop_limit = KPR_ICMP_TTL;
	__builtin_memcpy(&r->ip.saddr, f->key.daddr, 16);
	__builtin_memcpy(&r->ip.daddr, f->key.saddr, 16);
	r->icmp.type = 1; /* destination unreachable */
	r->icmp.code = 4; /* port unreachable */
	/* ICMPv6's checksum covers a pseudo-header: addresses, length, next header */
	sum = bpf_csum_diff(0, 0, (void *)&r->ip.saddr, 32, 0);
	sum = bpf_csum_diff(0, 0, (void *)&pseudo, sizeof(pseudo), sum);
	sum = bpf_csum_diff(0, 0, (void *)&r->icmp, sizeof(r->icmp) + sizeof(r->quote), sum);
	r->icmp.csum = fold_csum(sum);
	return sizeof(*r);
}

/* Reply with ICMP port unreachable, as kube-proxy's REJECT does: the client
 * (TCP or UDP) learns at once that nothing serves the frontend. The packet is
 * rebuilt in place and sent back out of the device it came in on. */
static __always_inline int reject(struct __sk_buff *skb, const struct flow *f)
{
	__u8 macs[2 * ETH_ALEN];
	__u32 zero = 0, len;
	union reply *r;

	kpr_stat_inc(KPR_STAT_EXTERNAL_REJECTED);
	r = kpr_tc_scratch.lookup(&zero);
	if (!r || bpf_skb_load_bytes(skb, 0, macs, sizeof(macs)) < 0)
		return TC_ACT_SHOT;
	__builtin_memset(r, 0, sizeof(*r));
	len = is_v6(f) ? build_reply6(skb, f, &r->v6) : build_reply4(skb, f, &r->v4);
	if (len == 0 || len > sizeof(*r))
		return TC_ACT_SHOT;
	if (bpf_skb_change_tail(skb, ETH_HLEN + len, 0) < 0 ||
	    bpf_skb_store_bytes(skb, ETH_HLEN, r, len, 0) < 0)
		return TC_ACT_SHOT;
	/* back to where it came from */
	if (bpf_skb_store_bytes(skb, offsetof(struct ethhdr, h_dest), macs + ETH_ALEN, ETH_ALEN,
				0) < 0 ||
	    bpf_skb_store_bytes(skb, offsetof(struct ethhdr, h_source), macs, ETH_ALEN, 0) < 0)
		return TC_ACT_SHOT;
	return bpf_redirect(skb->ifindex, 0);
}

/* A frontend's master entry in the EXTERNAL scope. */
static __always_inline struct kpr_service *frontend(const struct flow *f)
{
	return kpr_master(is_v6(f), f->key.daddr, f->key.dport, f->key.protocol,
			  KPR_SCOPE_EXTERNAL);
}

/* An endpoint on this node (its EndpointSlice nodeName), as the agent knows. */
static __always_inline bool local_endpoint(const struct flow *f, const __u8 *address)
{
	struct kpr_local_endpoint_key key = { .family = f->key.family };

	__builtin_memcpy(key.address, address, 16);
	return kpr_local_endpoints.lookup(&key) != NULL;
}

/* The source a flow masqueraded out of `ifindex` gets: that device's address of
 * the family, else the node's (index 0). False: none, not masqueraded. */
static __always_inline bool masquerade_address(const struct flow *f, __u32 ifindex, __u8 *address)
{
	__u32 indexes[2] = { ifindex, 0 };
	int i;

	for (i = 0; i < 2; i++) {
		struct kpr_device *dev = kpr_devices.lookup(&indexes[i]);

		if (!dev)
			continue;
		if (is_v6(f))
			__builtin_memcpy(address, dev->address6, 16);
		else
			__builtin_memcpy(address, dev->address4, 4);
		if (!is_zero(address))
			return true;
	}
	return false;
}

/* A backend for a new flow (kpr_pick_slot), uniformly random. With
 * sessionAffinity ClientIP the client is its source address: it keeps its
 * backend for affinity_timeout seconds after its last new flow. */
static __always_inline struct kpr_choice choose(const struct flow *f,
						const struct kpr_service *master)
{
	struct kpr_affinity_ext_key akey = { .service_id = master->service_id };
	struct kpr_affinity value;
	struct kpr_choice choice;
	__u64 now;

	if (!master->affinity_timeout)
		return kpr_pick_slot(master, bpf_get_prandom_u32(), NULL, 0);
	__builtin_memcpy(akey.address, f->key.saddr, 16);
	now = bpf_ktime_get_ns();
	choice = kpr_pick_slot(master, bpf_get_prandom_u32(), kpr_affinity_ext.lookup(&akey), now);
	if (choice.backend_id) {
		value = kpr_affinity_of(choice, now);
		kpr_affinity_ext.update(&akey, &value);
	}
	return choice;
}

/* The reply tuple of a packet sent as `to`: what kpr_nat is keyed by. */
static __always_inline void reply_key(const struct kpr_flow_key *to, struct kpr_flow_key *key)
{
	__builtin_memset(key, 0, sizeof(*key));
	__builtin_memcpy(key->saddr, to->daddr, 16);
	__builtin_memcpy(key->daddr, to->saddr, 16);
	key->sport = to->dport;
	key->dport = to->sport;
	key->protocol = to->protocol;
	key->family = to->family;
}

/* A flow kpr_ct knows: every packet follows its first packet's choice. */
static __always_inline int follow(struct __sk_buff *skb, const struct flow *f, struct kpr_ct *ct)
{
	struct kpr_flow_key to = f->key, rkey;
	bool snat = ct->flags & KPR_CT_F_SNAT;
	__u64 now = bpf_ktime_get_ns();
	struct kpr_nat *nat;

	__builtin_memcpy(to.daddr, ct->backend_address, 16);
	to.dport = ct->backend_port;
	if (snat) {
		__builtin_memcpy(to.saddr, ct->nat_address, 16);
		to.sport = ct->nat_port;
	}
	ct->last_seen_ns = now;
	reply_key(&to, &rkey);
	nat = kpr_nat.lookup(&rkey);
	if (nat) {
		nat->last_seen_ns = now;
	} else {
		/* the LRU evicted the reply entry of a live flow: write it again (unless
		 * another flow took its NAT port meanwhile) */
		struct kpr_nat value = { .flags = ct->flags & KPR_CT_F_SNAT, .last_seen_ns = now };

		__builtin_memcpy(value.frontend_address, f->key.daddr, 16);
		__builtin_memcpy(value.client_address, f->key.saddr, 16);
		value.frontend_port = f->key.dport;
		value.client_port = f->key.sport;
		kpr_nat.insert(&rkey, &value);
	}
	if (rewrite(skb, f, &to) < 0)
		return TC_ACT_SHOT;
	return snat ? route_and_send(skb, f, &to) : KPR_PASS;
}

/* A new flow: to an EXTERNAL-scope frontend, or not ours. */
static __always_inline int new_flow(struct __sk_buff *skb, struct flow *f)
{
	struct kpr_service *master = frontend(f);
	struct kpr_flow_key to = f->key, rkey;
	struct kpr_choice choice;
	struct kpr_nat nat = {};
	struct kpr_ct ct = {};
	struct bpf_fib_lookup p;
	bool snat = false;
	int fib_ret;

	if (!master)
		return KPR_PASS;
	if (master->flags & KPR_SVC_F_SOURCE_RANGES) {
		struct kpr_source_range_key rk = {
			.prefixlen = 32 + 128,
			.service_id = master->service_id,
		};
		__builtin_memcpy(rk.address, f->key.saddr, 16);
		if (!kpr_source_ranges.lookup(&rk)) {
			kpr_stat_inc(KPR_STAT_EXTERNAL_DROPPED);
			return TC_ACT_SHOT;
		}
	}
	if (master->count == 0 && (master->flags & KPR_SVC_F_DROP)) {
		kpr_stat_inc(KPR_STAT_EXTERNAL_DROPPED);
		return TC_ACT_SHOT;
	}
	if (master->count == 0)
		return reject(skb, f);
	ct.service_id = master->service_id;
	choice = choose(f, master);
	if (!choice.backend_id || !kpr_backend(is_v6(f), choice.backend_id, to.daddr, &to.dport)) {
		kpr_stat_inc(KPR_STAT_BACKEND_MISSING);
		return TC_ACT_SHOT;
	}

	/* a backend not on this node: masquerade to the address of the device the
	 * route to it leaves by, so its replies come back through this node */
	fib_ret = route(skb, f, f->key.saddr, to.daddr, &p);
	if (routed(fib_ret) && !local_endpoint(f, to.daddr)) {
		__u8 address[16] = {};

		if (masquerade_address(f, p.ifindex, address)) {
			__builtin_memcpy(to.saddr, address, 16);
			snat = true;
		}
	}

	__builtin_memcpy(nat.frontend_address, f->key.daddr, 16);
	__builtin_memcpy(nat.client_address, f->key.saddr, 16);
	nat.frontend_port = f->key.dport;
	nat.client_port = f->key.sport;
	nat.last_seen_ns = bpf_ktime_get_ns();
	if (snat) {
		/* a free port on the node address: the reply tuple names the flow */
		int i;

		nat.flags = KPR_CT_F_SNAT;
		for (i = 0; i < KPR_NAT_TRIES; i++) {
			to.sport = KPR_NAT_PORT_MIN + bpf_get_prandom_u32() % KPR_NAT_PORTS;
			reply_key(&to, &rkey);
			if (kpr_nat.insert(&rkey, &nat) == 0)
				break;
		}
		if (i == KPR_NAT_TRIES)
			return reject(skb, f);
		__builtin_memcpy(ct.nat_address, to.saddr, 16);
		ct.nat_port = to.sport;
		ct.flags = KPR_CT_F_SNAT;
	} else {
		reply_key(&to, &rkey);
		kpr_nat.update(&rkey, &nat);
	}
	__builtin_memcpy(ct.backend_address, to.daddr, 16);
	ct.backend_port = to.dport;
	ct.backend_id = choice.backend_id;
	ct.last_seen_ns = nat.last_seen_ns;
	kpr_ct.update(&f->key, &ct);

	if (rewrite(skb, f, &to) < 0)
		return TC_ACT_SHOT;
	kpr_stat_inc(KPR_STAT_EXTERNAL_TRANSLATED);
	return snat ? send_on(skb, f, fib_ret, &p) : KPR_PASS;
}

/* A connection attempt (SYN without ACK) on a flow whose backend is gone or was
 * replaced: the old choice is void, the flow starts over. */
static __always_inline bool stale(const struct flow *f, const struct kpr_ct *ct)
{
	__u8 address[16] = {};
	__u16 port = 0;

	if (f->key.protocol != IPPROTO_TCP ||
	    (f->tcp_flags & (KPR_TCP_SYN | KPR_TCP_ACK)) != KPR_TCP_SYN)
		return false;
	if (!kpr_backend(is_v6(f), ct->backend_id, address, &port))
		return true;
	return port != ct->backend_port || !same_address(address, ct->backend_address);
}

static __always_inline void forget(struct flow *f, const struct kpr_ct *ct)
{
	struct kpr_flow_key to = f->key, rkey;

	__builtin_memcpy(to.daddr, ct->backend_address, 16);
	to.dport = ct->backend_port;
	if (ct->flags & KPR_CT_F_SNAT) {
		__builtin_memcpy(to.saddr, ct->nat_address, 16);
		to.sport = ct->nat_port;
	}
	reply_key(&to, &rkey);
	kpr_nat.delete(&rkey);
	kpr_ct.delete(&f->key);
}

int kpr_tc_ingress(struct __sk_buff *skb)
{
	__u32 ifindex = skb->ifindex;
	struct kpr_device *dev;
	struct kpr_flow_key to;
	struct kpr_nat *nat;
	struct kpr_ct *ct;
	struct flow f;

	if (parse(skb, &f) < 0)
		return KPR_PASS;

	/* a remote backend's reply to a masqueraded flow: frontend -> client */
	nat = kpr_nat.lookup(&f.key);
	if (nat && (nat->flags & KPR_CT_F_SNAT)) {
		to = f.key;
		__builtin_memcpy(to.saddr, nat->frontend_address, 16);
		__builtin_memcpy(to.daddr, nat->client_address, 16);
		to.sport = nat->frontend_port;
		to.dport = nat->client_port;
		nat->last_seen_ns = bpf_ktime_get_ns();
		if (rewrite(skb, &f, &to) < 0)
			return TC_ACT_SHOT;
		return route_and_send(skb, &f, &to);
	}
	/* a device masqueraded flows leave by, not one frontends are served on */
	dev = kpr_devices.lookup(&ifindex);
	if (dev && (dev->flags & KPR_DEVICE_F_REPLIES))
		return KPR_PASS;

	ct = kpr_ct.lookup(&f.key);
	if (ct && stale(&f, ct)) {
		forget(&f, ct);
		ct = NULL;
	}
	if (ct)
		return follow(skb, &f, ct);
	return new_flow(skb, &f);
}

int kpr_tc_egress(struct __sk_buff *skb)
{
	struct kpr_flow_key to;
	struct kpr_nat *nat;
	struct flow f;

	if (parse(skb, &f) < 0)
		return KPR_PASS;
	/* a local backend's reply leaving towards the client: source = frontend */
	nat = kpr_nat.lookup(&f.key);
	if (!nat || (nat->flags & KPR_CT_F_SNAT))
		return KPR_PASS;
	to = f.key;
	__builtin_memcpy(to.saddr, nat->frontend_address, 16);
	to.sport = nat->frontend_port;
	nat->last_seen_ns = bpf_ktime_get_ns();
	if (rewrite(skb, &f, &to) < 0)
		return TC_ACT_SHOT;
	return KPR_PASS;
}
