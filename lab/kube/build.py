"""Build the upstream Kubernetes components, etcd and CoreDNS from their Go modules, or reuse a
cache.

The Go modules that pin the versions live beside this file (upstream/kubernetes, upstream/etcd,
upstream/coredns); their go.mod files are the one place a version is written. Binaries, the
module cache and the build cache live outside the clone, under a directory keyed by the
Kubernetes, etcd, CoreDNS and Go versions, so a second clone (CI's) on the same machine reuses
them and a version bump rebuilds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

UPSTREAM = Path(__file__).resolve().parents[1] / "upstream"
KUBERNETES_MODULE = UPSTREAM / "kubernetes"
ETCD_MODULE = UPSTREAM / "etcd"
COREDNS_MODULE = UPSTREAM / "coredns"
MODULES = (KUBERNETES_MODULE, ETCD_MODULE, COREDNS_MODULE)
MIN_GO = (1, 24)  # Kubernetes 1.34's go.mod says go 1.24.0
DEFAULT_CACHE = Path("/var/cache/kpr/lab")

# Binary name -> Go package; built with `go build` from the module in the same row.
KUBERNETES_COMMANDS = {
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    "kube-proxy": "k8s.io/kubernetes/cmd/kube-proxy",
    "kubelet": "k8s.io/kubernetes/cmd/kubelet",
    "kubectl": "k8s.io/kubernetes/cmd/kubectl",
    "agnhost": "k8s.io/kubernetes/test/images/agnhost",
}
ETCD_COMMANDS = {
    "etcd": "go.etcd.io/etcd/server/v3",
    "etcdctl": "go.etcd.io/etcd/etcdctl/v3",
}
# The cluster DNS (lab.kube.dns), linked as upstream's Makefile links it.
COREDNS_COMMANDS = {"coredns": "github.com/coredns/coredns"}
E2E_PACKAGE = "k8s.io/kubernetes/test/e2e"  # built with `go test -c` as e2e.test
BINARIES = (*KUBERNETES_COMMANDS, *ETCD_COMMANDS, *COREDNS_COMMANDS, "e2e.test")


class GoMissing(Exception):
    """No usable Go toolchain: the lab (and the tests that need it) cannot be built."""


@dataclass(frozen=True)
class Versions:
    kubernetes: str  # "v1.34.4"
    etcd: str  # "v3.6.16"
    coredns: str  # "v1.12.1"
    go: str  # "go1.26.8"

    @property
    def key(self) -> str:
        return f"kubernetes-{self.kubernetes}_etcd-{self.etcd}_coredns-{self.coredns}_{self.go}"


def required_version(go_mod: Path, module: str) -> str:
    """The version `go_mod` requires of `module` (the pin lives in go.mod, nowhere else)."""
    match = re.search(rf"^\s*(?:require\s+)?{re.escape(module)} (v\S+)", go_mod.read_text(), re.M)
    if match is None:
        raise ValueError(f"{go_mod}: no requirement of {module}")
    return match[1]


def kubernetes_version() -> str:
    return required_version(KUBERNETES_MODULE / "go.mod", "k8s.io/kubernetes")


def find_go() -> tuple[str, str]:
    """(path of `go`, its version "go1.26.8"), or GoMissing saying what is wrong."""
    go = shutil.which("go") or next(
        (p for p in ("/usr/local/go/bin/go", "/usr/lib/go/bin/go") if os.access(p, os.X_OK)), None
    )
    if go is None:
        raise GoMissing("no Go toolchain found (needs Go >= 1.24 on PATH or in /usr/local/go)")
    done = subprocess.run(
        [go, "env", "GOVERSION"], capture_output=True, text=True, check=False, env=_go_env({})
    )
    match = re.fullmatch(r"go(\d+)\.(\d+)(\S*)", done.stdout.strip())
    if done.returncode != 0 or match is None:
        raise GoMissing(f"{go} env GOVERSION failed: {done.stderr.strip() or done.stdout!r}")
    if (int(match[1]), int(match[2])) < MIN_GO:
        raise GoMissing(f"{go} is {done.stdout.strip()}; the lab needs Go >= 1.24")
    return go, done.stdout.strip()


def cache_root() -> Path:
    """KPR_LAB_CACHE, else /var/cache/kpr/lab (root), else ~/.cache/kpr/lab."""
    if env := os.environ.get("KPR_LAB_CACHE"):
        return Path(env)
    if os.geteuid() == 0:
        return DEFAULT_CACHE
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kpr" / "lab"


def _sources_digest() -> str:
    # go.mod and go.sum decide what is built: a changed replace or sum must not reuse a cache.
    digest = hashlib.sha256()
    for module in MODULES:
        for name in ("go.mod", "go.sum"):
            digest.update((module / name).read_bytes())
    return digest.hexdigest()[:16]


def _go_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    # Build with the Go that is here (never download a toolchain), static as upstream ships them,
    # from the committed go.sum only.
    env.update(GOTOOLCHAIN="local", CGO_ENABLED="0", GOFLAGS="-mod=readonly -trimpath")
    env.update(extra)
    return env


def _ldflags(version: str) -> str:
    major, minor = version.lstrip("v").split(".")[:2]
    stamp = "k8s.io/component-base/version"
    return (
        f"-s -w -X {stamp}.gitVersion={version} -X {stamp}.gitMajor={major}"
        f" -X {stamp}.gitMinor={minor} -X {stamp}.gitTreeState=clean"
    )


def binaries_dir(versions: Versions, root: Path | None = None) -> Path:
    return (root or cache_root()) / "bin" / versions.key


def is_built(directory: Path) -> bool:
    stamp = directory / ".built"
    return stamp.exists() and stamp.read_text().strip() == _sources_digest()


def versions() -> Versions:
    _, go_version = find_go()
    return Versions(
        kubernetes=kubernetes_version(),
        etcd=required_version(ETCD_MODULE / "go.mod", "go.etcd.io/etcd/server/v3"),
        coredns=required_version(COREDNS_MODULE / "go.mod", "github.com/coredns/coredns"),
        go=go_version,
    )


def cached() -> Path | None:
    """The directory of built binaries if this machine has them already, else None."""
    directory = binaries_dir(versions())
    return directory if is_built(directory) else None


def kubernetes_source() -> Path:
    """The k8s.io/kubernetes module source the lab builds from (downloaded into the lab's module
    cache if the build has not put it there yet): its manifests name the e2e images."""
    go, _ = find_go()
    root = cache_root()
    env = _go_env({"GOMODCACHE": str(root / "go" / "mod"), "GOCACHE": str(root / "go" / "build")})
    module = f"k8s.io/kubernetes@{kubernetes_version()}"
    done = subprocess.run(
        [go, "mod", "download", "-json", module],
        cwd=KUBERNETES_MODULE,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"go mod download {module} failed: {done.stderr.strip() or done.stdout}")
    return Path(json.loads(done.stdout)["Dir"])


def build(log=sys.stderr) -> Path:
    """Build every binary (or reuse the cache); return the directory that holds them."""
    go, _ = find_go()
    found = versions()
    root = cache_root()
    target = binaries_dir(found, root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time per cache; the second reuses it
        if is_built(target):
            print(f"lab.kube: reusing {target}", file=log)
            return target
        env = _go_env(
            {
                "GOMODCACHE": str(root / "go" / "mod"),
                "GOCACHE": str(root / "go" / "build"),
            }
        )
        staging = target.with_name(f".{target.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        ldflags = _ldflags(found.kubernetes)
        steps = [
            *(
                (ETCD_MODULE, ["build", "-o", str(staging / name), package])
                for name, package in ETCD_COMMANDS.items()
            ),
            *(
                (COREDNS_MODULE, ["build", "-ldflags", "-s -w", "-o", str(staging / name), package])
                for name, package in COREDNS_COMMANDS.items()
            ),
            (
                KUBERNETES_MODULE,
                ["build", "-ldflags", ldflags, "-o", f"{staging}/", *KUBERNETES_COMMANDS.values()],
            ),
            (
                KUBERNETES_MODULE,
                ["test", "-c", "-ldflags", ldflags, "-o", str(staging / "e2e.test"), E2E_PACKAGE],
            ),
        ]
        started = time.monotonic()
        for module, args in steps:
            step_start = time.monotonic()
            print(f"lab.kube: (cd {module.name} && go {' '.join(args)})", file=log, flush=True)
            done = subprocess.run([go, *args], cwd=module, env=env, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"go {args[0]} in {module} failed ({done.returncode})")
            print(f"lab.kube:   {time.monotonic() - step_start:.0f} s", file=log, flush=True)
        missing = [name for name in BINARIES if not (staging / name).exists()]
        if missing:
            raise RuntimeError(f"build finished without {', '.join(missing)} in {staging}")
        (staging / ".built").write_text(_sources_digest() + "\n")
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(target)
        staging.rename(target)
        print(f"lab.kube: built in {time.monotonic() - started:.0f} s", file=log)
        return target
