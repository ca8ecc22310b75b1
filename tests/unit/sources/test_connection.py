"""kpr's connection to the API server over TLS: a kubeconfig's CA and client certificate
(as files and as -data), a token, and what it refuses. A real HTTPS server on loopback with
certificates made by openssl; plain-HTTP and in-cluster cases: test_cli.py and
test_kubernetes_source.py."""

from __future__ import annotations

import base64
import http.server
import json
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kpr.sources.connection import ApiError, KubeconfigError, connect, lines
from kpr.sources.kubernetes import LIST_SERVICES, lister

pytestmark = pytest.mark.skipif(not shutil.which("openssl"), reason="needs the openssl command")


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def certificates(d: Path) -> None:
    """ca.crt, and server.crt/.key (127.0.0.1) and client.crt/.key (CN kpr) it signed."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
    for name, extra in (("server", ["-addext", "subjectAltName=IP:127.0.0.1"]), ("client", [])):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr", *extra, cwd=d)  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-copy_extensions", "copy",
                "-out", f"{name}.crt", cwd=d)  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    certificates(d)
    return d


@pytest.fixture
def server(pki: Path) -> Iterator[dict]:
    """An HTTPS server that wants a client certificate from the CA; what it saw."""
    seen: dict = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            subject = dict(x[0] for x in self.connection.getpeercert()["subject"])  # type: ignore[union-attr]
            seen.update(path=self.path, client=subject["commonName"])
            seen["authorization"] = self.headers.get("Authorization")
            body = b'{"items": []}\n{"type": "ADDED"}\n'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki / "ca.crt"))
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(pki / "server.crt", pki / "server.key")
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    seen["url"] = f"https://127.0.0.1:{httpd.server_address[1]}"
    yield seen
    httpd.shutdown()
    httpd.server_close()


def kubeconfig(path: Path, cluster: dict, user: dict) -> str:
    path.write_text(
        yaml.safe_dump(
            {
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return str(path)


def data(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def test_a_client_certificate_from_files_reaches_the_server(pki, server, tmp_path) -> None:
    config = kubeconfig(
        tmp_path / "kubeconfig",
        {"server": server["url"], "certificate-authority": str(pki / "ca.crt")},
        {"client-certificate": str(pki / "client.crt"), "client-key": str(pki / "client.key")},
    )
    response = lister(connect(config, None), LIST_SERVICES)(limit=500, watch=True)
    assert list(lines(response)) == [b'{"items": []}', b'{"type": "ADDED"}']
    assert server["path"] == "/api/v1/services?limit=500&watch=true"
    assert (server["client"], server["authorization"]) == ("client", None)


def test_certificates_as_data_and_a_token(pki, server, tmp_path) -> None:
    config = kubeconfig(
        tmp_path / "kubeconfig",
        {"server": server["url"], "certificate-authority-data": data(pki / "ca.crt")},
        {
            "client-certificate-data": data(pki / "client.crt"),
            "client-key-data": data(pki / "client.key"),
            "token": "abc",
        },
    )
    assert json.loads(lister(connect(config, None), LIST_SERVICES)().data.split(b"\n")[0]) == {
        "items": []
    }
    assert (server["client"], server["authorization"]) == ("client", "Bearer abc")


def test_a_server_the_ca_did_not_sign_is_refused(pki, server, tmp_path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    certificates(other)
    config = kubeconfig(
        tmp_path / "kubeconfig",
        {"server": server["url"], "certificate-authority": str(other / "ca.crt")},
        {"client-certificate": str(pki / "client.crt"), "client-key": str(pki / "client.key")},
    )
    with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
        lister(connect(config, None), LIST_SERVICES)(_request_timeout=5)
    assert "path" not in server


def test_a_status_not_2xx_is_an_api_error() -> None:
    from tests.support.apiserver import TestApiServer

    with TestApiServer() as api, pytest.raises(ApiError) as err:
        connect(None, api.url).get("/api/v1/nothing", [], 5)
    assert err.value.status == 404


@pytest.mark.parametrize(
    "user, cluster, named",
    [
        ({"exec": {"command": "aws"}}, {}, "exec is not supported"),
        ({"auth-provider": {"name": "gcp"}}, {}, "auth-provider is not supported"),
        ({"token": "t"}, {"proxy-url": "http://proxy:3128"}, "proxy-url is not supported"),
        ({"client-certificate-data": "bm90IGEgY2VydA=="}, {}, "TLS settings cannot be used"),
    ],
    ids=["exec", "auth-provider", "proxy", "bad-certificate"],
)
def test_what_kpr_cannot_use_is_one_paragraph(tmp_path, user, cluster, named) -> None:
    config = kubeconfig(tmp_path / "kubeconfig", {"server": "https://192.0.2.1", **cluster}, user)
    with pytest.raises(KubeconfigError) as err:
        connect(config, None)
    assert named in str(err.value) and str(tmp_path / "kubeconfig") in str(err.value)
