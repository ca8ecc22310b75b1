"""The idle cost of two kpr checkouts side by side, in one run:

    git worktree add /tmp/kpr-before COMMIT
    python -m bench.idle_pair --services 10000 --against /tmp/kpr-before --rounds 2 \\
        --json docs/results/idle-pair.json

This VM does the same work up to ten times slower at some hours than at others, so idle
figures from runs hours apart do not compare (docs/benchmarks.md). Here one test API server
(N Services x M endpoints, as bench.agent_cost makes them) serves `kpr run` of this
checkout, then of --against's, --rounds times over: each agent, once two periodic full
syncs have run, is measured over --idle seconds: its CPU (all threads, /proc) as a share of
one core, its full syncs' mean duration (its own metrics) and its RSS. Each measurement is
appended to --json as soon as it is made.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.agent_cost import (
    BOOKMARK_INTERVAL,
    cpu_seconds,
    free_port,
    full_syncs,
    max_services,
)
from bench.control_plane import populate, rss_mb, running_agent
from kpr.agent import runstate
from tests.support.apiserver import TestApiServer

HERE = Path(__file__).resolve().parent.parent


def commit(checkout: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or "?"


def measure_idle(api: TestApiServer, services: int, idle: float) -> dict:
    """`kpr run` of the checkout on PYTHONPATH, on `api`: its idle cost."""
    port = free_port()
    options = ["--max-services", str(max_services(services)),
               "--metrics-bind-address", f"127.0.0.1:{port}"]  # fmt: skip
    with running_agent(api, *options) as (agent, pin_dir):
        runstate.wait_synced(pin_dir, agent, timeout=1200)
        first = full_syncs(port)[1]
        while full_syncs(port)[1] < first + 2:  # (the first sync's one-offs behind it)
            time.sleep(0.5)
        seconds, count = full_syncs(port)
        cpu, began = cpu_seconds(agent.pid), time.monotonic()
        time.sleep(idle)
        seconds_after, count_after = full_syncs(port)
        elapsed = time.monotonic() - began
        return {
            "idle_seconds": round(elapsed, 1),
            "idle_cpu_percent": round(100 * (cpu_seconds(agent.pid) - cpu) / elapsed, 3),
            "full_syncs": count_after - count,
            "full_sync_mean_s": round((seconds_after - seconds) / max(1, count_after - count), 4),
            "rss_mb": round(rss_mb(agent.pid), 1),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--against", type=Path, required=True, help="another kpr checkout")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--idle", type=float, default=150.0, help="seconds measured, each")
    parser.add_argument("--json", type=Path, help="measurements, appended as they are made")
    args = parser.parse_args()
    checkouts = [HERE, args.against.resolve()]
    results = json.loads(args.json.read_text()) if args.json and args.json.exists() else []
    with TestApiServer(bookmark_interval=BOOKMARK_INTERVAL) as api:
        populate(api, args.services, args.endpoints, placed=True)
        for round_ in range(args.rounds):
            for checkout in checkouts:
                # the agent's kpr from there: `-m` finds it in the working directory (the
                # loader's child) or on PYTHONPATH (the agent runs with -P)
                os.chdir(checkout)
                os.environ["PYTHONPATH"] = str(checkout)
                result = {
                    "services": args.services,
                    "endpoints": args.endpoints,
                    "commit": commit(checkout),
                    "round": round_,
                    "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    **measure_idle(api, args.services, args.idle),
                }
                print(json.dumps(result), flush=True)
                if args.json:
                    results.append(result)
                    args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
