"""Fuzzing the object parser and the manifest source with hypothesis: whatever the
input, the answer is an object, an ObjectError naming the field, or a problem —
never a crash or an unhandled exception."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kpr.desired.state import translate
from kpr.model import NodeContext
from kpr.sources.manifests import ManifestSource
from kpr.sources.objects import ObjectError, parse_object

# field names the parser looks at, so the fuzzer reaches deep into objects
FIELDS = [
    "apiVersion",
    "kind",
    "metadata",
    "name",
    "namespace",
    "labels",
    "annotations",
    "spec",
    "type",
    "clusterIP",
    "clusterIPs",
    "ports",
    "port",
    "protocol",
    "nodePort",
    "targetPort",
    "externalIPs",
    "sessionAffinity",
    "sessionAffinityConfig",
    "clientIP",
    "timeoutSeconds",
    "internalTrafficPolicy",
    "externalTrafficPolicy",
    "addressType",
    "endpoints",
    "addresses",
    "conditions",
    "ready",
    "serving",
    "terminating",
    "nodeName",
    "zone",
    "hints",
    "forNodes",
    "forZones",
    "items",
    "kubernetes.io/service-name",
]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.sampled_from(
        ["v1", "Service", "EndpointSlice", "discovery.k8s.io/v1", "TCP", "UDP", "SCTP",
         "IPv4", "IPv6", "FQDN", "10.96.0.10", "fd00::1", "None", "ClientIP", "Local", "80"]
    ),
)  # fmt: skip
VALUES = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), children, max_size=6)
    ),
    max_leaves=30,
)
OBJECTS = st.fixed_dictionaries(
    {"apiVersion": st.sampled_from(["v1", "discovery.k8s.io/v1"]),
     "kind": st.sampled_from(["Service", "EndpointSlice"])},
    optional={"metadata": VALUES, "spec": VALUES, "endpoints": VALUES, "ports": VALUES,
              "addressType": VALUES},
)  # fmt: skip


@settings(max_examples=1500, deadline=None)
@given(OBJECTS)
def test_the_parser_answers_every_object_with_a_result_or_a_named_error(obj):
    try:
        parsed = parse_object(obj)
    except ObjectError as err:
        assert err.field and str(err)
        return
    if parsed is not None:  # and what parses, translates
        translate([parsed] if parsed.ref.kind == "Service" else [], [], NodeContext("n"))


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.binary(max_size=300) | st.text(max_size=300), min_size=1, max_size=3))
def test_the_manifest_source_turns_any_file_into_problems_not_exceptions(tmp_path: Path, files):
    for i, content in enumerate(files):
        path = tmp_path / f"f{i}.yaml"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    snapshot = ManifestSource(tmp_path).poll()
    assert snapshot is not None
    translate(snapshot.services, snapshot.slices, NodeContext("n"))
