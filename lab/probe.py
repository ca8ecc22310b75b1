"""Client probes run inside a Lab's node netns and cgroup; each prints one JSON object.

Every socket has a 2 s timeout so a probe never hangs. Errors are reported by errno name
(``ECONNREFUSED``, ``ETIMEDOUT``, ...) rather than raised, so a test can assert on them.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import socket
import sys
import time
from collections import Counter

SOCKET_TIMEOUT_S = 2.0


def family_of(address: str) -> socket.AddressFamily:
    if ipaddress.ip_address(address).version == 6:
        return socket.AF_INET6
    return socket.AF_INET


def format_endpoint(sockaddr: tuple) -> str:
    """``ip:port`` for IPv4, ``[ip]:port`` for IPv6 (sockaddr as socket calls return it)."""
    host, port = sockaddr[0], sockaddr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def errno_name(exc: OSError) -> str:
    # A settimeout() expiry is a TimeoutError without an errno.
    if exc.errno is None:
        return "ETIMEDOUT" if isinstance(exc, TimeoutError) else type(exc).__name__
    return errno.errorcode.get(exc.errno, str(exc.errno))


def _recv_line(sock: socket.socket) -> str:
    chunks = b""
    while b"\n" not in chunks:
        chunk = sock.recv(256)
        if not chunk:
            break
        chunks += chunk
    return chunks.decode().strip()


def _answer(line: str, peer: str) -> dict:
    """A pod server's "NAME CLIENT" line: which pod answered, and who it saw as the client."""
    pod, _, seen = line.partition(" ")
    return {"pod": pod, "peer": peer, "seen": seen}


def tcp_once(address: str, port: int, source: str | None = None) -> dict:
    with socket.socket(family_of(address), socket.SOCK_STREAM) as sock:
        sock.settimeout(SOCKET_TIMEOUT_S)
        try:
            if source:
                sock.bind((source, 0))
            sock.connect((address, port))
            peer = format_endpoint(sock.getpeername())
            pod = _recv_line(sock)
        except OSError as exc:
            return {"error": errno_name(exc)}
    if not pod:
        return {"error": "EMPTY", "peer": peer}
    return _answer(pod, peer)


def udp_connected_once(address: str, port: int, source: str | None = None) -> dict:
    with socket.socket(family_of(address), socket.SOCK_DGRAM) as sock:
        sock.settimeout(SOCKET_TIMEOUT_S)
        try:
            if source:
                sock.bind((source, 0))
            sock.connect((address, port))
            sock.send(b"probe\n")
            pod = sock.recv(256).decode().strip()
            peer = format_endpoint(sock.getpeername())
        except OSError as exc:
            return {"error": errno_name(exc)}
    return _answer(pod, peer)


def udp_unconnected(address: str, port: int, count: int, sockets: int) -> list[dict]:
    results = []
    for index in range(sockets):
        with socket.socket(family_of(address), socket.SOCK_DGRAM) as sock:
            sock.settimeout(SOCKET_TIMEOUT_S)
            for _ in range(count):
                try:
                    sock.sendto(b"probe\n", (address, port))
                    data, source = sock.recvfrom(256)
                    results.append(
                        {
                            "socket": index,
                            "pod": data.decode().split()[0],
                            "source": format_endpoint(source),
                        }
                    )
                except OSError as exc:
                    results.append({"socket": index, "error": errno_name(exc)})
    return results


def loop_tcp(address: str, port: int, duration_s: float) -> dict:
    counts: Counter[str] = Counter()
    errors = []
    start = time.monotonic()
    while (now := time.monotonic()) - start < duration_s:
        result = tcp_once(address, port)
        if "pod" in result:
            counts[result["pod"]] += 1
        else:
            errors.append({"t": round(now - start, 4), "error": result["error"]})
    return {"total": sum(counts.values()) + len(errors), "counts": dict(counts), "errors": errors}


def _udp_connected(address: str, port: int, source_port: int = 0) -> socket.socket:
    """A UDP socket connected to address:port, from `source_port` (0: any)."""
    sock = socket.socket(family_of(address), socket.SOCK_DGRAM)
    try:
        sock.settimeout(0.5)
        if source_port:
            sock.bind(("::" if sock.family == socket.AF_INET6 else "0.0.0.0", source_port))
        sock.connect((address, port))
    except OSError:
        sock.close()
        raise
    return sock


def loop_udp_connected(address: str, port: int, duration_s: float, source_port: int = 0) -> dict:
    """A long-lived connected UDP client, like a DNS resolver's: one socket, used
    until it fails, then a new one (from the same `source_port`, if given). Pods
    answered, in order, and the errors seen."""
    pods: list[str] = []
    errors = []
    start = time.monotonic()
    sock = None
    while (now := time.monotonic()) - start < duration_s:
        try:
            if sock is None:
                sock = _udp_connected(address, port, source_port)
            sock.send(b"probe\n")
            pod = sock.recv(256).decode().split()[0]
            if not pods or pods[-1] != pod:
                pods.append(pod)
        except OSError as exc:
            errors.append({"t": round(now - start, 4), "error": errno_name(exc)})
            if sock is not None:
                sock.close()
            sock = None
        time.sleep(0.02)
    if sock is not None:
        sock.close()
    return {"pods": pods, "errors": errors}


def udp_flow(address: str, port: int, source_port: int, duration_s: float) -> None:
    """One UDP flow that keeps its source port, as a DNS forwarder's or a game client's:
    prints the first answer's pod, waits for a line on stdin (the test changes the
    Service meanwhile), then sends for `duration_s` and prints every answer in order.
    A socket that fails (destroyed by kpr) is replaced by one from the same port."""
    sock = _udp_connected(address, port, source_port)
    first: dict = {"error": "ETIMEDOUT"}
    for _ in range(10):
        try:
            sock.send(b"probe\n")
            first = {"pod": sock.recv(256).decode().split()[0]}
            break
        except OSError as exc:
            first = {"error": errno_name(exc)}
    print(json.dumps(first), flush=True)
    sys.stdin.readline()
    answers: list[str] = []
    start = time.monotonic()
    while time.monotonic() - start < duration_s:
        try:
            if sock is None:
                sock = _udp_connected(address, port, source_port)
            sock.send(b"probe\n")
            answers.append(sock.recv(256).decode().split()[0])
        except OSError as exc:
            answers.append(errno_name(exc))
            if not isinstance(exc, TimeoutError) and sock is not None:
                sock.close()
                sock = None
        time.sleep(0.05)
    print(json.dumps({"answers": answers}), flush=True)


def wait_listening(addresses: list[str], port: int, timeout_s: float) -> dict:
    """Poll until a TCP connect to every address succeeds; used by Lab set-up."""
    pending = list(addresses)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        pending = [address for address in pending if "pod" not in tcp_once(address, port)]
        if pending:
            time.sleep(0.02)
    return {"ready": not pending, "pending": pending}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("tcp", "udp-connected", "udp-unconnected", "loop-tcp", "loop-udp-connected"):
        command = commands.add_parser(name)
        command.add_argument("address")
        command.add_argument("port", type=int)
        if name.startswith("loop-"):
            command.add_argument("--duration", type=float, required=True, help="seconds")
        else:
            command.add_argument("--count", type=int, default=1)
        if name in ("tcp", "udp-connected"):
            command.add_argument("--bind", help="source address (default: the kernel's choice)")
        if name == "udp-unconnected":
            command.add_argument("--sockets", type=int, default=1)
        if name == "loop-udp-connected":
            command.add_argument("--source-port", type=int, default=0)
    flow = commands.add_parser("udp-flow")
    flow.add_argument("address")
    flow.add_argument("port", type=int)
    flow.add_argument("--source-port", type=int, required=True)
    flow.add_argument("--duration", type=float, required=True, help="seconds after stdin")
    wait = commands.add_parser("wait")
    wait.add_argument("port", type=int)
    wait.add_argument("addresses", nargs="+")
    wait.add_argument("--timeout", type=float, default=10.0, help="seconds")
    args = parser.parse_args(argv)

    if args.command == "tcp":
        output: dict = {
            "results": [tcp_once(args.address, args.port, args.bind) for _ in range(args.count)]
        }
    elif args.command == "udp-connected":
        output = {
            "results": [
                udp_connected_once(args.address, args.port, args.bind) for _ in range(args.count)
            ]
        }
    elif args.command == "udp-unconnected":
        output = {"results": udp_unconnected(args.address, args.port, args.count, args.sockets)}
    elif args.command == "loop-udp-connected":
        output = loop_udp_connected(args.address, args.port, args.duration, args.source_port)
    elif args.command == "udp-flow":
        udp_flow(args.address, args.port, args.source_port, args.duration)
        return 0
    elif args.command == "loop-tcp":
        output = loop_tcp(args.address, args.port, args.duration)
    else:
        output = wait_listening(args.addresses, args.port, args.timeout)
    json.dump(output, sys.stdout)
    sys.stdout.write("\n")
    return 1 if output.get("ready") is False else 0


if __name__ == "__main__":
    sys.exit(main())
