"""The plot of `kpr bench --plot` and docs/benchmarks.md: every figure against the number of
Services, a line per mode (matplotlib: the `lab` extra)."""

from __future__ import annotations

from pathlib import Path

MODE_COLORS = {"direct": "black", "iptables": "tab:orange", "iptables-legacy": "tab:brown",
               "nftables": "tab:purple", "kpr": "tab:green", "kube-proxy-iptables": "tab:red",
               "kube-proxy-nftables": "tab:blue", "kpr-api": "tab:olive"}  # fmt: skip
# title, keys (first found; a second one dotted), scale, log y
PLOT_PANELS = (
    ("connect p50, µs", ("connect_p50_us",), 1, True),
    ("connect p99, µs", ("connect_p99_us",), 1, True),
    ("connections/s (1-byte request/answer)", ("rr_per_s",), 1, False),
    ("one stream, Gbit/s", ("stream_gbit_s",), 1, False),
    ("full programming, s", ("program_s",), 1, True),
    ("one endpoint change, s (p50; p99 dotted)", ("change_s", "change_p99_s"), 1, True),
    ("change during churn, p99 s", ("churn_p99_s",), 1, True),
    ("proxy CPU during churn, % of a core", ("churn_cpu",), 100, False),
    ("proxy CPU idle, % of a core", ("idle_cpu",), 100, False),
    ("memory, MB", ("agent_rss_mb", "restore_peak_rss_mb", "proxy_rss_mb"), 1, True),
)


def write_plot(report: dict, path: Path) -> None:
    """Every figure against the number of Services, a line per mode."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    by_mode: dict[str, list[tuple[int, dict]]] = {}
    for entry in report["results"]:
        if entry["summary"]:
            by_mode.setdefault(entry["mode"], []).append((entry["services"], entry["summary"]))
    sizes = sorted({n for points in by_mode.values() for n, _ in points})
    fig, axes = plt.subplots(2, 5, figsize=(22, 8.5))
    for ax, (title, keys, scale, log_y) in zip(axes.flat, PLOT_PANELS, strict=True):
        for mode, points in sorted(by_mode.items()):
            points.sort(key=lambda p: p[0])
            styles = ("-", ":") if keys[0] == "change_s" else ("-",) * len(keys)
            for key, style in zip(keys, styles, strict=False):
                xy = [(n, s[key] * scale) for n, s in points if s.get(key) is not None]
                if not xy:
                    continue
                label = mode if style == "-" else None
                ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", linestyle=style,
                        color=MODE_COLORS.get(mode), label=label)  # fmt: skip
                if keys[0] != "change_s":
                    break  # the first key a mode has
        ax.set(xscale="log", title=title, xlabel="services")
        if log_y:
            ax.set_yscale("log")
        if sizes:
            ax.set_xticks(sizes)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:,.0f}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.title.set_fontsize(9)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in axes.flat[1:]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    endpoints = report["config"]["endpoints"]
    fig.suptitle(f"kpr bench, {endpoints} endpoints per Service, on "
                 f"{report['machine']['cpu'] or 'this machine'}", fontsize=10)  # fmt: skip
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
