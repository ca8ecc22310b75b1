"""helm for the chart's tests, built from the Go module proxy into a cache outside the clone
(helm ships no Debian package or PyPI wheel; its Go module is the one source here)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

HELM_VERSION = "v3.22.0"
CACHE = Path(os.environ.get("KPR_HELM_CACHE", "/var/cache/kpr/helm"))


def _go() -> str | None:
    found = shutil.which("go")
    if found:
        return found
    return "/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None


def helm_binary() -> Path:
    """The cached helm of HELM_VERSION, built on first use (minutes); skips without Go."""
    binary = CACHE / HELM_VERSION / "helm"
    if binary.exists():
        return binary
    go = _go()
    if go is None:
        pytest.skip(f"helm {HELM_VERSION} is built with Go from the module proxy: no Go here")
    env = {
        **os.environ,
        "GOTOOLCHAIN": "local",
        "GOBIN": str(binary.parent),
        "GOMODCACHE": str(CACHE / "mod"),
        "GOCACHE": str(CACHE / "build"),
    }
    out = subprocess.run(
        [go, "install", f"helm.sh/helm/v3/cmd/helm@{HELM_VERSION}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode != 0 or not binary.exists():
        tail = " ".join(out.stderr.split()[-40:])
        pytest.skip(f"building helm {HELM_VERSION} failed (no module proxy?): {tail}")
    return binary


def template(
    chart: Path, *args: str, namespace: str = "kube-system"
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(helm_binary()), "template", "kpr", str(chart), "--namespace", namespace, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
