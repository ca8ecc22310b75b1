"""deploy/ and vagrant/ as far as they can be checked without a cluster, a container engine
or a VM: manifests against the Kubernetes OpenAPI schemas, the kustomizations rendered, the
DaemonSet's essentials against kpr's own code (CLI, ports, API calls), the Dockerfile against
deploy/host-setup.sh, and the scripts through shellcheck and ruby -c."""

from __future__ import annotations

import ast
import copy
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path, PurePosixPath

import pytest
import yaml

from kpr.cli.config import PROXY_HEALTHZ_PORT, PROXY_STATUS_PORT, load_config, split_host_port
from kpr.datapath import abi
from kpr.node import host
from tests.support.paths import REPO
from tests.support.schemas import K8S_VERSION

ROOT = REPO
DEPLOY = ROOT / "deploy"
VAGRANT = ROOT / "vagrant"

# --- a kustomize subset: exactly what deploy/ and vagrant/ use; anything else is refused ----

CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "Namespace", "PriorityClass"}
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "namespace", "resources", "images", "patches"}


class Unsupported(Exception):
    """The kustomization uses something this renderer does not implement."""


def _pointer(path: str) -> list[str]:
    assert path.startswith("/"), path
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _json_patch(doc: dict, ops: list[dict]) -> None:
    """RFC 6902 add / replace / remove, as kustomize applies inline JSON6902 patches."""
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        kind = op["op"]
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if kind == "add":
                node.insert(index, op["value"])
            elif kind == "replace":
                node[index] = op["value"]
            elif kind == "remove":
                del node[index]
            else:
                raise Unsupported(f"JSON patch op {kind}")
        elif kind in ("add", "replace"):
            if kind == "replace" and last not in node:
                raise KeyError(f"replace of missing {op['path']}")
            node[last] = op["value"]
        elif kind == "remove":
            del node[last]
        else:
            raise Unsupported(f"JSON patch op {kind}")


def _pod_spec(doc: dict) -> dict | None:
    if doc["kind"] in ("DaemonSet", "Deployment", "StatefulSet", "Job"):
        return doc["spec"]["template"]["spec"]
    return doc["spec"] if doc["kind"] == "Pod" else None


def _split_image(image: str) -> tuple[str, str]:
    """(name, ":tag" or "@digest" or "")."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    head, _, tail = image.rpartition(":")
    if head and "/" not in tail:
        return head, ":" + tail
    return image, ""


def render(directory: Path) -> list[dict]:
    """kustomize build, for the fields in KUSTOMIZATION_FIELDS."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kust) - KUSTOMIZATION_FIELDS
    if unknown:
        raise Unsupported(f"{directory}/kustomization.yaml: {sorted(unknown)}")
    docs: list[dict] = []
    for entry in kust.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            docs.extend(render(path))
        else:
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d is not None)
    for patch in kust.get("patches", []):
        if set(patch) != {"target", "patch"} or not isinstance(patch["patch"], str):
            raise Unsupported(f"patch {patch}: only inline patches with a target")
        ops = yaml.safe_load(patch["patch"])
        if not isinstance(ops, list):
            raise Unsupported("strategic-merge patches")
        target = patch["target"]
        if set(target) - {"kind", "name"}:
            raise Unsupported(f"patch target {target}")
        hits = [
            d
            for d in docs
            if all(d[k] == v if k == "kind" else d["metadata"][k] == v for k, v in target.items())
        ]
        assert hits, f"patch target {target} matches nothing"
        for doc in hits:
            _json_patch(doc, ops)
    namespace = kust.get("namespace")
    if namespace:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = namespace
            for subject in doc.get("subjects", []):  # kustomize: ServiceAccount subjects
                if subject["kind"] == "ServiceAccount":
                    subject["namespace"] = namespace
    for image in kust.get("images", []):
        if set(image) - {"name", "newName", "newTag", "digest"}:
            raise Unsupported(f"image {image}")
        for doc in docs:
            spec = _pod_spec(doc)
            for container in (spec or {}).get("containers", []) + (spec or {}).get(
                "initContainers", []
            ):
                name, ref = _split_image(container["image"])
                if name != image["name"]:
                    continue
                if "digest" in image:
                    ref = "@" + image["digest"]
                elif "newTag" in image:
                    ref = f":{image['newTag']}"
                container["image"] = image.get("newName", name) + ref
    return docs


def by_kind(docs: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for doc in docs:
        assert doc["kind"] not in out, f"two {doc['kind']}s"
        out[doc["kind"]] = doc
    return out


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    return by_kind(render(DEPLOY))


@pytest.fixture(scope="module")
def daemonset(rendered) -> dict:
    return rendered["DaemonSet"]


def container(ds: dict, name: str = "kpr") -> dict:
    (found,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def manifest_files() -> list[Path]:
    return sorted((DEPLOY / "kpr").glob("*.yaml"))


# --- (a) the Kubernetes OpenAPI schemas -------------------------------------------------------


def _validate(doc: dict, where: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]'")
    try:
        kv.validate(doc, K8S_VERSION, strict=True)  # strict: unknown fields are errors
    except kv.ValidationError as err:
        pytest.fail(f"{where}: {doc['kind']} {doc['metadata']['name']}: {err.message}")


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_validates_against_openapi_schema(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs
    for doc in docs:
        _validate(doc, str(path.relative_to(ROOT)))


@pytest.mark.parametrize("where", [DEPLOY, VAGRANT / "kustomize"], ids=["deploy", "vagrant"])
def test_rendered_kustomization_validates(where):
    for doc in render(where):
        _validate(doc, f"kustomize build {where.relative_to(ROOT)}")


def test_validator_is_strict():
    """The check above would catch a misspelt field (and works offline: schemas are bundled)."""
    kv = pytest.importorskip("kubernetes_validate")
    doc = copy.deepcopy(yaml.safe_load((DEPLOY / "kpr" / "daemonset.yaml").read_text()))
    doc["spec"]["template"]["spec"]["hostNetwrk"] = True
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, K8S_VERSION, strict=True)


# --- (b) the kustomizations render --------------------------------------------------------------


def test_kustomization_renders_every_manifest(rendered):
    kust = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    listed = {(DEPLOY / r).resolve() for r in kust["resources"]}
    assert listed == {p.resolve() for p in manifest_files()}, "a manifest not in kustomization"
    assert set(rendered) == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
    }
    for doc in rendered.values():
        if doc["kind"] not in CLUSTER_SCOPED:
            assert doc["metadata"]["namespace"] == "kube-system"
    spec = rendered["DaemonSet"]["spec"]["template"]["spec"]
    images = {c["image"] for c in spec["containers"] + spec["initContainers"]}
    (image,) = kust["images"]
    assert images == {f"{image['newName']}:{image['newTag']}"}


def test_daemonset_references_resolve(rendered):
    spec = rendered["DaemonSet"]["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == rendered["ServiceAccount"]["metadata"]["name"]
    binding = rendered["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == rendered["ClusterRole"]["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": spec["serviceAccountName"],
            "namespace": rendered["DaemonSet"]["metadata"]["namespace"],
        }
    ]
    configmap = rendered["ConfigMap"]
    for volume in spec["volumes"]:
        if "configMap" in volume:
            assert volume["configMap"]["name"] == configmap["metadata"]["name"]
            for item in volume["configMap"]["items"]:
                assert item["key"] in configmap["data"]
    for env in container(rendered["DaemonSet"])["env"]:
        ref = env.get("valueFrom", {}).get("configMapKeyRef")
        if ref:
            assert ref["name"] == configmap["metadata"]["name"] and ref["key"] in configmap["data"]


def test_vagrant_overlay_sets_the_api_server_and_image():
    docs = by_kind(render(VAGRANT / "kustomize"))
    assert docs["ConfigMap"]["data"]["master"] == "https://192.168.56.10:6443"
    assert "CONTROL_PLANE" in by_kind(render(DEPLOY))["ConfigMap"]["data"]["master"]
    spec = docs["DaemonSet"]["spec"]["template"]["spec"]
    assert {c["image"] for c in spec["containers"] + spec["initContainers"]} == {
        "localhost/kpr:dev"
    }
    provision = (VAGRANT / "provision" / "kpr-image.sh").read_text()
    assert "localhost/kpr:dev" in provision


def test_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(
        "resources: []\nconfigMapGenerator: [{name: x, literals: [a=b]}]\n"
    )
    with pytest.raises(Unsupported):
        render(tmp_path)


# --- (c) the DaemonSet against kpr's code ---------------------------------------------------------


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args; every reference must be a defined variable."""

    def one(match: re.Match) -> str:
        assert match[1] in env, f"$({match[1]}) is not in the container's env"
        return env[match[1]]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def parsed_args(ds: dict, configmap: dict) -> dict:
    """The container's args as `kpr`'s own command line parses them."""
    from typer.main import get_command

    from kpr.cli.main import app

    env = {}
    for var in container(ds)["env"]:
        source = var.get("valueFrom", {})
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "spec.nodeName"
            env[var["name"]] = "node-1"
        elif "configMapKeyRef" in source:
            env[var["name"]] = configmap["data"][source["configMapKeyRef"]["key"]]
        else:
            env[var["name"]] = var["value"]
    args = [expand(a, env) for a in container(ds).get("command", []) + container(ds)["args"]]
    command = get_command(app).commands[args[0]]  # typer's (vendored) click group
    return command.make_context(args[0], args[1:]).params


def mounts(ds: dict) -> dict[str, tuple[dict, dict]]:
    """mountPath -> (volumeMount, volume) of the kpr container."""
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in container(ds)["volumeMounts"]}


def covering_mount(ds: dict, path: Path) -> tuple[dict, dict]:
    found = [(mp, m) for mp, m in mounts(ds).items() if Path(mp) in (path, *path.parents)]
    assert found, f"{path} is on no volume"
    return max(found, key=lambda item: len(item[0]))[1]


def test_daemonset_runs_on_every_node_in_the_host_network(daemonset):
    spec = daemonset["spec"]
    pod = spec["template"]["spec"]
    assert pod["hostNetwork"] is True
    # not the cluster DNS: it is reached through kpr itself
    assert pod["dnsPolicy"] == "Default"
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert spec["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1},
    }
    assert pod["terminationGracePeriodSeconds"] > 0
    assert container(daemonset)["resources"]["requests"]
    env = {e["name"]: e for e in container(daemonset)["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_daemonset_args_parse_with_kprs_own_cli(rendered, daemonset):
    params = parsed_args(daemonset, rendered["ConfigMap"])
    assert params["source"] is None  # the API server, not a directory
    assert params["node_name"] == "node-1"
    # the API server is explicit, never the kubernetes Service's ClusterIP
    assert params["master"] == rendered["ConfigMap"]["data"]["master"]
    assert params["master"].startswith("https://")
    assert params["bpffs"] == host.DEFAULT_PIN_DIR
    assert params["cgroup"] is not None
    config_mount, config_volume = covering_mount(daemonset, params["config_file"])
    assert config_volume["configMap"]["name"] == rendered["ConfigMap"]["metadata"]["name"]
    (item,) = [
        i for i in config_volume["configMap"]["items"] if i["path"] == params["config_file"].name
    ]
    assert item["key"] == "config.conf"


def test_image_entrypoint_is_kpr(daemonset):
    """The container's args go to the image's `kpr` entrypoint: the same `kpr run` as the
    tests run (no command override in the kpr container)."""
    assert "command" not in container(daemonset)
    assert container(daemonset)["args"][0] == "run"
    entrypoint = [i for i in dockerfile_instructions() if i[0] == "ENTRYPOINT"]
    assert entrypoint == [("ENTRYPOINT", '["kpr"]')]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["kpr"] == "kpr.cli.main:app"


def test_daemonset_mounts_the_hosts_bpffs_cgroup_and_headers(rendered, daemonset):
    params = parsed_args(daemonset, rendered["ConfigMap"])
    # the pins: the host's bpffs, so they outlive the pod
    mount, volume = covering_mount(daemonset, params["bpffs"])
    assert volume["hostPath"]["path"] == "/sys/fs/bpf" == mount["mountPath"]
    assert mount.get("mountPropagation") in ("HostToContainer", "Bidirectional")
    assert not mount.get("readOnly")
    # ... and the pod does not start on a host without one (kpr would mount its own)
    (init,) = daemonset["spec"]["template"]["spec"]["initContainers"]
    assert "bpf_fs" in " ".join(init["command"])
    assert [m["mountPath"] for m in init["volumeMounts"]] == ["/sys/fs/bpf"]
    assert init["image"] == container(daemonset)["image"]
    # the host's cgroup v2 hierarchy, at the same path as on the host
    mount, volume = covering_mount(daemonset, params["cgroup"])
    assert volume["hostPath"]["path"] == mount["mountPath"] == str(params["cgroup"])
    # kernel headers for BCC, read-only: /lib/modules/<release>/build -> /usr/src/...
    for path in ("/lib/modules", "/usr/src"):
        mount, volume = mounts(daemonset)[path]
        assert volume["hostPath"]["path"] == path and mount["readOnly"] is True
    # the run state, where `kpr status` on the node looks
    from kpr.agent import runstate

    mount, volume = covering_mount(daemonset, runstate.RUN_DIR)
    assert volume["hostPath"]["path"] == mount["mountPath"] == str(runstate.RUN_DIR)


def test_daemonset_mounts_the_pods_netns_files_where_kpr_looks(daemonset):
    """No hostPID: kpr enters the pods' network namespaces (to destroy connected UDP sockets
    to a removed backend) by the netns files the runtime binds in /run/netns, which must
    reach the pod as pods start (HostToContainer)."""
    from kpr.datapath import sockets

    assert not daemonset["spec"]["template"]["spec"].get("hostPID")
    env = {e["name"] for e in container(daemonset)["env"]}
    assert sockets.NETNS_DIRS_ENV not in env  # the defaults, of which /run/netns is one
    mount, volume = covering_mount(daemonset, Path("/run/netns"))
    assert Path(mount["mountPath"]) in sockets.DEFAULT_NETNS_DIRS
    assert volume["hostPath"]["path"] == mount["mountPath"] == "/run/netns"
    assert mount["mountPropagation"] == "HostToContainer"


def test_daemonset_capabilities(daemonset):
    sc = container(daemonset)["securityContext"]
    assert sc["privileged"] is False
    assert sc["runAsUser"] == 0  # host.require_root()
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert {"SYS_ADMIN", "NET_ADMIN"} <= set(sc["capabilities"]["add"])
    assert sc["appArmorProfile"] == {"type": "Unconfined"}  # pins below /sys/fs/bpf


def test_probes_are_on_the_port_kpr_serves(rendered, daemonset):
    conf = rendered["ConfigMap"]["data"]["config.conf"]
    proxy, notes = load_config(conf, "config.conf")
    assert notes == []  # every field in the ConfigMap is one kpr uses
    host_, port = split_host_port(proxy.healthz_bind_address)
    assert port == PROXY_HEALTHZ_PORT and host_ == "0.0.0.0"  # probes come from the kubelet
    assert split_host_port(proxy.metrics_bind_address) == ("127.0.0.1", PROXY_STATUS_PORT)
    c = container(daemonset)
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": PROXY_HEALTHZ_PORT}
    # ready once synced since the start: a rollout that cannot sync stops on its first node
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": PROXY_HEALTHZ_PORT}
    assert c["startupProbe"]["httpGet"] == {"path": "/livez", "port": PROXY_HEALTHZ_PORT}
    assert [p["containerPort"] for p in c["ports"]] == [PROXY_HEALTHZ_PORT]
    from kpr.health.proxier import HealthServer

    source = Path(HealthServer.__module__.replace(".", "/") + ".py")
    text = (ROOT / source).read_text()
    assert '"/healthz"' in text and '"/livez"' in text and '"/readyz"' in text


# --- RBAC: derived from the requests kpr's API source makes -----------------------------------


def api_requests() -> set[tuple[str, str, str]]:
    """(API group, resource, verb) of every request KubernetesSource makes, recorded by the
    test API server while the real kubernetes client lists and watches."""
    from kpr.sources.connection import connect
    from kpr.sources.kubernetes import KubernetesSource
    from tests.support.apiserver import TestApiServer

    with TestApiServer(bookmark_interval=0.2) as server:
        source = KubernetesSource(connect(None, server.url), "node-1")
        source.start()
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                watches = [r for r in server.requests if r[2].get("watch") in ("1", "true")]
                if len(watches) >= len(source.watchers) and source.synced:
                    break
                time.sleep(0.05)
            else:
                pytest.fail(f"the source did not list and watch: {server.requests}")
        finally:
            source.stop()
        requests = list(server.requests)
    out = set()
    for method, path, params in requests:
        assert method == "GET"
        parts = PurePosixPath(path).parts[1:]  # api/v1/... or apis/<group>/<version>/...
        group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
        if rest[0] == "namespaces" and len(rest) > 2:
            rest = rest[2:]
        resource = rest[0]
        if len(rest) > 1:
            verb = "get"
        elif params.get("watch") in ("1", "true"):
            verb = "watch"
        else:
            verb = "list"
        if resource == "nodes" and verb in ("list", "watch"):
            assert params["fieldSelector"] == "metadata.name=node-1"  # its own Node only
        out.add((group, resource, verb))
    return out


def api_operations_in_code() -> set[str]:
    """Every kubernetes client API operation named anywhere in kpr/ (the lab and the bench,
    lab/ and bench/ beside it, drive their own API server with the admin's credentials)."""
    from kubernetes import client

    operations = {
        name
        for api in dir(client)
        if api.endswith("Api") and isinstance(getattr(client, api), type)
        for name in dir(getattr(client, api))
        if re.match(r"(list|read|create|patch|replace|delete|connect|get)_", name)
        and not name.endswith(("_with_http_info", "_without_preload_content"))
    }
    found = set()
    for path in (ROOT / "kpr").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in operations:
                found.add(node.attr)
            # (the agent's source names its operations and builds them on the ApiClient)
            if isinstance(node, ast.Constant) and node.value in operations:
                found.add(node.value)
    return found


def test_rbac_is_exactly_what_the_code_calls(rendered):
    from kpr.sources.connection import connect
    from kpr.sources.kubernetes import KubernetesSource

    # every API operation in kpr/ is one the source's watchers use, so the requests
    # recorded below are all the requests kpr makes
    source = KubernetesSource(connect(None, "http://127.0.0.1:1"), "node-1")
    watched = {w.list_fn.__name__ for w in source.watchers}
    assert api_operations_in_code() == watched
    assert watched == {
        "list_service_for_all_namespaces",
        "list_endpoint_slice_for_all_namespaces",
        "list_node",
    }
    wanted = api_requests()
    assert {verb for _, _, verb in wanted} == {"list", "watch"}
    role = rendered["ClusterRole"]
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert all(set(rule) == {"apiGroups", "resources", "verbs"} for rule in role["rules"])
    assert granted == wanted


# --- (d) scripts and the Vagrantfile ------------------------------------------------------------


def shell_scripts() -> list[Path]:
    scripts = sorted(DEPLOY.rglob("*.sh")) + sorted(VAGRANT.rglob("*.sh"))
    assert scripts
    return scripts


def test_scripts_pass_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; make test does)")
    # deploy/host-setup.sh splits $missing into words on purpose and lists globbed
    # directories with ls: shellcheck's "info" findings, so deploy/ is held to warnings
    for scripts, severity in (
        (sorted(VAGRANT.rglob("*.sh")), "style"),
        (sorted(DEPLOY.rglob("*.sh")), "warning"),
    ):
        assert scripts
        result = subprocess.run(
            ["shellcheck", "--external-sources", f"--severity={severity}", *map(str, scripts)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_scripts_are_executable_and_strict():
    for script in shell_scripts():
        assert script.stat().st_mode & 0o111, f"{script} is not executable"
        text = script.read_text()
        assert text.startswith("#!/"), script
        assert re.search(r"^set -e", text, re.M), f"{script} does not stop on errors"


def test_vagrantfile_parses():
    if shutil.which("ruby") is None:
        pytest.skip("ruby is not installed (apt-get install ruby; make test does)")
    result = subprocess.run(
        ["ruby", "-c", str(VAGRANT / "Vagrantfile")], capture_output=True, text=True
    )
    assert result.returncode == 0 and "Syntax OK" in result.stdout, result.stderr


def test_vagrantfile_runs_the_provisioning_scripts_that_exist():
    text = (VAGRANT / "Vagrantfile").read_text()
    named = set(re.findall(r"provision/([\w.-]+\.sh)", text))
    assert named, "the Vagrantfile runs no provisioning script"
    for name in named:
        assert (VAGRANT / "provision" / name).is_file(), name
    for provider in ("libvirt", "virtualbox"):
        assert f'provider "{provider}"' in text or f"provider :{provider}" in text


# --- (e) the Dockerfile ------------------------------------------------------------------------

# deploy/host-setup.sh packages the image does not need, and why.
NOT_IN_IMAGE = {
    "gcc": "only for building on a development host",
    "make": "only for building on a development host",
}


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)  # line continuations
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def host_setup_packages() -> set[str]:
    text = (DEPLOY / "host-setup.sh").read_text()
    (packages,) = re.findall(r'^PACKAGES="([^"]+)"', text, re.M)
    return set(packages.split())


def test_dockerfile_installs_the_runtime_packages_of_host_setup():
    instructions = dockerfile_instructions()
    assert instructions[0] == ("FROM", "docker.io/library/debian:bookworm-slim")
    installed: set[str] = set()
    for word, rest in instructions:
        if word == "RUN":
            for command in rest.split("&&"):
                argv = shlex.split(command)
                if argv[:1] == ["DEBIAN_FRONTEND=noninteractive"]:
                    argv = argv[1:]
                if argv[:2] == ["apt-get", "install"]:
                    installed |= {a for a in argv[2:] if not a.startswith("-")}
    needed = host_setup_packages() - set(NOT_IN_IMAGE)
    assert needed <= installed, f"missing from the image: {sorted(needed - installed)}"
    # kernel headers are unpacked (deploy/kernel-headers.sh), not installed: that pulls in gcc
    assert not any(p.startswith("linux-headers") for p in installed)
    assert set(NOT_IN_IMAGE) <= host_setup_packages(), "NOT_IN_IMAGE names a stale package"


def test_the_image_and_host_setup_carry_the_shipped_kernel_headers_where_kpr_looks():
    from kpr.node import host

    script = DEPLOY / "kernel-headers.sh"
    runs = [rest for word, rest in dockerfile_instructions() if word == "RUN"]
    copies = [rest.split() for word, rest in dockerfile_instructions() if word == "COPY"]
    (copy,) = [c for c in copies if c[0] == "deploy/kernel-headers.sh"]
    installed_at = copy[-1].rstrip("/") + "/kernel-headers.sh"
    assert any(f"sh {installed_at} {host.SHIPPED_HEADERS}" in r for r in runs)
    # ... before the package lists it reads are removed, in the same step
    (step,) = [r for r in runs if installed_at in r]
    assert step.index(installed_at) < step.index("rm -rf /var/lib/apt/lists")
    assert f"target=${{1:-{host.SHIPPED_HEADERS}}}" in script.read_text()
    assert re.search(
        r'^\s*sh "\$here/kernel-headers.sh"$', (DEPLOY / "host-setup.sh").read_text(), re.M
    )


def test_dockerfile_copies_and_installs_the_package():
    instructions = dockerfile_instructions()
    copied: dict[str, str] = {}
    for word, rest in instructions:
        if word == "COPY":
            *sources, dest = rest.split()
            for s in sources:
                assert (ROOT / s).exists(), f"COPY {s}: no such path in the repository"
                copied[s.rstrip("/")] = dest
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.split(".")[0] for p in pyproject["tool"]["setuptools"]["packages"]}
    assert {"pyproject.toml", pyproject["project"]["readme"], *packages} <= set(copied)
    source = copied["pyproject.toml"].rstrip("/")
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert "-m venv --system-site-packages" in runs  # Debian's BCC bindings
    # a plain install of the copied tree (the BPF programs are package data), no extras
    assert re.search(rf"pip install [^&]*{re.escape(source)}( |$)", runs), runs
    assert " -e " not in runs, "the image needs no editable install"
    env = " ".join(rest for word, rest in instructions if word == "ENV")
    venv = re.search(r"(\S+)/bin/pip install", runs)
    assert venv and f"{venv[1]}/bin" in env, "the venv's kpr is not on PATH"


def test_the_image_cache_key_of_the_lab_is_what_the_dockerfile_copies():
    """The lab's kpr image is rebuilt when what deploy/Dockerfile copies changes, and only
    then (lab/kube/images.py, KPR_CONTEXT): kpr/ and bpf/, not the lab or the bench."""
    from lab.kube.images import KPR_CONTEXT

    copied = {
        source.rstrip("/")
        for word, rest in dockerfile_instructions()
        if word == "COPY"
        for source in rest.split()[:-1]
    }
    assert set(KPR_CONTEXT) == {".dockerignore", "deploy/Dockerfile", *copied}
    assert not {"lab", "bench"} & copied


def test_the_package_carries_its_bpf_programs_and_leaves_the_lab_out(tmp_path):
    """What the image installs: a wheel of the tree the Dockerfile copies. BCC compiles
    bpf/ (kpr/bpf/ once installed) from the installed package, so the programs must be in
    it; the lab's plotting dependency is an extra the agent never needs. Built here from a
    checkout's tree, lab/ and bench/ beside kpr/ (as `pip install .` of a clone sees them):
    the wheel holds kpr alone, nothing of the lab, the bench or the lab's Go modules."""
    tree = tmp_path / "src"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    skipped = shutil.ignore_patterns("__pycache__")
    for package in ("kpr", "bpf", "lab", "bench"):
        shutil.copytree(ROOT / package, tree / package, ignore=skipped)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(tree)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if built.returncode and "setuptools" in built.stderr and "No matching" in built.stderr:
        pytest.skip(f"no setuptools to build with: {built.stderr.strip()[-200:]}")
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("kpr-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        top_level = zf.read(metadata.replace("/METADATA", "/top_level.txt")).decode()
        requires = [
            line for line in zf.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]  # fmt: skip
    programs = sorted(p.name for p in abi.BPF_DIR.iterdir() if p.suffix in (".c", ".h"))
    assert {"kpr.h", "sock_lb.c", "nodeport.c"} <= set(programs)
    assert {f"kpr/bpf/{name}" for name in programs} <= names
    assert "kpr/agent/loop.py" in names and "kpr/cli/main.py" in names
    # kpr/... (kpr/bpf/ with it) and the wheel's metadata: nothing of lab/ or bench/, no Go
    dist_info = metadata.split("/")[0]
    assert {n.split("/")[0] for n in names} == {"kpr", dist_info}, sorted(names)
    assert top_level.split() == ["kpr"]
    assert not [n for n in names if n.endswith((".go", "go.mod", "go.sum"))]
    assert {n for n in names if n.endswith(".c")} == {
        f"kpr/bpf/{name}" for name in programs if name.endswith(".c")
    }
    plotting = [r for r in requires if "matplotlib" in r]
    assert plotting and all("extra ==" in r for r in plotting), requires


# --- (e) the Helm chart: the kustomization's objects, and values operators change -----------

CHART = DEPLOY / "helm" / "kpr"
# the first test to need helm builds it (about 7 minutes on 2 cores), once per cache
HELM_BUILD_TIMEOUT = pytest.mark.timeout(2400)


def helm_render(*args: str) -> list[dict]:
    from tests.support.helm import template

    out = template(CHART, *args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None]


OVERRIDES = (
    "--set", "image.repository=registry.example/kpr",
    "--set", "image.tag=1.2.3",
    "--set", "apiServer=https://10.0.0.10:6443",
    "--set", "maxServices=100000",
    "--set", "mapSizes.services=1048576",
    "--set", "mapSizes.backends=524288",
    "--set", "devices=eth0\\,eth1",
    "--set", "cgroup=/sys/fs/cgroup/unified",
    "--set-json", 'nodeSelector={"kubernetes.io/os":"linux","node-role/kpr":"yes"}',
    "--set-json", 'tolerations=[{"key":"dedicated","operator":"Equal","value":"edge"}]',
    "--set-json", 'resources={"requests":{"cpu":"200m"},"limits":{"memory":"1Gi"}}',
)  # fmt: skip


@HELM_BUILD_TIMEOUT
def test_helm_chart_renders_the_kustomizations_objects():
    def keyed(docs: list[dict]) -> dict[tuple[str, str], dict]:
        return {(d["kind"], d["metadata"]["name"]): d for d in docs}

    assert keyed(helm_render()) == keyed(render(DEPLOY))


@HELM_BUILD_TIMEOUT
@pytest.mark.parametrize("values", [(), OVERRIDES], ids=["defaults", "overrides"])
def test_helm_chart_validates_against_the_schemas(values):
    docs = helm_render(*values)
    assert {d["kind"] for d in docs} == {
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet"
    }  # fmt: skip
    for doc in docs:
        _validate(doc, f"helm template {CHART.relative_to(ROOT)}")


@HELM_BUILD_TIMEOUT
def test_helm_values_reach_the_daemonset_as_kpr_parses_it():
    docs = by_kind(helm_render(*OVERRIDES))
    ds = docs["DaemonSet"]
    params = parsed_args(ds, docs["ConfigMap"])
    assert params["master"] == "https://10.0.0.10:6443"
    assert abi.MapSizes.parse(params["map_sizes"]) == abi.MapSizes(
        services=1048576, backends=524288
    )
    assert params["max_services"] == 100000
    assert params["devices"] == "eth0,eth1"
    assert str(params["cgroup"]) == "/sys/fs/cgroup/unified"
    mount, volume = covering_mount(ds, params["cgroup"])
    assert volume["hostPath"]["path"] == mount["mountPath"] == "/sys/fs/cgroup/unified"
    pod = ds["spec"]["template"]["spec"]
    assert {c["image"] for c in pod["containers"] + pod["initContainers"]} == {
        "registry.example/kpr:1.2.3"
    }
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux", "node-role/kpr": "yes"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "edge"}]
    assert container(ds)["resources"]["limits"] == {"memory": "1Gi"}


@HELM_BUILD_TIMEOUT
def test_helm_chart_refuses_an_empty_api_server():
    from tests.support.helm import template

    out = template(CHART, "--set", "apiServer=")
    assert out.returncode != 0 and "apiServer" in out.stderr
