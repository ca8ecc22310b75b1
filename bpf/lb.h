/* kpr load balancing: how a frontend's backend is chosen, one library for the
 * socket hooks (sock_lb.c) and the TC programs (nodeport.c).
 *
 *   kpr_master4/6, kpr_master   a frontend's master entry (kpr_services4/6)
 *   kpr_slot_backend            a slot's backend id: the slot block, else kpr_slots
 *   kpr_pick_slot               the one choice: the remembered slot under
 *                               sessionAffinity, else random or by a hash
 *   kpr_sticky_slot,            affinity, whoever the client is (a network
 *   kpr_affinity_of             namespace at the socket, an address on TC)
 *   kpr_backend                 a backend id's address and port
 *
 * Family-free past the master: a frontend's slots are keyed by its service id.
 *
 * BCC rewrites map calls (`kpr_slots.lookup(...)`) only in the file it compiles:
 * kpr/datapath/loader.py (program_text) pastes this file where a program
 * includes it, after kpr.h, whose maps it uses.
 */
#ifndef KPR_LB_H
#define KPR_LB_H

static __always_inline void kpr_stat_inc(__u32 outcome)
{
	__u64 *counter = kpr_stats.lookup(&outcome);

	if (counter)
		*counter += 1; /* per-CPU: no atomic needed */
}

/* A frontend's master entry; NULL: the address is no frontend of that scope. */
static __always_inline struct kpr_service *kpr_master4(const void *address, __u16 port,
						       __u8 protocol, __u8 scope)
{
	struct kpr_frontend4_key key = { .port = port, .protocol = protocol, .scope = scope };

	__builtin_memcpy(key.address, address, 4);
	return kpr_services4.lookup(&key);
}

static __always_inline struct kpr_service *kpr_master6(const void *address, __u16 port,
						       __u8 protocol, __u8 scope)
{
	struct kpr_frontend6_key key = { .port = port, .protocol = protocol, .scope = scope };

	__builtin_memcpy(key.address, address, 16);
	return kpr_services6.lookup(&key);
}

static __always_inline struct kpr_service *kpr_master(bool v6, const void *address, __u16 port,
						      __u8 protocol, __u8 scope)
{
	return v6 ? kpr_master6(address, port, protocol, scope)
		  : kpr_master4(address, port, protocol, scope);
}

/* The backend id in `slot` (1..count) of a frontend: from its slot block when it
 * has one (at most KPR_BLOCK_SLOTS backends) and the block's entry is not 0, else
 * from its kpr_slots entry (more backends; or a reader that read the master just
 * before the slots moved to kpr_slots and the block was cleared). 0: absent, the
 * master counts a slot that is not there. */
static __always_inline __u32 kpr_slot_backend(const struct kpr_service *master, __u32 slot)
{
	struct kpr_slot_key key = { .service_id = master->service_id, .slot = slot };
	__u32 *backend_id;

	if (master->count <= KPR_BLOCK_SLOTS) {
		struct kpr_slot_block *block = kpr_slot_blocks.lookup(&key.service_id);
		__u32 id = block ? block->backend_ids[(slot - 1) & (KPR_BLOCK_SLOTS - 1)] : 0;

		if (id)
			return id;
	}
	backend_id = kpr_slots.lookup(&key);
	return backend_id ? *backend_id : 0;
}

/* sessionAffinity ClientIP: the slot a client's affinity entry (NULL: none)
 * remembers, while its timeout lasts and while that slot still holds the backend
 * it had (*backend_id); 0: choose anew. */
static __always_inline __u32 kpr_sticky_slot(const struct kpr_service *master,
					     const struct kpr_affinity *sticky, __u64 now,
					     __u32 *backend_id)
{
	if (!sticky || sticky->slot == 0 || sticky->slot > master->count)
		return 0;
	if (now - sticky->last_used_ns >= (__u64)master->affinity_timeout * 1000000000ULL)
		return 0;
	if (kpr_slot_backend(master, sticky->slot) != sticky->backend_id)
		return 0;
	*backend_id = sticky->backend_id;
	return sticky->slot;
}

/* A connection's or a flow's choice. */
struct kpr_choice {
	__u32 slot;
	__u32 backend_id; /* 0: the master counts a slot that is absent */
};

/* The one place a frontend with backends (count > 0) chooses one: the slot the
 * client's affinity entry remembers (sticky; NULL without sessionAffinity), else
 * slot n % count + 1, where n is random or a hash of the client. */
static __always_inline struct kpr_choice kpr_pick_slot(const struct kpr_service *master, __u32 n,
						       const struct kpr_affinity *sticky, __u64 now)
{
	struct kpr_choice choice = {};

	choice.slot = kpr_sticky_slot(master, sticky, now, &choice.backend_id);
	if (choice.slot)
		return choice;
	choice.slot = n % master->count + 1;
	choice.backend_id = kpr_slot_backend(master, choice.slot);
	return choice;
}

/* The affinity entry a choice leaves. Each new connection or flow renews it, as
 * kube-proxy's `recent` match does. */
static __always_inline struct kpr_affinity kpr_affinity_of(struct kpr_choice choice, __u64 now)
{
	struct kpr_affinity value = {
		.last_used_ns = now,
		.backend_id = choice.backend_id,
		.slot = choice.slot,
	};
	return value;
}

/* A backend id's address (4 or 16 bytes written) and port; false: absent (past
 * the array, or an unused index: port 0). */
static __always_inline bool kpr_backend(bool v6, __u32 id, void *address, __u16 *port)
{
	if (v6) {
		struct kpr_backend6 *b = kpr_backends6.lookup(&id);

		if (!b || !b->port)
			return false;
		__builtin_memcpy(address, b->address, 16);
		*port = b->port;
		return true;
	}
	struct kpr_backend4 *b = kpr_backends4.lookup(&id);

	if (!b || !b->port)
		return false;
	__builtin_memcpy(address, b->address, 4);
	*port = b->port;
	return true;
}

#endif /* KPR_LB_H */
