"""The bench's entry points: `kpr bench` (kpr.cli parses the options, main runs it, prints the
table, writes the JSON and the plot), and ``python -m bench.run markdown|plot``, the tables
and the plot of docs/benchmarks.md from earlier runs' JSON."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from bench.config import BenchConfig, BenchError
from bench.plot import write_plot
from bench.render import render_api_markdown, render_table, side_by_side_markdown
from bench.report import merged
from bench.rounds import run_bench


def parse_list(text: str, what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise BenchError(f"--{what}: empty")
    return items


def config_from_options(
    services: str,
    endpoints: int,
    modes: str,
    json_path: Path | None,
    plot_path: Path | None,
    connections: int,
    rounds: int,
    stream_mb: int,
    **api: float,
) -> BenchConfig:
    try:
        sizes = [int(item) for item in parse_list(services, "services")]
    except ValueError as err:
        raise BenchError(f"--services: not a list of numbers: {services!r}") from err
    cfg = BenchConfig(sizes, endpoints, parse_list(modes, "modes"), connections, rounds,
                      stream_mb, json_path, plot_path, **api)  # fmt: skip
    cfg.validate()
    return cfg


def main(cfg: BenchConfig) -> int:
    """Run, print the table, write JSON and plot; the CLI's `kpr bench`."""
    started = time.monotonic()
    with _interrupt_as_exception():
        report = run_bench(cfg, out=lambda line: print(line, file=sys.stderr, flush=True))
    report["seconds"] = time.monotonic() - started
    print(render_table(report, color=sys.stdout.isatty()))
    if cfg.json_path:
        cfg.json_path.write_text(json.dumps(report, indent=1))
    if cfg.plot_path:
        write_plot(report, cfg.plot_path)
    return 0


@contextlib.contextmanager
def _interrupt_as_exception() -> Iterator[None]:
    # SIGTERM as SystemExit too, so every `finally` above (labs, pins, cgroup) runs
    previous = signal.getsignal(signal.SIGTERM)

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


USAGE = """usage: python -m bench.run markdown RESULTS.json...
       python -m bench.run plot OUT.png RESULTS.json...
the tables and the plot of docs/benchmarks.md, from one or more `kpr bench --json` runs"""

if __name__ == "__main__":
    if sys.argv[1:2] == ["markdown"] and len(sys.argv) > 2:
        loaded = merged([Path(a) for a in sys.argv[2:]])
        print(render_api_markdown(loaded), end="\n\n")
        print(side_by_side_markdown(loaded))
    elif sys.argv[1:2] == ["plot"] and len(sys.argv) > 3:
        write_plot(merged([Path(a) for a in sys.argv[3:]]), Path(sys.argv[2]))
    else:
        sys.exit(USAGE)
