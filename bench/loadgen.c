// kpr bench load tool.
//   serve-rr PORT TAG       per connection: read 1 byte, answer the byte TAG, wait for close
//   serve-sink PORT         per connection: read to EOF, answer 1 byte, close
//   rr COUNT ADDR PORT ...  COUNT request/answer connections round robin; RST close; JSON
//   stream BYTES ADDR PORT  one connection sending BYTES, then waiting for the answer; JSON
//   probe MS ADDR PORT      does a connect succeed within MS milliseconds? JSON
//   ready MS ADDR PORT ...  until each target, in turn, connects or is refused (a proxy sent
//                           it somewhere), at most MS ms in all; when (wall clock); JSON
//   sweep MS FIRST COUNT PORT  one pass over COUNT consecutive addresses from FIRST: how
//                           many connected, were refused, neither within MS ms; JSON
//   maxrss ARGV...          run ARGV (stdout to /dev/null); its exit code, CPU, peak RSS; JSON
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int parse(const char *host, const char *port, struct sockaddr_in *sa)
{
    long p = strtol(port, NULL, 10);
    memset(sa, 0, sizeof(*sa));
    sa->sin_family = AF_INET;
    if (p <= 0 || p > 65535 || inet_pton(AF_INET, host, &sa->sin_addr) != 1)
        return -1;
    sa->sin_port = htons((uint16_t)p);
    return 0;
}

static void timeouts(int fd)
{
    struct timeval tv = { .tv_sec = 5 };
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

static void reset_close(int fd)
{
    struct linger l = { .l_onoff = 1, .l_linger = 0 }; // RST: no TIME_WAIT pile-up
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
    close(fd);
}

static int listener(const char *port)
{
    struct sockaddr_in sa;
    int one = 1, fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || parse("0.0.0.0", port, &sa) < 0)
        return -1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(fd, 4096) < 0)
        return -1;
    return fd;
}

static int serve(const char *port, int sink, unsigned char tag)
{
    static char buf[1 << 17];
    int lfd = listener(port);
    if (lfd < 0) {
        perror("listen");
        return 1;
    }
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        ssize_t n;
        if (fd < 0)
            continue;
        timeouts(fd);
        if (sink) {
            while ((n = read(fd, buf, sizeof(buf))) > 0)
                ;
            if (n == 0 && write(fd, "k", 1) != 1)
                perror("write");
        } else if (read(fd, buf, 1) == 1 && write(fd, &tag, 1) == 1) {
            while (read(fd, buf, sizeof(buf)) > 0) // until the client closes
                ;
        }
        close(fd);
    }
}

static int rr(long count, int n, const struct sockaddr_in *t)
{
    long ok = 0, backends[256] = { 0 };
    int first_error = 0, first = 1;
    double start = now_s(), secs;
    for (long i = 0; i < count; i++) {
        unsigned char c;
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            first_error = first_error ? first_error : errno;
            continue;
        }
        timeouts(fd);
        if (connect(fd, (const struct sockaddr *)&t[i % n], sizeof(t[0])) == 0 &&
            write(fd, "q", 1) == 1 && read(fd, &c, 1) == 1) {
            ok++;
            backends[c]++;
        } else if (!first_error) {
            first_error = errno ? errno : EPIPE;
        }
        reset_close(fd);
    }
    secs = now_s() - start;
    printf("{\"count\": %ld, \"ok\": %ld, \"failures\": %ld, \"error\": \"%s\", "
           "\"seconds\": %.6f, \"rate\": %.1f, \"backends\": {",
           count, ok, count - ok, first_error ? strerrorname_np(first_error) : "", secs,
           secs > 0 ? (double)ok / secs : 0.0);
    for (int b = 0; b < 256; b++) {
        if (!backends[b])
            continue;
        printf("%s\"%d\": %ld", first ? "" : ", ", b, backends[b]);
        first = 0;
    }
    printf("}}\n");
    return 0;
}

static int stream(long long bytes, const struct sockaddr_in *t)
{
    static char buf[1 << 17];
    long long left = bytes;
    double start = now_s(), secs;
    char c;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        goto fail;
    timeouts(fd);
    if (connect(fd, (const struct sockaddr *)t, sizeof(*t)) < 0)
        goto fail;
    while (left > 0) {
        ssize_t n = write(fd, buf, left < (long long)sizeof(buf) ? (size_t)left : sizeof(buf));
        if (n <= 0)
            goto fail;
        left -= n;
    }
    shutdown(fd, SHUT_WR);
    if (read(fd, &c, 1) != 1)
        goto fail;
    secs = now_s() - start;
    close(fd);
    printf("{\"ok\": true, \"bytes\": %lld, \"seconds\": %.6f, \"gbit_s\": %.4f}\n", bytes, secs,
           (double)bytes * 8 / secs / 1e9);
    return 0;
fail:
    printf("{\"ok\": false, \"error\": \"%s\"}\n", strerrorname_np(errno) ?: "?");
    return 0;
}

static int probe(int ms, const struct sockaddr_in *t)
{
    struct pollfd p = { .events = POLLOUT };
    int err = 0, rc;
    socklen_t len = sizeof(err);
    p.fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    rc = connect(p.fd, (const struct sockaddr *)t, sizeof(*t));
    if (rc < 0 && errno == EINPROGRESS) {
        rc = poll(&p, 1, ms);
        if (rc == 1) {
            getsockopt(p.fd, SOL_SOCKET, SO_ERROR, &err, &len);
            rc = err ? -1 : 0;
            errno = err;
        } else {
            rc = -1;
            errno = ETIMEDOUT;
        }
    }
    printf("{\"connected\": %s, \"error\": \"%s\"}\n", rc == 0 ? "true" : "false",
           rc == 0 ? "" : strerrorname_np(errno) ?: "?");
    reset_close(p.fd);
    return 0;
}

// 1: connected, 2: refused, 0: neither within ms
static int attempt(const struct sockaddr_in *t, int ms)
{
    struct pollfd p = { .events = POLLOUT };
    int err = 0, out = 0;
    socklen_t len = sizeof(err);
    p.fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (p.fd < 0)
        return 0;
    if (connect(p.fd, (const struct sockaddr *)t, sizeof(*t)) == 0)
        out = 1;
    else if (errno == ECONNREFUSED)
        out = 2;
    else if (errno == EINPROGRESS && poll(&p, 1, ms) == 1 &&
             getsockopt(p.fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0)
        out = err == 0 ? 1 : err == ECONNREFUSED ? 2 : 0;
    reset_close(p.fd);
    return out;
}

static int ready(long ms, int n, const struct sockaddr_in *t)
{
    double start = now_s();
    struct timespec wall;
    int done = 0;
    while (done < n && (now_s() - start) * 1000 < ms) {
        if (attempt(&t[done], 100))
            done++;
        else
            usleep(5000);
    }
    clock_gettime(CLOCK_REALTIME, &wall);
    printf("{\"ready\": %s, \"targets\": %d, \"reached\": %d, \"at\": %.6f}\n",
           done == n ? "true" : "false", n, done, (double)wall.tv_sec + wall.tv_nsec / 1e9);
    return 0;
}

static int sweep(int ms, const char *first, long count, const char *port)
{
    struct sockaddr_in sa;
    char first_failed[INET_ADDRSTRLEN] = "";
    long answered = 0, refused = 0, failed = 0;
    uint32_t base;
    double start = now_s();
    if (parse(first, port, &sa) < 0)
        return 2;
    base = ntohl(sa.sin_addr.s_addr);
    for (long i = 0; i < count; i++) {
        sa.sin_addr.s_addr = htonl(base + (uint32_t)i);
        switch (attempt(&sa, ms)) {
        case 1:
            answered++;
            break;
        case 2:
            refused++;
            break;
        default:
            if (!failed++)
                inet_ntop(AF_INET, &sa.sin_addr, first_failed, sizeof(first_failed));
        }
    }
    printf("{\"answered\": %ld, \"refused\": %ld, \"failed\": %ld, \"first_failed\": \"%s\", "
           "\"seconds\": %.3f}\n", answered, refused, failed, first_failed, now_s() - start);
    return 0;
}

// A child forked from this small process: its peak RSS is its own, not a big parent's
// (ru_maxrss carries the parent's high-water mark over fork and exec).
static int maxrss(char **argv)
{
    struct rusage ru;
    int status, devnull;
    pid_t pid = fork();
    if (pid == 0) {
        devnull = open("/dev/null", O_WRONLY);
        dup2(devnull, 1);
        execvp(argv[0], argv);
        _exit(127);
    }
    if (pid < 0 || wait4(pid, &status, 0, &ru) < 0)
        return 1;
    printf("{\"exit\": %d, \"cpu_s\": %.6f, \"maxrss_kb\": %ld}\n",
           WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status),
           (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
               (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6,
           ru.ru_maxrss);
    return 0;
}

int main(int argc, char **argv)
{
    struct sockaddr_in t[64];
    int n = 0;
    if (argc >= 3 && !strcmp(argv[1], "maxrss"))
        return maxrss(argv + 2);
    if (argc >= 4 && !strcmp(argv[1], "serve-rr"))
        return serve(argv[2], 0, (unsigned char)atoi(argv[3]));
    if (argc >= 3 && !strcmp(argv[1], "serve-sink"))
        return serve(argv[2], 1, 0);
    if (argc == 6 && !strcmp(argv[1], "sweep"))
        return sweep(atoi(argv[2]), argv[3], atol(argv[4]), argv[5]);
    if (argc < 5 || (argc - 3) % 2 != 0)
        goto usage;
    for (int i = 3; i + 1 < argc && n < 64; i += 2)
        if (parse(argv[i], argv[i + 1], &t[n++]) < 0)
            goto usage;
    if (!strcmp(argv[1], "rr"))
        return rr(atol(argv[2]), n, t);
    if (!strcmp(argv[1], "stream"))
        return stream(atoll(argv[2]), t);
    if (!strcmp(argv[1], "probe"))
        return probe(atoi(argv[2]), t);
    if (!strcmp(argv[1], "ready"))
        return ready(atol(argv[2]), n, t);
usage:
    fprintf(stderr, "usage: serve-rr PORT TAG | serve-sink PORT | rr COUNT ADDR PORT... | "
            "stream BYTES ADDR PORT | probe MS ADDR PORT | ready MS ADDR PORT... | "
            "sweep MS FIRST COUNT PORT\n");
    return 2;
}
