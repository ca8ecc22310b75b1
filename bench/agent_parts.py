"""What the agent's memory and start-up are made of, part by part:

    python -m bench.agent_parts --services 10000

- the resident memory each of the modules the agent imports adds, in the order it loads
  them (each in a fresh interpreter after the ones before: what it adds to the agent);
- the bytes one record takes (sys.getsizeof, with what it alone holds): a Backend, a
  slice's packed endpoints per endpoint, and the objects they replaced;
- reading and translating N Services of one EndpointSlice × 10 endpoints (the bench's
  objects, bench/scale.py), in microseconds a Service (the best of --repeats): read from
  a list page as the agent's lists are (typed structs), and as its watch events are
  (orjson's dicts, the validating parser), to compare the two.

Nothing runs but this process and its short-lived children.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from ipaddress import IPv4Address

import orjson

from bench.scale import bench_endpoint_slice, bench_service
from kpr.desired.state import DesiredState
from kpr.gcpause import paused_gc
from kpr.model import Backend, Endpoint, Endpoints, NodeContext, address_value
from kpr.sources.objects import parse_endpoint_slice, parse_service
from kpr.sources.wire import (
    decode_service_page,
    decode_slice_page,
    parse_listed_service,
    parse_listed_slice,
)

# as the agent's process imports them (`kpr run` execs kpr.cli.serve, which loads the rest):
# the third-party ones first
MODULES = [
    "ssl",
    "urllib3",
    "yaml",
    "numpy",
    "prometheus_client",
    "kpr.cli.serve",
    "kpr.node.rtnetlink",
    "kpr.agent.loop",
    "kpr.sources.kubernetes",
]
# what the agent's process no longer imports (`kpr run`'s typer execs kpr.cli.serve; kpr's own
# rtnetlink in place of pyroute2): what each would add on top of MODULES
LEFT_OUT = [
    "typer.main, typer._adapters (the command line's framework, pydantic and rich with it)",
    "pyroute2 (in place of kpr.node.rtnetlink)",
]
RSS = "int(open('/proc/self/statm').read().split()[1]) * 4096"


def _rss_mb(modules: list[str]) -> float:
    code = "".join(f"import {m}\n" for m in modules) + f"print({RSS})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout) / 2**20


def module_rss() -> list[tuple[str, float]]:
    """MB of RSS each module adds to those before it."""
    out = [("(the interpreter)", _rss_mb([]))]
    for i, name in enumerate(MODULES):
        out.append((name, _rss_mb(MODULES[: i + 1]) - _rss_mb(MODULES[:i])))
    return out


def left_out_rss() -> list[tuple[str, float]]:
    """MB of RSS each of LEFT_OUT would add to the agent's modules."""
    base = _rss_mb(MODULES)
    return [
        (what, _rss_mb([*MODULES, *what.split(" (")[0].split(", ")]) - base) for what in LEFT_OUT
    ]


def record_bytes() -> dict[str, int]:
    address = IPv4Address("10.244.1.7")
    backend = Backend(address, 8080)
    endpoint = Endpoint(address_value(address), node_name="node-1")
    packed = Endpoints([endpoint] * 10)
    per_endpoint = (
        sys.getsizeof(packed)
        + sum(sys.getsizeof(getattr(packed, f)) for f in ("_ips", "_conditions"))
        + sys.getsizeof(packed._places)
    ) / 10
    return {
        "Backend": sys.getsizeof(backend),
        "an IPv4Address (what a backend held before)": sys.getsizeof(address)
        + sys.getsizeof(int(address)),
        "packed endpoint (a slice of 10, with node names)": round(per_endpoint),
        "Endpoint as read (a tuple, short-lived)": sys.getsizeof(endpoint),
    }


def _list_page(items: list[dict]) -> bytes:
    return orjson.dumps({"kind": "List", "metadata": {"resourceVersion": "1"}, "items": items})


def parse_and_translate(services: int, repeats: int) -> dict[str, float]:
    """Microseconds a Service (with its slice) to read it as the agent does: from a list
    page into structs (kpr/sources/wire.py), or as watch events are read (each object
    decoded into dicts, then the validating parser); and to translate it."""
    base = IPv4Address("10.128.0.0")
    services_page = _list_page(
        [bench_service(f"s{i}", str(IPv4Address("10.96.0.0") + i)) for i in range(services)]
    )
    slices_page = _list_page(
        [
            bench_endpoint_slice(f"s{i}", [str(base + i * 10 + j) for j in range(10)])
            for i in range(services)
        ]
    )
    pages = (services_page, slices_page)
    # each object's JSON on its own, as a watch event's line carries it
    events = [[orjson.dumps(o) for o in orjson.loads(p)["items"]] for p in pages]
    best = dict.fromkeys(("read from a list page", "read as watch events", "translate"), 1e9)
    for _ in range(repeats):
        with paused_gc():  # (as the agent reads its lists)
            began = time.perf_counter()
            listed = (
                [parse_listed_service(s) for s in decode_service_page(services_page)[1]],
                [parse_listed_slice(e) for e in decode_slice_page(slices_page)[1]],
            )
            read_at = time.perf_counter()
            watched = (
                [parse_service(orjson.loads(line)) for line in events[0]],
                [parse_endpoint_slice(orjson.loads(line)) for line in events[1]],
            )
            watched_at = time.perf_counter()
        assert listed == watched  # (the two ways read the same objects)
        DesiredState().update(listed[0], listed[1], NodeContext())
        done = time.perf_counter()
        for name, seconds in (
            ("read from a list page", read_at - began),
            ("read as watch events", watched_at - read_at),
            ("translate", done - watched_at),
        ):
            best[name] = min(best[name], seconds)
    return {name: seconds / services * 1e6 for name, seconds in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("RSS each module adds, MB:")
    for name, mb in module_rss():
        print(f"  {mb:6.1f}  {name}")
    print("RSS what the agent no longer imports would add, MB:")
    for name, mb in left_out_rss():
        print(f"  {mb:6.1f}  {name}")
    print("bytes a record takes:")
    for name, size in record_bytes().items():
        print(f"  {size:6d}  {name}")
    print(f"{args.services} Services × 10 endpoints, microseconds a Service:")
    for name, us in parse_and_translate(args.services, args.repeats).items():
        print(f"  {us:6.1f}  {name}")


if __name__ == "__main__":
    main()
