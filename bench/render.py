"""The report as text: the table `kpr bench` prints (the generated-rules modes, then the
API-fed ones), and the Markdown tables of docs/benchmarks.md."""

from __future__ import annotations

import re

from bench.config import API_MODES


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(value: float | None, higher_is_better: bool, color: bool) -> str:
    if value is None:
        return ""
    text = f"×{value:.2f}"
    if not color:
        return text
    worse = value < 0.95 if higher_is_better else value > 1.05
    return f"\033[1;{31 if worse else 32}m{text}\033[0m"


def render_table(report: dict, color: bool = False) -> str:
    header = (
        f"{'services':>8}  {'mode':<16}{'connect p50 µs':>22}{'p99 µs':>20}"
        f"{'conn/s':>20}{'stream Gbit/s':>20}{'program s':>11}{'change ms':>11}"
        f"{'memory MB':>11}"
    )
    lines = [header, "-" * len(header)]
    for entry in report["results"]:
        if entry["mode"] in API_MODES:
            continue
        prefix = f"{entry['services']:>8}  {entry['mode']:<16}"
        if entry["skipped"]:
            lines.append(prefix + f"skipped: {entry['skipped']}")
            continue
        s = entry["summary"]
        if not s:
            lines.append(prefix + "no samples")
            continue
        is_direct = entry["mode"] == "direct"

        def cell(
            key: str, higher: bool, width: int, digits: int = 1, s: dict = s, d: bool = is_direct
        ) -> str:
            r = "" if d else _ratio(s.get(f"{key}_ratio"), higher, color)
            text = f"{_fmt(s.get(key), digits)} {r}".rstrip()
            pad = width + (len(text) - len(_strip_ansi(text)))
            return f"{text:>{pad}}"

        memory = s.get("agent_rss_mb") or s.get("restore_peak_rss_mb")
        change = s.get("change_s")
        lines.append(
            prefix
            + cell("connect_p50_us", False, 22)
            + cell("connect_p99_us", False, 20)
            + cell("rr_per_s", True, 20, 0)
            + cell("stream_gbit_s", True, 20, 2)
            + f"{_fmt(s.get('program_s'), 3):>11}"
            + f"{_fmt(change * 1000 if change is not None else None, 1):>11}"
            + f"{_fmt(memory, 0):>11}"
        )
    lines.append(
        "×: median of per-round ratios to direct in the same lab (lower is better for latency, "
        "higher for conn/s and Gbit/s): for kpr, direct alternates with it in the same run, "
        "from a cgroup without its programs; for the NAT modes, direct is measured just before "
        "their rules are loaded. memory: kpr's agent RSS when synced; iptables/nft: "
        "peak RSS of the restore process."
    )
    if any(e["mode"] in API_MODES for e in report["results"]):
        lines += ["", render_api_table(report)]
    return "\n".join(lines)


# name, key, scale, digits, higher is better
API_COLUMNS = (
    ("connect p50 µs", "connect_p50_us", 1, 1, False),
    ("p99 µs", "connect_p99_us", 1, 0, False),
    ("conn/s", "rr_per_s", 1, 0, True),
    ("stream Gbit/s", "stream_gbit_s", 1, 1, True),
    ("full program s", "program_s", 1, 2, False),
    ("proxy's sync s", "proxy_first_sync_s", 1, 2, False),
    ("change p50 ms", "change_s", 1000, 0, False),
    ("change p99 ms", "change_p99_s", 1000, 0, False),
    ("churn p99 ms", "churn_p99_s", 1000, 0, False),
    ("churn CPU %", "churn_cpu", 100, 1, False),
    ("idle CPU %", "idle_cpu", 100, 2, False),
    ("RSS MB", "proxy_rss_mb", 1, 0, False),
)
RATIO_COLUMNS = {"connect_p50_us", "connect_p99_us", "rr_per_s", "stream_gbit_s"}


def api_rows(report: dict) -> list[tuple[dict, list[tuple[str, bool]]]]:
    """The API-fed modes' rows (with direct at each size): per entry, its cells as (text,
    wins), where a cell wins when it is the best of its column at that size (ratios to direct
    for the datapath columns: their absolute values come from different moments)."""
    entries = [e for e in report["results"] if e["mode"] in API_MODES or e["mode"] == "direct"]
    best: dict[tuple[int, str], float] = {}
    for e in entries:
        s = e["summary"]
        if e["mode"] == "direct" or not s or s.get("not_measured"):
            continue
        for _name, key, _scale, _digits, higher in API_COLUMNS:
            rank = s.get(f"{key}_ratio") if key in RATIO_COLUMNS else s.get(key)
            if rank is None:
                continue
            old = best.get((e["services"], key))
            if old is None or (rank > old if higher else rank < old):
                best[(e["services"], key)] = rank
    rows = []
    for e in entries:
        s = e["summary"] or {}
        cells = []
        for _name, key, scale, digits, _higher in API_COLUMNS:
            value = s.get(key)
            text = _fmt(value * scale if value is not None else None, digits)
            ratio = s.get(f"{key}_ratio")
            if key in RATIO_COLUMNS and ratio is not None and e["mode"] != "direct":
                text += f" ×{ratio:.2f}"
            if key == "program_s" and s.get("program_timed_out"):
                text = f"> {text} (limit)"
            rank = ratio if key in RATIO_COLUMNS else value
            wins = (
                e["mode"] != "direct"
                and rank is not None
                and best.get((e["services"], key)) == rank
            )
            cells.append((text, wins))
        rows.append((e, cells))
    return rows


def render_api_table(report: dict) -> str:
    """The API-fed modes as text; * marks the best of a column at each size."""
    widths = [max(len(name), 12) + 2 for name, *_ in API_COLUMNS]
    header = f"{'services':>8}  {'mode':<21}" + "".join(
        f"{name:>{w}}" for (name, *_), w in zip(API_COLUMNS, widths, strict=True)
    )
    lines = ["Fed by a real API server:", header, "-" * len(header)]
    for e, cells in api_rows(report):
        prefix = f"{e['services']:>8}  {e['mode']:<21}"
        if e["skipped"]:
            lines.append(prefix + f"skipped: {e['skipped']}")
            continue
        lines.append(prefix + "".join(
            f"{text + ('*' if wins else ' '):>{w}}"
            for (text, wins), w in zip(cells, widths, strict=True)
        ))  # fmt: skip
    lines.append(
        "full program: proxy start, every object already in the API -> sampled Services answer "
        "(every one then checked); proxy's sync: its first kubeproxy_sync_proxy_rules_duration"
        "_seconds; change: API write -> first connection answered by the new endpoint; churn: "
        "the same during the churn, CPU of the proxy (and the children it waited for) meanwhile;"
        " * best of the column at that size."
    )
    return "\n".join(lines)


def render_api_markdown(report: dict) -> str:
    """The API-fed modes as a Markdown table, each column's best in bold."""
    names = ["services", "mode", *(name for name, *_ in API_COLUMNS)]
    lines = ["| " + " | ".join(names) + " |", "|---:|---|" + "---:|" * len(API_COLUMNS)]
    for e, cells in api_rows(report):
        if e["skipped"]:
            lines.append(f"| {e['services']:,} | {e['mode']} | skipped: {e['skipped']} |")
            continue
        texts = [f"**{text}**" if wins else text for text, wins in cells]
        lines.append(f"| {e['services']:,} | {e['mode']} | " + " | ".join(texts) + " |")
    return "\n".join(lines)


def _strip_ansi(text: str) -> str:
    return re.sub(r"\033\[[0-9;]*m", "", text)


def side_by_side_markdown(report: dict) -> str:
    """Each generated-rules mode beside the real proxy it stands for, at each size: what the
    two programmings and one endpoint change cost."""
    pairs = (("iptables", "kube-proxy-iptables"), ("nftables", "kube-proxy-nftables"),
             ("kpr", "kpr-api"))  # fmt: skip
    found = {(e["services"], e["mode"]): e["summary"] for e in report["results"] if e["summary"]}
    lines = [
        "| services | generated | real | full program s (generated / real) "
        "| 1 endpoint change ms (generated / real p50) | connect p50 × (generated / real) |",
        "|---:|---|---|---:|---:|---:|",
    ]

    def cell(a: dict, b: dict, key: str, scale: float, digits: int) -> str:
        return " / ".join(_fmt(s[key] * scale, digits) if s.get(key) is not None else "-"
                          for s in (a, b))  # fmt: skip

    for size in sorted({n for n, _ in found}):
        for generated, real in pairs:
            a, b = found.get((size, generated)), found.get((size, real))
            if a is None or b is None:
                continue
            lines.append(
                f"| {size:,} | {generated} | {real} | {cell(a, b, 'program_s', 1, 2)} "
                f"| {cell(a, b, 'change_s', 1000, 1)} "
                f"| {cell(a, b, 'connect_p50_us_ratio', 1, 2)} |"
            )
    return "\n".join(lines)
