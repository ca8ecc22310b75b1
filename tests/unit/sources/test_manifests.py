"""The manifest-directory source (kpr/sources/manifests.py)."""

from __future__ import annotations

import json
import os
from ipaddress import ip_address
from pathlib import Path

import pytest

from kpr.desired.state import translate
from kpr.model import Frontend, NodeContext, ObjectRef
from kpr.sources.manifests import ManifestSource, Snapshot

WEB = """\
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: default
spec:
  clusterIP: 10.96.0.10
  ports:
  - name: http
    port: {port}
    protocol: TCP
"""

API = """\
apiVersion: v1
kind: Service
metadata:
  name: api
spec:
  clusterIP: 10.96.0.11
  ports:
  - name: http
    port: 80
"""

WEB_SLICE = """\
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc12
  namespace: default
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
endpoints:
- addresses: ["10.244.1.11"]
ports:
- name: http
  port: 8080
  protocol: TCP
"""


def write(path: Path, text: str) -> None:
    """Write, and move the mtime on so a same-size rewrite is still a change."""
    existed = path.exists()
    before = path.stat().st_mtime_ns if existed else 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if existed:
        os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


def poll(source: ManifestSource) -> Snapshot:
    snapshot = source.poll()
    assert snapshot is not None
    return snapshot


def whole(source: ManifestSource) -> Snapshot:
    """The whole state the source holds (after the first poll, a snapshot holds only
    what changed)."""
    source.resync()
    snapshot = poll(source)
    assert snapshot.changed is None
    return snapshot


def refs(snapshot: Snapshot) -> list[ObjectRef]:
    return [obj.ref for obj in [*snapshot.services, *snapshot.slices]]


def messages(snapshot: Snapshot) -> list[str]:
    return [str(problem) for problem in snapshot.problems]


# --- reading -------------------------------------------------------------------------


def test_first_poll_reads_every_manifest_recursively(tmp_path: Path) -> None:
    write(tmp_path / "services.yaml", WEB.format(port=80) + "---\n" + API)
    write(tmp_path / "slices" / "web.yml", WEB_SLICE)
    snapshot = poll(ManifestSource(tmp_path))
    assert [s.name for s in snapshot.services] == ["web", "api"]
    assert [s.name for s in snapshot.slices] == ["web-abc12"]
    assert snapshot.problems == []


def test_api_json_files_are_read(tmp_path: Path) -> None:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]},
    }
    write(tmp_path / "web.json", json.dumps(service, indent="\t"))
    assert [s.name for s in poll(ManifestSource(tmp_path)).services] == ["web"]


def test_list_items_and_empty_documents_are_read(tmp_path: Path) -> None:
    listing = "apiVersion: v1\nkind: List\nitems:\n" + "".join(
        "- " + doc.replace("\n", "\n  ").rstrip() + "\n" for doc in (WEB.format(port=80), API)
    )
    write(tmp_path / "all.yaml", "---\n---\n" + listing + "---\n")
    assert [s.name for s in poll(ManifestSource(tmp_path)).services] == ["web", "api"]


def test_typed_api_lists_give_their_items_a_kind(tmp_path: Path) -> None:
    listing = {
        "apiVersion": "v1",
        "kind": "ServiceList",
        "items": [{"metadata": {"name": "web"}, "spec": {"clusterIP": "10.96.0.10"}}],
    }
    write(tmp_path / "services.json", json.dumps(listing))
    assert [s.name for s in poll(ManifestSource(tmp_path)).services] == ["web"]


def test_hidden_files_and_other_suffixes_are_not_read(tmp_path: Path) -> None:
    write(tmp_path / "web.yaml", WEB.format(port=80))
    write(tmp_path / ".web.yaml.swp", "garbage: [")
    write(tmp_path / "notes.txt", "garbage: [")
    write(tmp_path / "..2024_05_14" / "api.yaml", API)  # a mounted ConfigMap's copy
    snapshot = poll(ManifestSource(tmp_path))
    assert [s.name for s in snapshot.services] == ["web"]
    assert snapshot.problems == []


def test_missing_directory_is_an_error_at_construction(tmp_path: Path) -> None:
    with pytest.raises(NotADirectoryError, match="does not exist"):
        ManifestSource(tmp_path / "nowhere")


# --- change detection -------------------------------------------------------------------------


def test_poll_returns_none_until_something_changes(tmp_path: Path) -> None:
    source = ManifestSource(tmp_path)
    assert poll(source).services == []
    assert source.poll() is None
    write(tmp_path / "web.yaml", WEB.format(port=80))
    assert [s.name for s in poll(source).services] == ["web"]
    assert source.poll() is None


def test_edit_of_the_same_size_is_a_change(tmp_path: Path) -> None:
    source = ManifestSource(tmp_path)
    write(tmp_path / "web.yaml", WEB.format(port=80))
    poll(source)
    write(tmp_path / "web.yaml", WEB.format(port=81))
    assert poll(source).services[0].ports[0].port == 81


def test_removed_file_removes_its_objects(tmp_path: Path) -> None:
    write(tmp_path / "web.yaml", WEB.format(port=80))
    write(tmp_path / "api.yaml", API)
    source = ManifestSource(tmp_path)
    poll(source)
    (tmp_path / "api.yaml").unlink()
    change = poll(source)
    assert change.changed == {("default", "api")} and change.services == []
    assert [s.name for s in whole(source).services] == ["web"]


def test_directory_that_vanishes_keeps_what_it_defined(tmp_path: Path) -> None:
    directory = tmp_path / "manifests"
    write(directory / "web.yaml", WEB.format(port=80))
    source = ManifestSource(directory)
    poll(source)
    (directory / "web.yaml").unlink()
    directory.rmdir()
    change = poll(source)
    assert change.changed == set() and "is gone" in messages(change)[0]
    snapshot = whole(source)
    assert [s.name for s in snapshot.services] == ["web"]
    assert "is gone" in messages(snapshot)[0]


def test_after_the_first_poll_a_snapshot_holds_only_the_services_whose_objects_changed(
    tmp_path: Path,
) -> None:
    for i in range(20):
        write(tmp_path / f"svc-{i:02}.yaml", WEB.format(port=80).replace("web", f"web-{i}"))
    write(tmp_path / "slices" / "web-3.yaml", WEB_SLICE.replace("web", "web-3"))
    source = ManifestSource(tmp_path)
    assert len(poll(source).services) == 20  # the first: everything
    write(tmp_path / "svc-07.yaml", WEB.replace("web", "web-7").format(port=8080))
    change = poll(source)
    assert change.changed == {("default", "web-7")}
    assert [(s.name, s.ports[0].port) for s in change.services] == [("web-7", 8080)]
    assert change.slices == []
    # a slice's change hands over its Service with it
    write(tmp_path / "slices" / "web-3.yaml", WEB_SLICE.replace("web", "web-3") + "  ")
    change = poll(source)
    assert change.changed == set()  # the same objects: nothing to translate again
    write(
        tmp_path / "slices" / "web-3.yaml", WEB_SLICE.replace("web", "web-3").replace(".11", ".12")
    )
    change = poll(source)
    assert change.changed == {("default", "web-3")}
    assert [s.name for s in change.services] == ["web-3"]
    assert [s.name for s in change.slices] == ["web-3-abc12"]


# --- bad input ------------------------------------------------------------------------------


def test_yaml_error_names_the_file_and_line_and_keeps_its_last_good_objects(
    tmp_path: Path,
) -> None:
    write(tmp_path / "services.yaml", WEB.format(port=80))
    write(tmp_path / "api.yaml", API)
    source = ManifestSource(tmp_path)
    poll(source)
    write(tmp_path / "services.yaml", WEB.format(port=80) + "  - name: [broken\n")
    change = poll(source)
    assert change.changed == set() and len(change.problems) == 1  # nothing else changed
    snapshot = whole(source)
    assert [s.name for s in snapshot.services] == ["api", "web"]
    (problem,) = messages(snapshot)
    assert problem.startswith("services.yaml: not valid YAML at line 13: ")
    assert problem.endswith("; keeping the 1 object it defined before")


def test_yaml_error_in_a_new_file_uses_nothing_from_it(tmp_path: Path) -> None:
    write(tmp_path / "api.yaml", API)
    write(tmp_path / "broken.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: x\n")
    snapshot = poll(ManifestSource(tmp_path))
    assert [s.name for s in snapshot.services] == ["api"]
    (problem,) = messages(snapshot)
    assert problem.startswith("broken.yaml: not valid YAML at line 4: ")
    assert problem.endswith("; nothing from it is used")


def test_json_error_names_the_file_and_line(tmp_path: Path) -> None:
    write(tmp_path / "web.json", '{\n  "kind": "Service",\n  oops\n}')
    (problem,) = messages(poll(ManifestSource(tmp_path)))
    assert problem.startswith("web.json: not valid JSON at line 3: ")


def test_invalid_object_names_file_object_and_field_and_others_keep_working(
    tmp_path: Path,
) -> None:
    write(tmp_path / "services.yaml", WEB.format(port=65536) + "---\n" + API)
    snapshot = poll(ManifestSource(tmp_path))
    assert [s.name for s in snapshot.services] == ["api"]
    assert messages(snapshot) == [
        "services.yaml: Service default/web: spec.ports[0].port: "
        "65536 is not a valid port (1-65535); it is skipped"
    ]


def test_bad_edit_keeps_the_last_good_version_of_the_object(tmp_path: Path) -> None:
    write(tmp_path / "services.yaml", WEB.format(port=80) + "---\n" + API)
    write(tmp_path / "slices.yaml", WEB_SLICE)
    source = ManifestSource(tmp_path)
    poll(source)
    write(tmp_path / "services.yaml", WEB.format(port=0) + "---\n" + API)
    assert poll(source).changed == set()  # the last good version: no change
    snapshot = whole(source)
    assert messages(snapshot) == [
        "services.yaml: Service default/web: spec.ports[0].port: "
        "0 is not a valid port (1-65535); its last good version is kept"
    ]
    translation = translate(snapshot.services, snapshot.slices, NodeContext())
    web = translation.frontends[Frontend(ip_address("10.96.0.10"), 80, "TCP")]
    assert [str(b) for b in web.backends] == ["10.244.1.11:8080"]
    assert Frontend(ip_address("10.96.0.11"), 80, "TCP") in translation.frontends
    # Still bad on the next edit elsewhere: the same good version is kept.
    write(tmp_path / "slices.yaml", WEB_SLICE.replace("10.244.1.11", "10.244.1.12"))
    snapshot = poll(source)
    assert snapshot.changed == {("default", "web")}
    assert snapshot.services[0].ports[0].port == 80
    # Fixed: the new version is used.
    write(tmp_path / "services.yaml", WEB.format(port=81) + "---\n" + API)
    snapshot = poll(source)
    assert snapshot.services[0].ports[0].port == 81
    assert snapshot.problems == []


def test_object_without_name_is_reported_with_its_document(tmp_path: Path) -> None:
    write(tmp_path / "web.yaml", API + "---\n" + WEB.format(port=80).replace("  name: web\n", ""))
    snapshot = poll(ManifestSource(tmp_path))
    assert [s.name for s in snapshot.services] == ["api"]
    assert messages(snapshot) == [
        "web.yaml: metadata.name: a Service must have a name (document 2)"
    ]


def test_unknown_kind_is_a_warning_naming_file_and_kind(tmp_path: Path) -> None:
    write(tmp_path / "extras.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    write(tmp_path / "api.yaml", API)
    snapshot = poll(ManifestSource(tmp_path))
    assert [s.name for s in snapshot.services] == ["api"]
    assert messages(snapshot) == [
        "extras.yaml: kind v1 ConfigMap is not one kpr reads (document 1); ignored"
    ]


def test_document_that_is_not_a_mapping_is_reported(tmp_path: Path) -> None:
    write(tmp_path / "odd.yaml", "- just\n- a list\n")
    assert messages(poll(ManifestSource(tmp_path))) == [
        "odd.yaml: document 1 is not a Kubernetes object (a mapping); ignored"
    ]


def test_same_object_in_two_files_the_first_path_wins_and_both_are_named(
    tmp_path: Path,
) -> None:
    write(tmp_path / "a.yaml", WEB.format(port=80))
    write(tmp_path / "b.yaml", WEB.format(port=81))
    snapshot = poll(ManifestSource(tmp_path))
    assert [s.ports[0].port for s in snapshot.services] == [80]
    assert messages(snapshot) == [
        "b.yaml: Service default/web: also defined in a.yaml, which is used"
    ]


def test_same_object_twice_in_one_file_the_first_document_wins(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", WEB.format(port=80) + "---\n" + WEB.format(port=81))
    snapshot = poll(ManifestSource(tmp_path))
    assert [s.ports[0].port for s in snapshot.services] == [80]
    assert messages(snapshot) == [
        "a.yaml: Service default/web: also defined in a.yaml, which is used"
    ]


def test_service_and_slice_of_one_name_are_different_objects(tmp_path: Path) -> None:
    write(tmp_path / "web.yaml", WEB.format(port=80))
    write(tmp_path / "slice.yaml", WEB_SLICE.replace("name: web-abc12", "name: web"))
    snapshot = poll(ManifestSource(tmp_path))
    assert refs(snapshot) == [
        ObjectRef("Service", "default", "web"),
        ObjectRef("EndpointSlice", "default", "web"),
    ]
    assert snapshot.problems == []
