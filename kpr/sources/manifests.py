"""The manifest-directory source: Services and EndpointSlices read from YAML and JSON files.

Files hold what `kubectl get -o yaml` prints (several documents, or a List).
The objects feed a change tracker (kpr/sources/tracker.py): after the first poll,
a snapshot holds only the Services whose objects changed, so editing one file of a
large directory re-translates only what that file defines.
Bad input never takes away what was working: a file that does not parse keeps
its objects from the last good read, an invalid object keeps its last good
version, and each problem names the file, the object and the field.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kpr.model import EndpointSlice, ObjectRef, Problem, Service, Snapshot
from kpr.sources.objects import ObjectError, parse_object
from kpr.sources.tracker import ChangeTracker

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
POLL_INTERVAL = 0.2  # seconds between looks at the directory

KubeObject = Service | EndpointSlice

# libyaml's parser when present: ten times faster on large directories
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class _Definition:
    """One object as a file defines it; `obj` is None when invalid with no good version."""

    ref: ObjectRef
    obj: KubeObject | None
    source: str


class _FileError(Exception):
    """A whole file could not be read or parsed."""


class ManifestSource:
    """Reads a directory of manifests, recursively, when anything in it changes."""

    def __init__(self, directory: Path) -> None:
        if not directory.is_dir():
            what = "is not a directory" if directory.exists() else "does not exist"
            raise NotADirectoryError(f"manifest directory {directory} {what}")
        self.directory = directory
        self._stamps: dict[str, tuple[int, int]] | None = None
        self._polled = False
        self._woken = threading.Event()  # `wake`
        self._definitions: dict[str, list[_Definition]] = {}  # per file, from its last good read
        self._objects: dict[ObjectRef, KubeObject] = {}  # in the last snapshot
        self._tracker = ChangeTracker()
        # per file: (stamp, definitions, problems) of its last read
        self._files: dict[str, tuple[tuple[int, int], list[_Definition], list[Problem]]] = {}

    @property
    def description(self) -> str:
        return f"manifests:{self.directory.resolve()}"

    def start(self) -> None:
        pass  # nothing runs in the background: poll() reads the directory

    def stop(self) -> None:
        pass

    def wait(self, timeout: float) -> bool:
        """Until a file changed or `wake` was called (True), or `timeout` passed (False)."""
        deadline = time.monotonic() + timeout
        while True:
            if self._woken.is_set() or (self._polled and self._scan() != self._stamps):
                self._woken.clear()
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(POLL_INTERVAL, remaining))

    def wake(self) -> None:
        self._woken.set()

    def status(self) -> dict:
        return {}  # no watches: the directory is read when it changes

    def resync(self) -> None:
        self._polled = False  # the next poll reads the directory even if nothing changed
        self._tracker.resync()  # and returns the whole state

    def pending(self) -> tuple[int, int]:
        """Changes are read at the poll: none wait in between."""
        return 0, 0

    @property
    def synced_at(self) -> float | None:
        """No list to time: the directory is read whole at the first poll."""
        return None

    def poll(self) -> Snapshot | None:
        """The whole state on the first call (and after `resync`), then what changed: the
        Services whose objects changed, and every problem; None when no file changed."""
        stamps = self._scan()
        if self._polled and stamps == self._stamps:
            return None
        self._polled = True
        self._stamps = stamps
        problems: list[Problem] = []
        if stamps is None:
            # Gone, perhaps while being replaced: serving nothing would drop every Service.
            problems.append(
                Problem(f"manifest directory {self.directory} is gone; keeping what it defined")
            )
            definitions = self._definitions
        else:
            definitions = {}
            for name in sorted(stamps):
                # unchanged files keep their objects and their problems: a large
                # directory is not re-parsed because one file changed
                cached = self._files.get(name)
                if cached is None or cached[0] != stamps[name]:
                    file_problems: list[Problem] = []
                    cached = (stamps[name], self._read_file(name, file_problems), file_problems)
                    self._files[name] = cached
                definitions[name] = cached[1]
                problems.extend(cached[2])
            self._files = {name: self._files[name] for name in stamps}
        self._definitions = definitions
        return self._snapshot(definitions, problems)

    def _scan(self) -> dict[str, tuple[int, int]] | None:
        """(mtime_ns, size) of each manifest file by relative path; None: the directory is gone."""
        if not self.directory.is_dir():
            return None
        stamps = {}
        for root, dirs, files in os.walk(self.directory):
            # Hidden entries are editor temporaries, or the `..data` copies of a mounted ConfigMap.
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for file_name in files:
                if file_name.startswith(".") or not file_name.endswith(MANIFEST_SUFFIXES):
                    continue
                path = Path(root, file_name)
                try:
                    stat = path.stat()
                except OSError:
                    continue  # removed while scanning; the next poll sees the result
                stamps[path.relative_to(self.directory).as_posix()] = (
                    stat.st_mtime_ns,
                    stat.st_size,
                )
        return stamps

    def _read_file(self, name: str, problems: list[Problem]) -> list[_Definition]:
        """The objects a file defines; its last good ones when it cannot be parsed."""
        definitions = []
        try:
            # documents are validated as they are parsed, so a large file never
            # holds all its raw dicts at once
            for location, document in _objects(_load(self.directory / name), name, problems):
                definition = self._define(name, location, document, problems)
                if definition is not None:
                    definitions.append(definition)
        except _FileError as error:
            kept = self._definitions.get(name, [])
            plural = "" if len(kept) == 1 else "s"
            consequence = (
                f"keeping the {len(kept)} object{plural} it defined before"
                if kept
                else "nothing from it is used"
            )
            problems.append(Problem(f"{error}; {consequence}", source=name))
            return kept
        return definitions

    def _define(
        self, name: str, location: str, document: object, problems: list[Problem]
    ) -> _Definition | None:
        """Validate one document, falling back to the object's version in the last snapshot."""
        if not isinstance(document, dict):
            problems.append(
                Problem(f"{location} is not a Kubernetes object (a mapping); ignored", source=name)
            )
            return None
        try:
            obj = parse_object(document)
        except ObjectError as error:
            if error.ref is None:
                problems.append(
                    Problem(f"{error.message} ({location})", field=error.field, source=name)
                )
                return None
            kept = self._objects.get(error.ref)
            consequence = "its last good version is kept" if kept else "it is skipped"
            problems.append(
                Problem(f"{error.message}; {consequence}", error.ref, error.field, name)
            )
            return _Definition(error.ref, kept, name)
        if obj is None:
            kind = f"{document.get('apiVersion', '')} {document.get('kind', '')}".strip()
            problems.append(
                Problem(
                    f"kind {kind or '(none)'} is not one kpr reads ({location}); ignored",
                    source=name,
                )
            )
            return None
        return _Definition(obj.ref, obj, name)

    def _snapshot(
        self, definitions: dict[str, list[_Definition]], problems: list[Problem]
    ) -> Snapshot:
        """Resolve duplicates (the first by path and document order wins), feed the
        tracker the objects that changed, and take the Snapshot of what changed."""
        first: dict[ObjectRef, _Definition] = {}
        for name in sorted(definitions):
            for definition in definitions[name]:
                winner = first.setdefault(definition.ref, definition)
                if winner is not definition:
                    problems.append(
                        Problem(
                            f"also defined in {winner.source}, which is used",
                            definition.ref,
                            source=name,
                        )
                    )
        objects = {ref: d.obj for ref, d in first.items() if d.obj is not None}
        for ref in self._objects.keys() - objects.keys():
            self._tracker.delete(ref)
        for ref, obj in objects.items():
            before = self._objects.get(ref)
            if before is not obj and before != obj:  # (unchanged files keep their objects)
                self._tracker.upsert(obj)
        self._objects = objects
        changes = self._tracker.take()
        if changes is not None and changes.changed is not None:
            return Snapshot(changes.services, changes.slices, problems, changes.changed)
        if changes is None:  # files changed, objects did not (a problem may have)
            return Snapshot([], [], problems, changed=set())
        # the whole state, in the order of the files
        return Snapshot(
            services=[obj for obj in objects.values() if isinstance(obj, Service)],
            slices=[obj for obj in objects.values() if isinstance(obj, EndpointSlice)],
            problems=problems,
        )


def _load(path: Path) -> Iterator[Any]:
    """The documents of one file, one at a time; _FileError says where it is broken."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise _FileError(f"cannot be read: {error}") from None
    if path.suffix == ".json":
        try:
            yield json.loads(text)
        except json.JSONDecodeError as error:
            raise _FileError(f"not valid JSON at line {error.lineno}: {error.msg}") from None
        return
    try:
        yield from yaml.load_all(text, Loader=_LOADER)
    except yaml.MarkedYAMLError as error:
        line = f" at line {error.problem_mark.line + 1}" if error.problem_mark else ""
        raise _FileError(f"not valid YAML{line}: {error.problem or error.context}") from None
    except yaml.YAMLError as error:
        raise _FileError(f"not valid YAML: {error}") from None


def _objects(
    documents: Iterator[Any], source: str, problems: list[Problem]
) -> Iterator[tuple[str, object]]:
    """Each object with where it is in the file; Lists unpacked, empty documents skipped."""
    for index, document in enumerate(documents, start=1):
        yield from _unpack(f"document {index}", document, source, problems)


def _unpack(
    location: str, document: object, source: str, problems: list[Problem]
) -> Iterator[tuple[str, object]]:
    if document is None:
        return
    if not isinstance(document, dict) or not str(document.get("kind")).endswith("List"):
        yield location, document
        return
    kind = document["kind"]
    items = document.get("items") or []
    if not isinstance(items, list):
        problems.append(Problem(f"{location}: {kind} items must be a list", source=source))
        return
    # The API's typed lists (ServiceList, EndpointSliceList) leave kind out of their items.
    item_kind = kind.removesuffix("List")
    for index, item in enumerate(items):
        if item_kind and isinstance(item, dict) and "kind" not in item:
            item = {"apiVersion": document.get("apiVersion"), "kind": item_kind, **item}
        yield from _unpack(f"{location}, items[{index}]", item, source, problems)
