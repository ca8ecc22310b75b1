"""The connection to the API server: where it is, who kpr is to it, and the GET requests
of the watches (kpr/sources/kubernetes.py), on urllib3.

Credentials come from a kubeconfig (the server, its CA, a client certificate and key, a
token or a token file: what kube-proxy's kubeconfig.conf and kubeadm's kubeconfigs hold),
else from the pod's service account (in-cluster), else `--master` alone. Not from the
official client: importing it costs the agent much of its memory (pydantic, generated
models, credential plugins) for the few GETs it makes, and the agent's memory is what an
operator pays on every node. Not supported, each refused with the reason: a kubeconfig
user's `exec` or `auth-provider` plugin, and its `proxy-url`.
"""

from __future__ import annotations

import base64
import logging
import os
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import urllib3

from kpr import __version__

log = logging.getLogger(__name__)

TOKEN_REREAD = 60.0  # seconds; client-go re-reads a kubeconfig's tokenFile this often
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")  # in a pod
POOL_SIZE = 8  # connections kept to the server: a watch holds one (five watches)

# a request's timeout: seconds in all, or (to connect, between reads)
Timeout = float | tuple[float, float] | None


class ApiError(Exception):
    """The API server answered with a status that is not 2xx (or a watch's ERROR event)."""

    def __init__(self, status: int, reason: str) -> None:
        self.status = status
        self.reason = reason
        super().__init__(f"({status}) {reason}")


class KubeconfigError(ValueError):
    """A kubeconfig kpr cannot use: one paragraph naming the file and what is wrong."""


def _kubeconfig_error(path: str, origin: str, problem: str) -> KubeconfigError:
    return KubeconfigError(
        f"{path} ({origin}): {problem}. kpr needs a kubeconfig it can read, whose current "
        "context names a cluster with a server and a user with credentials; in a pod, mount "
        "it (kube-proxy's ConfigMap puts kubeconfig.conf under /var/lib/kube-proxy) and the "
        "ServiceAccount token it names."
    )


@dataclass
class TokenFile:
    """A bearer token read from a file, again every TOKEN_REREAD seconds: the kubelet
    rotates a pod's bound token in place."""

    path: str
    token: str | None = None
    read_at: float = field(default=float("-inf"))
    lock: threading.Lock = field(default_factory=threading.Lock)  # (one read per rotation)

    def __call__(self) -> str | None:
        with self.lock:
            if time.monotonic() - self.read_at >= TOKEN_REREAD:
                self.read_at = time.monotonic()
                try:
                    with open(self.path) as f:
                        self.token = f.read().strip()
                except OSError as err:  # keep the token we have; the file may be mid-rotation
                    if self.token is None:
                        raise
                    log.warning("cannot read the token file %s again: %s", self.path, err)
            return self.token


@dataclass
class ApiConnection:
    """The API server at `host` (scheme://address:port), over `pool`, with a bearer token
    from `token` when it gives one."""

    host: str
    pool: urllib3.PoolManager
    token: Callable[[], str | None] = lambda: None

    def get(self, path: str, query: list[tuple[str, str]], timeout: Timeout = None) -> Any:
        """GET `path`: urllib3's response, its body not read yet (a watch streams it);
        ApiError for a status not 2xx."""
        headers = {"Accept": "application/json", "User-Agent": f"kpr/{__version__}"}
        token = self.token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        url = self.host.rstrip("/") + path + (f"?{urlencode(query)}" if query else "")
        response = self.pool.request(
            "GET",
            url,
            headers=headers,
            preload_content=False,
            timeout=_timeout(timeout),
            retries=False,  # the watches back off on their own
        )
        if not 200 <= response.status <= 299:
            response.read()
            response.release_conn()
            raise ApiError(response.status, response.reason or "")
        return response


def _timeout(timeout: Timeout) -> urllib3.Timeout | None:
    if isinstance(timeout, tuple):
        return urllib3.Timeout(connect=timeout[0], read=timeout[1])
    return None if timeout is None else urllib3.Timeout(total=timeout)


def lines(response: Any) -> Iterator[bytes]:
    """A streamed body line by line, each as soon as it has arrived (a watch: an event a
    line); empty lines too."""
    pending = b""
    for chunk in response.stream(amt=None, decode_content=False):
        pending += chunk
        *complete, pending = pending.split(b"\n")
        yield from complete
    if pending:
        yield pending


def connect(
    kubeconfig: str | None, master: str | None, origin: str = "--kubeconfig"
) -> ApiConnection:
    """The API server to talk to: a kubeconfig, else in-cluster credentials, else
    `master` alone. `master` overrides the address in every case: in-cluster, the
    default is the kubernetes Service's ClusterIP, which nothing serves until kpr
    itself runs. `origin` says where the kubeconfig's path came from, for errors."""
    if kubeconfig:
        connection = _from_kubeconfig(kubeconfig, origin)
    elif (SERVICE_ACCOUNT / "token").exists():
        connection = _in_cluster(master)
    elif master:
        connection = ApiConnection(master, _pool(ssl.create_default_context()))
    else:
        raise ValueError(
            "No API server to talk to: pass --kubeconfig or --master, set "
            "clientConnection.kubeconfig in --config, or run in a pod (in-cluster credentials)."
        )
    if master:
        connection.host = master
    return connection


def _in_cluster(master: str | None) -> ApiConnection:
    """The pod's service account: its token, its CA, the kubernetes Service's address."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT")
    if not master and not (host and port):
        raise ValueError(
            "in a pod without KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT: "
            "pass --master (the API server's address)"
        )
    if host and ":" in host:
        host = f"[{host}]"  # IPv6
    context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
    token = TokenFile(str(SERVICE_ACCOUNT / "token"))
    return ApiConnection(master or f"https://{host}:{port}", _pool(context), token)


def _pool(context: ssl.SSLContext, server_name: str | None = None) -> urllib3.PoolManager:
    return urllib3.PoolManager(
        num_pools=2, maxsize=POOL_SIZE, ssl_context=context, server_hostname=server_name
    )


def _no_token() -> str | None:
    return None


def _from_kubeconfig(path: str, origin: str) -> ApiConnection:
    cluster, user, base = check_kubeconfig(path, origin)
    for unsupported, where in (("exec", user), ("auth-provider", user), ("proxy-url", cluster)):
        if where.get(unsupported):
            raise _kubeconfig_error(
                path,
                origin,
                f"{unsupported} is not supported by kpr (use a token, a tokenFile or a "
                "client certificate, as kube-proxy's kubeconfig.conf does)",
            )
    server = str(cluster["server"])
    tls = ssl.create_default_context()
    try:
        if server.startswith("https:"):  # (over plain HTTP they are never read)
            tls = _tls(cluster, user, base)
    except (ssl.SSLError, OSError, ValueError) as err:
        raise _kubeconfig_error(path, origin, f"its TLS settings cannot be used ({err})") from None
    token: Callable[[], str | None] = _no_token
    if user.get("token"):
        token = str(user["token"]).strip
    elif user.get("tokenFile"):
        token = TokenFile(os.path.join(base, user["tokenFile"]))
    return ApiConnection(server, _pool(tls, cluster.get("tls-server-name")), token)


def _tls(cluster: dict, user: dict, base: str) -> ssl.SSLContext:
    """The cluster's CA (else the system's) and the user's client certificate."""
    tls = ssl.create_default_context(
        cafile=_file(cluster, "certificate-authority", base),
        cadata=_data(cluster, "certificate-authority"),
    )
    if cluster.get("insecure-skip-tls-verify"):
        tls.check_hostname = False
        tls.verify_mode = ssl.CERT_NONE
    _load_client_certificate(tls, user, base)
    return tls


def _file(section: dict, key: str, base: str) -> str | None:
    """A file a kubeconfig names (relative to the kubeconfig), unless its -data is given."""
    if section.get(f"{key}-data") or not section.get(key):
        return None
    return os.path.join(base, section[key])


def _data(section: dict, key: str) -> str | None:
    """A kubeconfig's base64 `-data` field, as PEM text."""
    value = section.get(f"{key}-data")
    return base64.b64decode(value).decode() if value else None


def _load_client_certificate(tls: ssl.SSLContext, user: dict, base: str) -> None:
    """The user's client certificate and key, from files or from -data (which the ssl
    module reads only from files: written to a private directory, then removed)."""
    certificate = _file(user, "client-certificate", base)
    key = _file(user, "client-key", base)
    with tempfile.TemporaryDirectory(prefix="kpr-tls-") as private:  # mode 0700
        for name, value in (
            ("client-certificate", _data(user, "client-certificate")),
            ("client-key", _data(user, "client-key")),
        ):
            if value is not None:
                written = os.path.join(private, name)
                with open(os.open(written, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                    f.write(value)
                certificate = written if name == "client-certificate" else certificate
                key = written if name == "client-key" else key
        if certificate:
            tls.load_cert_chain(certificate, key)


def _named(doc: dict, section: str, name: object, path: str, origin: str) -> dict:
    for entry in doc.get(section) or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            return entry
    raise _kubeconfig_error(path, origin, f"{section} has no entry named {name!r}")


def check_kubeconfig(path: str, origin: str) -> tuple[dict, dict, str]:
    """The current context's cluster and user, and the directory the files they name are
    relative to, after checking what would fail later: the file, its YAML, the current
    context, and the files it names."""
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except OSError as err:
        raise _kubeconfig_error(path, origin, err.strerror or str(err)) from None
    except yaml.YAMLError as err:
        detail = " ".join(str(err).split())  # one paragraph: YAML errors span lines
        raise _kubeconfig_error(path, origin, f"not valid YAML ({detail})") from None
    if not isinstance(doc, dict) or doc.get("kind", "Config") != "Config":
        raise _kubeconfig_error(path, origin, "not a kubeconfig (kind: Config)")
    current = doc.get("current-context")
    if not current:
        raise _kubeconfig_error(path, origin, "no current-context")
    context = _named(doc, "contexts", current, path, origin).get("context") or {}
    cluster = _named(doc, "clusters", context.get("cluster"), path, origin).get("cluster") or {}
    user_name = context.get("user")
    user = (_named(doc, "users", user_name, path, origin).get("user") or {}) if user_name else {}
    if not cluster.get("server"):
        raise _kubeconfig_error(path, origin, f"cluster {context.get('cluster')!r} has no server")
    base = os.path.dirname(os.path.abspath(path))
    for where, section, key in (
        ("cluster", cluster, "certificate-authority"),
        ("user", user, "tokenFile"),
        ("user", user, "client-certificate"),
        ("user", user, "client-key"),
    ):
        named_file = _file(section, key, base)
        if named_file and not os.access(named_file, os.R_OK):
            raise _kubeconfig_error(
                path, origin, f"the {where}'s {key} {named_file} cannot be read"
            )
    return cluster, user, base
