"""The client that times an API-fed mode's endpoint change, run in the lab (node netns, the
lab's cgroup) as ``python -m bench.modes.change_client ADDRESS PORT TIMEOUT``, and the
bench's handle on it (ChangeClient)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

from bench.config import CHANGE_VIP
from bench.lab import BenchLab


def client_main(address: str, port: int, timeout: float) -> int:
    """Read a pod index a line; connect (1-byte request, the pod answers its index) until that
    pod answers, and print when (wall clock), or that it never did within ``timeout``."""
    for line in sys.stdin:
        want = int(line)
        deadline = time.monotonic() + timeout
        outcome: dict = {"ok": False}
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((address, port), timeout=1.0) as sock:
                    sock.sendall(b"q")
                    answer = sock.recv(1)
                if answer and answer[0] == want:
                    outcome = {"ok": True, "t": time.time()}
                    break
            except OSError:
                pass
            time.sleep(0.001)  # a millisecond's resolution, and a core left to the proxy
        print(json.dumps(outcome), flush=True)
    return 0


class ChangeClient:
    """client_main in the lab, asked for a pod: when that pod answered CHANGE_VIP:81."""

    def __init__(self, bl: BenchLab, timeout: float) -> None:
        argv = [
            sys.executable,
            "-m",
            "bench.modes.change_client",
            CHANGE_VIP,
            "81",
            str(timeout),
        ]
        self.process = bl.lab.popen_client(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def wait_for(self, pod: int) -> dict:
        assert self.process.stdin and self.process.stdout
        self.process.stdin.write(f"{pod}\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def main(argv: list[str]) -> int:
    if len(argv) == 3:
        return client_main(argv[0], int(argv[1]), float(argv[2]))
    print("usage: python -m bench.modes.change_client ADDRESS PORT TIMEOUT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main(sys.argv[1:]))
