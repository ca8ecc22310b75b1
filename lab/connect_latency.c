// connect_latency ADDR PORT COUNT [ADDR2 PORT2 ...]
// connect_latency --paired BLOCK FD_A FD_B COUNT ADDR PORT [...] -- ADDR PORT [...]
//
// Times COUNT fresh blocking TCP connect()s, round robin over the targets, and prints one JSON
// line: {"count", "ok", "failures", "errors": {ERRNO: n}, "min_ns", "p50_ns", "p90_ns",
// "p99_ns", "max_ns", "mean_ns"}. Only connect() itself is timed, so the number is what a
// socket-level load balancer adds to (or saves from) the client's connect path. Each socket is
// closed with SO_LINGER {1, 0}: an RST, so a long run leaves no TIME_WAIT pile-up.
//
// --paired: two sides, COUNT connects each, alternating every BLOCK connects; before its
// block a side moves this process into its cgroup by writing to FD_A / FD_B (open
// cgroup.procs files: `ip netns exec` hides /sys/fs/cgroup). Both sides see the same
// moments of a shared machine. Prints {"block", "a": {...}, "b": {...}}.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define MAX_ERRNO 256

struct target {
	struct sockaddr_storage addr;
	socklen_t len;
};

static int parse_target(const char *host, const char *port, struct target *t)
{
	struct sockaddr_in *in4 = (struct sockaddr_in *)&t->addr;
	struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)&t->addr;
	long p = strtol(port, NULL, 10);

	if (p <= 0 || p > 65535)
		return -1;
	memset(t, 0, sizeof(*t));
	if (inet_pton(AF_INET, host, &in4->sin_addr) == 1) {
		in4->sin_family = AF_INET;
		in4->sin_port = htons((uint16_t)p);
		t->len = sizeof(*in4);
		return 0;
	}
	if (inet_pton(AF_INET6, host, &in6->sin6_addr) == 1) {
		in6->sin6_family = AF_INET6;
		in6->sin6_port = htons((uint16_t)p);
		t->len = sizeof(*in6);
		return 0;
	}
	return -1;
}

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

// Returns the connect() time in ns, or -errno.
static int64_t timed_connect(const struct target *t)
{
	struct timeval timeout = { .tv_sec = 2 }; // SO_SNDTIMEO bounds a blocking connect()
	struct linger reset = { .l_onoff = 1, .l_linger = 0 };
	uint64_t start, end;
	int fd, rc, err;

	fd = socket(t->addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
	start = now_ns();
	rc = connect(fd, (const struct sockaddr *)&t->addr, t->len);
	end = now_ns();
	err = errno;
	setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
	close(fd);
	if (rc < 0)
		return -(err == EINPROGRESS ? ETIMEDOUT : err); // SO_SNDTIMEO expiry reports EINPROGRESS
	return (int64_t)(end - start);
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return (x > y) - (x < y);
}

// Nearest-rank percentile over sorted samples.
static uint64_t percentile(const uint64_t *sorted, long n, int pct)
{
	long rank = (pct * n + 99) / 100;

	return sorted[rank > 0 ? rank - 1 : 0];
}

struct side {
	struct target *targets;
	int ntargets;
	long ok, done, errors[MAX_ERRNO];
	uint64_t *samples;
	double sum;
};

static int parse_side(struct side *side, char **args, int nargs, long count)
{
	if (nargs < 2 || nargs % 2 != 0)
		return -1;
	side->ntargets = nargs / 2;
	side->targets = calloc(side->ntargets, sizeof(*side->targets));
	side->samples = calloc(count, sizeof(*side->samples));
	if (!side->targets || !side->samples)
		return -1;
	for (int i = 0; i < side->ntargets; i++) {
		if (parse_target(args[2 * i], args[2 * i + 1], &side->targets[i]) < 0) {
			fprintf(stderr, "bad target %s %s\n", args[2 * i], args[2 * i + 1]);
			return -1;
		}
	}
	return 0;
}

static void run(struct side *side, long n)
{
	for (long i = 0; i < n; i++, side->done++) {
		int64_t r = timed_connect(&side->targets[side->done % side->ntargets]);

		if (r >= 0) {
			side->samples[side->ok++] = (uint64_t)r;
			side->sum += (double)r;
		} else {
			side->errors[-r < MAX_ERRNO ? -r : 0]++;
		}
	}
}

static void print_stats(struct side *side)
{
	long ok = side->ok;
	int first = 1;

	qsort(side->samples, ok, sizeof(*side->samples), cmp_u64);
	printf("{\"count\": %ld, \"ok\": %ld, \"failures\": %ld, \"errors\": {", side->done, ok,
	       side->done - ok);
	for (int i = 0; i < MAX_ERRNO; i++) {
		if (!side->errors[i])
			continue;
		printf("%s\"%s\": %ld", first ? "" : ", ", strerrorname_np(i) ?: "UNKNOWN",
		       side->errors[i]);
		first = 0;
	}
	if (ok)
		printf("}, \"min_ns\": %" PRIu64 ", \"p50_ns\": %" PRIu64 ", \"p90_ns\": %" PRIu64
		       ", \"p99_ns\": %" PRIu64 ", \"max_ns\": %" PRIu64 ", \"mean_ns\": %.0f}",
		       side->samples[0], percentile(side->samples, ok, 50),
		       percentile(side->samples, ok, 90), percentile(side->samples, ok, 99),
		       side->samples[ok - 1], side->sum / (double)ok);
	else
		printf("}, \"min_ns\": null, \"p50_ns\": null, \"p90_ns\": null, \"p99_ns\": null, "
		       "\"max_ns\": null, \"mean_ns\": null}");
}

static int join_cgroup(int fd)
{
	return write(fd, "0", 1) == 1 ? 0 : -1; // "0": this process
}

static int paired(int argc, char **argv)
{
	struct side sides[2] = { 0 };
	long block, count;
	int fds[2], split = 0;

	if (argc < 10)
		return -1;
	block = strtol(argv[2], NULL, 10);
	fds[0] = atoi(argv[3]);
	fds[1] = atoi(argv[4]);
	count = strtol(argv[5], NULL, 10);
	for (int i = 6; i < argc; i++)
		if (!strcmp(argv[i], "--"))
			split = i;
	if (block <= 0 || count <= 0 || !split ||
	    parse_side(&sides[0], argv + 6, split - 6, count) < 0 ||
	    parse_side(&sides[1], argv + split + 1, argc - split - 1, count) < 0)
		return -1;
	for (long done = 0; done < count; done += block) {
		long n = count - done < block ? count - done : block;
		// A B, then B A: neither side always runs first after a migration
		for (int k = 0; k < 2; k++) {
			int s = (done / block) % 2 ? 1 - k : k;

			if (join_cgroup(fds[s]) < 0) {
				perror("joining a cgroup");
				return 1;
			}
			run(&sides[s], n);
		}
	}
	printf("{\"block\": %ld, \"a\": ", block);
	print_stats(&sides[0]);
	printf(", \"b\": ");
	print_stats(&sides[1]);
	printf("}\n");
	return 0;
}

int main(int argc, char **argv)
{
	struct side side = { 0 };
	long count;

	if (argc >= 2 && !strcmp(argv[1], "--paired")) {
		int rc = paired(argc, argv);

		if (rc < 0)
			fprintf(stderr, "usage: %s --paired BLOCK FD_A FD_B COUNT ADDR PORT [...] -- "
				"ADDR PORT [...]\n", argv[0]);
		return rc < 0 ? 2 : rc;
	}
	if (argc < 4 || (argc - 4) % 2 != 0) {
		fprintf(stderr, "usage: %s ADDR PORT COUNT [ADDR2 PORT2 ...]\n", argv[0]);
		return 2;
	}
	count = strtol(argv[3], NULL, 10);
	if (count <= 0) {
		fprintf(stderr, "COUNT must be a positive number\n");
		return 2;
	}
	// the first target is argv[1..2], the rest follow COUNT: gather them in order
	argv[3] = argv[2];
	argv[2] = argv[1];
	if (parse_side(&side, argv + 2, argc - 2, count) < 0)
		return 2;
	run(&side, count);
	print_stats(&side);
	printf("\n");
	return 0;
}
