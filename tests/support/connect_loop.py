"""A paced TCP client for the reliability tests, run inside a Lab's node netns and cgroup.

It connects round-robin to the given ClusterIP:port targets (each connect reads the pod's
name, as `lab.probe tcp` does) until SIGTERM or SIGINT, then prints one JSON object:
per target, the connects that reached a pod, which pods, and every failure with its time
and errno name. Paced (``--interval`` between connects) so that it leaves the machine's
two cores to the agent under test rather than spinning like `probe loop-tcp`.

    python -m tests.support.connect_loop 10.96.1.1:80 [fd00:96::1]:80 --interval 0.002
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections import Counter

from lab.probe import tcp_once

MAX_ERRORS_KEPT = 200  # per target; the count is always exact


def parse_target(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="+", help="address:port, [v6]:port")
    parser.add_argument("--interval", type=float, default=0.002, help="seconds between connects")
    parser.add_argument("--max-duration", type=float, default=900, help="stop anyway after this")
    args = parser.parse_args(argv)
    targets = [(text, *parse_target(text)) for text in args.targets]
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    ok: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    pods: dict[str, Counter[str]] = {text: Counter() for text, _, _ in targets}
    errors: dict[str, list[dict]] = {text: [] for text, _, _ in targets}
    slowest = 0.0
    start = time.monotonic()
    i = 0
    while not stopping and time.monotonic() - start < args.max_duration:
        text, address, port = targets[i % len(targets)]
        i += 1
        began = time.monotonic()
        result = tcp_once(address, port)
        slowest = max(slowest, time.monotonic() - began)
        if "pod" in result:
            ok[text] += 1
            pods[text][result["pod"]] += 1
        else:
            failed[text] += 1
            if len(errors[text]) < MAX_ERRORS_KEPT:
                errors[text].append({"t": round(began - start, 3), "error": result["error"]})
        time.sleep(args.interval)
    summary = {
        "seconds": round(time.monotonic() - start, 3),
        "connects": sum(ok.values()) + sum(failed.values()),
        "failures": sum(failed.values()),
        "slowest_connect_s": round(slowest, 4),
        "targets": {
            text: {
                "ok": ok[text],
                "failed": failed[text],
                "pods": dict(pods[text]),
                "errors": errors[text],
            }
            for text, _, _ in targets
        },
    }
    json.dump(summary, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
