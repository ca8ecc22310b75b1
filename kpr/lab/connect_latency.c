// connect_latency ADDR PORT COUNT [ADDR2 PORT2 ...]
//
// Times COUNT fresh blocking TCP connect()s, round robin over the targets, and prints one JSON
// line: {"count", "ok", "failures", "errors": {ERRNO: n}, "min_ns", "p50_ns", "p90_ns",
// "p99_ns", "max_ns", "mean_ns"}. Only connect() itself is timed, so the number is what a
// socket-level load balancer adds to (or saves from) the client's connect path. Each socket is
// closed with SO_LINGER {1, 0}: an RST, so a long run leaves no TIME_WAIT pile-up.
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

int main(int argc, char **argv)
{
	long count, ok = 0, errors[MAX_ERRNO] = { 0 };
	struct target *targets;
	uint64_t *samples;
	double sum = 0;
	int ntargets, i, first = 1;

	if (argc < 4 || (argc - 4) % 2 != 0) {
		fprintf(stderr, "usage: %s ADDR PORT COUNT [ADDR2 PORT2 ...]\n", argv[0]);
		return 2;
	}
	count = strtol(argv[3], NULL, 10);
	ntargets = 1 + (argc - 4) / 2;
	targets = calloc(ntargets, sizeof(*targets));
	samples = calloc(count > 0 ? count : 1, sizeof(*samples));
	if (count <= 0 || !targets || !samples) {
		fprintf(stderr, "COUNT must be a positive number\n");
		return 2;
	}
	for (i = 0; i < ntargets; i++) {
		const char *host = i == 0 ? argv[1] : argv[4 + 2 * (i - 1)];
		const char *port = i == 0 ? argv[2] : argv[5 + 2 * (i - 1)];

		if (parse_target(host, port, &targets[i]) < 0) {
			fprintf(stderr, "bad target %s %s\n", host, port);
			return 2;
		}
	}

	for (long n = 0; n < count; n++) {
		int64_t r = timed_connect(&targets[n % ntargets]);

		if (r >= 0) {
			samples[ok++] = (uint64_t)r;
			sum += (double)r;
		} else {
			errors[-r < MAX_ERRNO ? -r : 0]++;
		}
	}

	qsort(samples, ok, sizeof(*samples), cmp_u64);
	printf("{\"count\": %ld, \"ok\": %ld, \"failures\": %ld, \"errors\": {", count, ok,
	       count - ok);
	for (i = 0; i < MAX_ERRNO; i++) {
		if (!errors[i])
			continue;
		printf("%s\"%s\": %ld", first ? "" : ", ", strerrorname_np(i) ?: "UNKNOWN",
		       errors[i]);
		first = 0;
	}
	if (ok)
		printf("}, \"min_ns\": %" PRIu64 ", \"p50_ns\": %" PRIu64 ", \"p90_ns\": %" PRIu64
		       ", \"p99_ns\": %" PRIu64 ", "
		       "\"max_ns\": %" PRIu64 ", \"mean_ns\": %.0f}\n",
		       samples[0], percentile(samples, ok, 50), percentile(samples, ok, 90),
		       percentile(samples, ok, 99), samples[ok - 1], sum / (double)ok);
	else
		printf("}, \"min_ns\": null, \"p50_ns\": null, \"p90_ns\": null, \"p99_ns\": null, "
		       "\"max_ns\": null, \"mean_ns\": null}\n");
	free(samples);
	free(targets);
	return 0;
}
