"""A pod's server: tells every TCP and UDP client which pod answered.

TCP: on accept, write ``NAME CLIENT\\n`` (CLIENT: the address the pod sees) and close, without
waiting for input, so a plain ``connect(); recv()`` client learns which backend it reached.
UDP: answer every datagram with ``NAME CLIENT\\n``. One dual-stack socket per protocol serves
both IPv4 and IPv6.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from typing import cast


def _reply(name: str, peer: tuple) -> bytes:
    """NAME and the client address this pod sees (masqueraded or not)."""
    host = peer[0].removeprefix("::ffff:") if peer else "?"
    return f"{name} {host}\n".encode()


class _UdpAnswer(asyncio.DatagramProtocol):
    def __init__(self, name: str) -> None:
        self._name = name
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The selector loop's datagram transport does not subclass DatagramTransport.
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._transport is not None:
            self._transport.sendto(_reply(self._name, addr), addr)


def _dual_stack_socket(kind: socket.SocketKind, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6, kind)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("::", port))
    sock.setblocking(False)
    return sock


async def serve(name: str, port: int) -> None:
    async def answer_tcp(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_reply(name, writer.get_extra_info("peername")))
        try:
            await writer.drain()
        except ConnectionError:
            pass  # the client went away first (e.g. a latency client that resets)
        finally:
            writer.close()

    tcp = _dual_stack_socket(socket.SOCK_STREAM, port)
    tcp.listen(4096)
    server = await asyncio.start_server(answer_tcp, sock=tcp, backlog=4096)
    udp = _dual_stack_socket(socket.SOCK_DGRAM, port)
    await asyncio.get_running_loop().create_datagram_endpoint(lambda: _UdpAnswer(name), sock=udp)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.name, args.port))


if __name__ == "__main__":
    main()
