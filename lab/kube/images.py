"""Container images for the lab's real nodes, built with no registry.

python -m lab.kube.images build [--only NAME ...]

The nodes' containerd pulls nothing: every image a lab pod or an e2e test names is built here and
imported with `ctr images import`. All are built with buildah (no Docker engine, no daemon): the
e2e images from a Containerfile in containerfiles/NAME/ beside this module, kpr from
deploy/Dockerfile as a user builds it (deploy/build-image.sh). The Debian-based ones start FROM
docker.io/library/debian:bookworm-slim, which no registry serves here: it is made from Debian's
packages with debootstrap, from the mirror this machine's apt uses. Names and tags are the e2e
framework's (test/utils/image/manifest.go of the Kubernetes version the lab pins); kube-proxy's
is kubeadm's (registry.k8s.io/kube-proxy:v<the lab's version>), the lab's own kube-proxy binary.

Archives (OCI) live under CACHE/images/archives, named by a digest of what goes into them
(Containerfile, context files, base image recipe), so an unchanged image is reused and a changed
one rebuilt. buildah's own storage is there too, and every buildah command runs in a mount
namespace of its own, so no mount outlives a build.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from lab.kube import build, dns

CONTAINERFILES = Path(__file__).resolve().parent / "containerfiles"
REPO = Path(__file__).resolve().parents[2]
BUILD_IMAGE = REPO / "deploy" / "build-image.sh"
KPR_IMAGE = "localhost/kpr:0.1.0"  # deploy/Dockerfile's own example tag
DEBIAN_BASE = "docker.io/library/debian:bookworm-slim"
SUITE = "bookworm"
# What deploy/Dockerfile copies (and .dockerignore trims): the kpr image's cache key.
KPR_CONTEXT = (
    ".dockerignore",
    "deploy/Dockerfile",
    "deploy/kernel-headers.sh",
    "pyproject.toml",
    "README.md",
    "kpr",
    "bpf",
)
IGNORED = ("__pycache__",)  # as .dockerignore says
# Short name -> ImageID in manifest.go, in the order they are built.
E2E_IMAGES = {
    "pause": "Pause",
    "agnhost": "Agnhost",
    "busybox": "BusyBox",
    "httpd": "Httpd",
    "nginx": "Nginx",
    "jessie-dnsutils": "JessieDnsutils",
}
# kubeadm's kube-proxy DaemonSet image (lab.kube.kube_proxy), tagged with the lab's version.
KUBE_PROXY_REPOSITORY = "registry.k8s.io/kube-proxy"
NAMES = (*E2E_IMAGES, "coredns", "kube-proxy", "kpr")  # coredns: the cluster DNS (lab.kube.dns)
# Debian packages the builds run (the command each provides, to see whether it is there).
TOOLS = {
    "buildah": "buildah",
    "debootstrap": "debootstrap",
    "gcc": "gcc",
    "/usr/lib/x86_64-linux-gnu/libc.a": "libc6-dev",  # for `gcc -static`
}
KEEP_ARCHIVES = 3  # per image
BUSYBOX = Path("/bin/busybox")  # busybox-static's (the busybox package's is dynamic)


class InputsMissing(Exception):
    """Something an image is made of is not on this machine (the lab's agnhost binary)."""


def images_root() -> Path:
    return build.cache_root() / "images"


def archives_dir() -> Path:
    return images_root() / "archives"


def e2e_references(kubernetes_source: Path) -> dict[str, str]:
    """Short name -> the reference the e2e framework uses ("registry.k8s.io/pause:3.10.1")."""
    text = (kubernetes_source / "test" / "utils" / "image" / "manifest.go").read_text()
    registries = dict(re.findall(r'^\s*(\w+Registry):\s*"([^"]+)"', text, re.M))
    configs = {
        image_id: (registries[registry], name, tag)
        for image_id, registry, name, tag in re.findall(
            r'configs\[(\w+)\] = Config\{list\.(\w+), "([^"]+)", "([^"]+)"\}', text
        )
    }
    references = {}
    for short, image_id in E2E_IMAGES.items():
        if image_id not in configs:
            raise ValueError(f"{kubernetes_source}: manifest.go names no image {image_id}")
        registry, name, tag = configs[image_id]
        references[short] = f"{registry}/{name}:{tag}"
    return references


def kube_proxy_image() -> str:
    return f"{KUBE_PROXY_REPOSITORY}:{build.kubernetes_version()}"  # "v1.34.4"


def build_images(names: Iterable[str] | None = None, log=sys.stderr) -> dict[str, Path]:
    """Build the named images (default all of NAMES) or reuse them; reference -> OCI archive."""
    wanted = list(NAMES if names is None else names)
    unknown = sorted(set(wanted) - set(NAMES))
    if unknown:
        raise ValueError(f"unknown images {unknown}; known: {', '.join(NAMES)}")
    if os.geteuid() != 0:
        raise InputsMissing("building the lab's images needs root (buildah, debootstrap)")
    _require_packages(TOOLS)
    root = images_root()
    archives_dir().mkdir(parents=True, exist_ok=True)
    references = {
        "kpr": KPR_IMAGE,
        "coredns": dns.image_reference(),
        "kube-proxy": kube_proxy_image(),
    }
    kubernetes_source = None
    if set(wanted) - {"kpr", "kube-proxy"}:
        kubernetes_source = build.kubernetes_source()
        references |= e2e_references(kubernetes_source)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per cache; the second reuses its archives
        with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as scratch:
            builder = _Builder(root, Path(scratch), kubernetes_source, log)
            built = {
                references[name]: builder.image(name, references[name])
                for name in NAMES
                if name in wanted
            }
            if builder.built_any:
                # The replaced images' layers (the cache's parents of current ones stay).
                builder.buildah_private(["buildah", "rmi", "--prune"], check=False)
            return built


def build_kpr_image(tree: Path, reference: str, log=sys.stderr) -> Path:
    """kpr's image from another source tree (an older commit's, for upgrade tests), built as
    this tree builds its own: deploy/build-image.sh is copied into it (older trees had none).
    Its archives are "kpr-from-tree-*" (not counted among the three kept of this tree's kpr)."""
    if os.geteuid() != 0:
        raise InputsMissing("building the lab's images needs root (buildah, debootstrap)")
    _require_packages(TOOLS)
    shutil.copy2(BUILD_IMAGE, tree / "deploy" / "build-image.sh")
    root = images_root()
    archives_dir().mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as scratch:
            builder = _Builder(root, Path(scratch), None, log)
            return builder.image("kpr-from-tree", reference, kpr_tree=tree)


def import_images(ctr_address: str, archives: list[Path]) -> None:
    """Import OCI archives into containerd's k8s.io namespace (the kubelet's), names kept."""
    _require_packages({"ctr": "containerd"})
    for archive in archives:
        _run(
            [
                "ctr",
                "--address",
                ctr_address,
                "-n",
                "k8s.io",
                "images",
                "import",
                "--all-platforms",
                str(archive),
            ]
        )


class _Builder:
    """One build_images() call: a private buildah run root, the base image built at most once."""

    def __init__(self, root: Path, scratch: Path, kubernetes_source: Path | None, log) -> None:
        self.root = root
        self.scratch = scratch
        self.kubernetes_source = kubernetes_source  # None when only kpr is built
        self.log = log
        self.base_ready = False
        self.built_any = False
        storage_conf = scratch / "storage.conf"
        # Images and layers persist under the cache; the run root (mount and lock state) is
        # per build, as a tmpfs is per boot: no mount is left once a build's namespace is gone.
        storage_conf.write_text(
            "[storage]\n"
            'driver = "overlay"\n'
            f'graphroot = "{root / "storage"}"\n'
            f'runroot = "{scratch / "run"}"\n'
        )
        self.env = dict(os.environ, CONTAINERS_STORAGE_CONF=str(storage_conf))

    def image(self, name: str, reference: str, kpr_tree: Path = REPO) -> Path:
        """`name`'s image (kpr's from `kpr_tree`); its archive is NAME-KEY.tar."""
        if name.startswith("kpr"):
            context, containerfile = kpr_tree, kpr_tree / "deploy" / "Dockerfile"
            digest = _tree_digest(kpr_tree, [*KPR_CONTEXT, "deploy/build-image.sh"])
        else:
            context = self.scratch / name
            containerfile = context / "Containerfile"
            self._prepare_context(name, reference, context)
            digest = _tree_digest(context, sorted(p.name for p in context.iterdir()))
        from_base = _from_image(containerfile) == DEBIAN_BASE
        key = _digest(reference, digest, _base_key() if from_base else "")
        archive = archives_dir() / f"{name}-{key[:16]}.tar"
        if archive.exists():
            print(f"lab.kube.images: reusing {reference} ({archive})", file=self.log)
            os.utime(archive)  # recently used: kept (see below)
            return archive
        if from_base:
            self._ensure_base()
        started = time.monotonic()
        partial = archive.with_name(f".{archive.name}.partial")
        partial.unlink(missing_ok=True)
        print(f"lab.kube.images: building {reference}", file=self.log, flush=True)
        if name.startswith("kpr"):
            script = kpr_tree / "deploy" / "build-image.sh"
            self.buildah_private(
                ["sh", str(script), reference, str(partial), *self._bud_options()]
                + self._pip_trust()
            )
        else:
            self.buildah_private(
                [
                    "buildah",
                    "bud",
                    "--layers",
                    *self._bud_options(),
                    "-f",
                    str(containerfile),
                    "-t",
                    reference,
                    str(context),
                ]
            )
            self.buildah_private(
                ["buildah", "push", reference, f"oci-archive:{partial}:{reference}"]
            )
        partial.rename(archive)
        self.built_any = True
        # Other clones (CI's) may build other sources: keep the ones used most recently.
        used = sorted(archives_dir().glob(f"{name}-*.tar"), key=lambda p: p.stat().st_mtime)
        for stale in used[:-KEEP_ARCHIVES]:
            stale.unlink()
        elapsed = time.monotonic() - started
        print(f"lab.kube.images:   {reference} in {elapsed:.0f} s", file=self.log, flush=True)
        return archive

    def _bud_options(self) -> list[str]:
        # No registry: FROM names only images in the local store. chroot isolation runs RUN
        # steps on the host's network (apt and pip reach their mirrors) and needs no runc setup.
        # --force-rm: a failed build leaves no container in the store.
        return ["--pull=never", "--force-rm", "--isolation", "chroot", "--network", "host"]

    def _pip_trust(self) -> list[str]:
        """pip inside the build trusts this machine's CA bundle, mounted for the build only.

        The image's own bundle (Debian's ca-certificates) is what a user's build has; a network
        that intercepts TLS (this project's machines' does) needs the host's. An overlay over
        /root (which the base image has) holding pip's user config leaves no file in any layer.
        """
        bundle = Path("/etc/ssl/certs/ca-certificates.crt")
        if not bundle.exists():
            return []
        home = self.scratch / "pip-home"
        config = home / ".config" / "pip"
        config.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(bundle, config / "ca-certificates.crt")
        (config / "pip.conf").write_text("[global]\ncert = /root/.config/pip/ca-certificates.crt\n")
        return ["-v", f"{home}:/root:O"]

    def _prepare_context(self, name: str, reference: str, context: Path) -> None:
        shutil.copytree(CONTAINERFILES / name, context)
        if name == "pause":
            assert self.kubernetes_source is not None
            source = self.kubernetes_source / "build" / "pause" / "linux" / "pause.c"
            version = "v" + reference.rsplit(":", 1)[1]
            # build/pause/Makefile's flags; the version names this build, not a git revision.
            _run(
                [
                    "gcc",
                    "-Os",
                    "-Wall",
                    "-Werror",
                    "-static",
                    f"-DVERSION={version}-kpr-lab",
                    "-o",
                    str(context / "pause"),
                    str(source),
                ]
            )
            _run(["strip", str(context / "pause")])
            _require_static(context / "pause")
        elif name == "busybox":
            _require_packages({"busybox-static": "busybox-static"}, installed_only=True)
            shutil.copy2(BUSYBOX, context / "busybox")
            _require_static(context / "busybox")
        elif name in ("agnhost", "kube-proxy"):
            binaries = build.cached()
            if binaries is None:
                raise InputsMissing(
                    f"the lab's {name} is not built: run `python -m lab.kube build` first"
                )
            shutil.copy2(binaries / name, context / name)
        if name == "agnhost":
            _require_static(context / "agnhost")
            assert self.kubernetes_source is not None
            porter = self.kubernetes_source / "test" / "images" / "agnhost" / "porter"
            for key in ("localhost.crt", "localhost.key"):
                shutil.copyfile(porter / key, context / key)
        elif name == "coredns":
            binaries = build.cached()
            if binaries is None:
                raise InputsMissing(
                    "the lab's coredns is not built: run `python -m lab.kube build` first"
                )
            shutil.copy2(binaries / "coredns", context / "coredns")
            _require_static(context / "coredns")

    def _ensure_base(self) -> None:
        """docker.io/library/debian:bookworm-slim in buildah's store, made with debootstrap."""
        if self.base_ready:
            return
        stamp = self.root / "storage" / "debian-base.key"
        present = self.buildah_private(
            ["buildah", "inspect", "--type", "image", DEBIAN_BASE], check=False
        )
        if present and stamp.exists() and stamp.read_text() == _base_key():
            self.base_ready = True
            return
        started = time.monotonic()
        print(f"lab.kube.images: building {DEBIAN_BASE} (debootstrap)", file=self.log)
        rootfs = self.scratch / "rootfs"
        mirror, _ = _debian_mirrors()
        # In a mount namespace of its own too: what it mounts in the rootfs goes with it.
        self.buildah_private(["debootstrap", "--variant=minbase", SUITE, str(rootfs), mirror])
        _slim(rootfs)
        self.buildah_private(
            [
                "sh",
                "-euc",
                'c=$(buildah from scratch); buildah copy --quiet "$c" "$1/" /; '
                'buildah config --env "PATH=$3" --cmd bash "$c"; '
                'buildah commit --quiet --rm "$c" "$2"',
                "sh",
                str(rootfs),
                DEBIAN_BASE,
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",  # Docker's debian
            ]
        )
        shutil.rmtree(rootfs)
        stamp.write_text(_base_key())
        self.base_ready = True
        elapsed = time.monotonic() - started
        print(f"lab.kube.images:   {DEBIAN_BASE} in {elapsed:.0f} s", file=self.log)

    def buildah_private(self, argv: list[str], check: bool = True) -> bool:
        # A mount namespace of its own: buildah's overlay mounts (even the one its storage
        # driver makes at start) end with the command.
        argv = ["unshare", "--mount", "--propagation", "private", *argv]
        if check:
            _run(argv, env=self.env)
            return True
        done = subprocess.run(argv, env=self.env, capture_output=True, check=False)
        return done.returncode == 0


def _debian_mirrors() -> tuple[str, str]:
    """(main archive, security archive) URIs this machine's apt uses, else Debian's defaults."""
    main, security = "http://deb.debian.org/debian", "http://deb.debian.org/debian-security"
    sources = Path("/etc/apt/sources.list.d")
    for path in sorted(sources.glob("*.sources")) if sources.is_dir() else []:
        for stanza in path.read_text().split("\n\n"):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
            uri, suites = fields.get("URIs", "").split(), fields.get("Suites", "").split()
            if uri and SUITE in suites:
                main = uri[0]
            elif uri and f"{SUITE}-security" in suites:
                security = uri[0]
    return main, security


# debian:bookworm-slim's own trimming (debuerreotype's): no docs, man pages or translations,
# apt caches cleaned after each install.
_DPKG_EXCLUDES = """\
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
"""
_APT_CACHES = (
    "/var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin"
)
_APT_CLEAN = (
    f'DPkg::Post-Invoke {{ "rm -f {_APT_CACHES} || true"; }};\n'
    f'APT::Update::Post-Invoke {{ "rm -f {_APT_CACHES} || true"; }};\n'
    'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\nAcquire::Languages "none";\n'
)


def _debian_sources() -> str:
    main, security = _debian_mirrors()
    keyring = "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"
    return (
        f"Types: deb\nURIs: {main}\nSuites: {SUITE} {SUITE}-updates\nComponents: main\n{keyring}\n"
        f"\nTypes: deb\nURIs: {security}\nSuites: {SUITE}-security\nComponents: main\n{keyring}\n"
    )


def _base_key() -> str:
    return _digest(SUITE, "minbase", _debian_sources(), _DPKG_EXCLUDES, _APT_CLEAN)


def _slim(rootfs: Path) -> None:
    for directory in ("usr/share/man", "usr/share/groff", "usr/share/info", "usr/share/locale"):
        for path in (rootfs / directory).glob("*"):
            _remove(path)
    for path in (rootfs / "usr/share/doc").glob("*/*"):
        if path.name != "copyright":
            _remove(path)
    # The runtime provides /dev, the hostname and DNS; apt's lists and debs are the build's.
    for pattern in (
        "dev/*",
        "var/lib/apt/lists/*",
        "var/cache/apt/*.bin",
        "var/cache/apt/archives/*.deb",
    ):
        for path in rootfs.glob(pattern):
            _remove(path)
    for name in ("etc/hostname", "etc/resolv.conf", "etc/apt/sources.list"):
        (rootfs / name).unlink(missing_ok=True)
    (rootfs / "etc/apt/sources.list.d/debian.sources").write_text(_debian_sources())
    (rootfs / "etc/dpkg/dpkg.cfg.d/docker").write_text(_DPKG_EXCLUDES)
    (rootfs / "etc/apt/apt.conf.d/docker-clean").write_text(_APT_CLEAN)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _from_image(containerfile: Path) -> str:
    match = re.search(r"^FROM\s+(\S+)", containerfile.read_text(), re.M | re.I)
    if match is None:
        raise ValueError(f"{containerfile}: no FROM")
    return match[1]


def _digest(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


def _tree_digest(root: Path, names: Iterable[str]) -> str:
    """Digest of the named files and directories under root: paths, exec bits, contents."""
    digest = hashlib.sha256()
    for name in names:
        top = root / name
        paths = [top] if not top.is_dir() else sorted(top.rglob("*"))
        for path in paths:
            relative = path.relative_to(root)
            if any(part in IGNORED for part in relative.parts) or path.suffix == ".pyc":
                continue
            if path.is_symlink():
                digest.update(f"{relative} -> {os.readlink(path)}\0".encode())
            elif path.is_file():
                executable = os.access(path, os.X_OK)
                digest.update(f"{relative} {int(executable)}\0".encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def _require_static(binary: Path) -> None:
    """An image FROM scratch has no dynamic loader: refuse an ELF that asks for one."""
    data = binary.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{binary}: not a 64-bit ELF")
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for index in range(phnum):
        (p_type,) = struct.unpack_from("<I", data, phoff + index * phentsize)
        if p_type == 3:  # PT_INTERP
            raise ValueError(f"{binary} is dynamically linked; the image needs a static one")


def _require_packages(tools: dict[str, str], installed_only: bool = False) -> None:
    """Install the Debian packages whose command (or file) is missing; root only."""
    missing = []
    for tool, package in tools.items():
        if installed_only:
            status = subprocess.run(
                ["dpkg-query", "-W", "-f=${Status}", package],
                capture_output=True,
                text=True,
                check=False,
            ).stdout
            present = status == "install ok installed"
        else:
            present = Path(tool).exists() if tool.startswith("/") else bool(shutil.which(tool))
        if not present:
            missing.append(package)
    if not missing:
        return
    if os.geteuid() != 0:
        raise InputsMissing(f"needs the Debian packages {' '.join(missing)} (install as root)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    _run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], env=env)


def _run(argv: list[str], env: dict[str, str] | None = None) -> None:
    # The tools' chatter goes to stderr: stdout's last line is the CLI's answer.
    done = subprocess.run(argv, env=env, stdout=sys.stderr, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])}... failed ({done.returncode})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.kube.images", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    build_command = commands.add_parser("build", help="build the images or reuse the cache")
    build_command.add_argument("--only", nargs="+", choices=NAMES, metavar="NAME")
    args = parser.parse_args(argv)
    try:
        built = build_images(args.only)
    except (InputsMissing, build.GoMissing) as err:
        print(f"lab.kube.images: {err}", file=sys.stderr)
        return 1
    for reference, archive in built.items():
        print(f"{reference} {archive}", file=sys.stderr)
    print(archives_dir())
    return 0


if __name__ == "__main__":
    sys.exit(main())
