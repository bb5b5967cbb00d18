"""Property-based: whatever a caller sends, the aggregator never answers INTERNAL, and a refused call changes no row.

Hypothesis builds fedatoms.v1 request messages with hostile values (NUL bytes, megabyte-long and
non-printable names, rounds and counts up to 2^63−1, NaN and infinite numbers, unknown enum
values) and undecodable bytes, and sends them over a real channel to a real aggregator on an
ephemeral loopback port, on SQLite and on PostgreSQL. The oracle is the contract itself: every
status is one the protocol names for a caller's error (or OK), and the database is read back
after each refused call and compared with what it held before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import grpc
import pytest
from grpc_helpers import SECRET, register, shards, snapshot, start_aggregator
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from support import postgres_base, postgres_schema

from aggregator_service import store
from fedwire.v1 import aggregator_pb2 as pb

EXAMPLES = 15
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
EDGE_INTS = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, -(2**63)]) | INT64
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
TEXT = st.text(max_size=40) | st.sampled_from(["", "a\x00b", "x" * 3_000_000, "é\n\r\t", "a" * 129])
PURPOSES = st.integers(min_value=0, max_value=2**31 - 1)

# what the protocol answers a caller's mistake with; INTERNAL and UNKNOWN are server faults
CALLER_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.NOT_FOUND,
}
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def live(request, tmp_path_factory) -> Iterator[tuple[object, object]]:
    """A real aggregator over the backend with one enrolled client (the caller of authenticated RPCs)."""
    with ExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'fedatoms.db'}"
        else:
            url = stack.enter_context(postgres_schema(postgres_base()))
        svc = start_aggregator(url)
        stack.callback(svc.stop)
        yield svc, register(svc.stub, 1.0, shards(1)[0])


def _rows(url: str) -> dict[str, object]:
    """snapshot() and the rows snapshot leaves out that a request could write: evaluations and profiles."""
    engine = store.create_engine_for(url)
    try:
        with Session(engine) as s:
            extra = {
                "evaluations": s.scalar(select(func.count()).select_from(store.Evaluation)),
                "profiles": sorted(
                    (cid, repr(p)) for cid, p in s.execute(select(store.Client.id, store.Client.profile)).all()
                ),
            }
    finally:
        engine.dispose()
    return {**snapshot(url), **extra}


def _call(svc, method: str, payload, auth: tuple = (), stream: bool = False) -> grpc.StatusCode:
    """Send ``payload`` (a message, bytes, or for a stream a list of either) as the raw method; its status."""
    path = f"/fedatoms.v1.Aggregator/{method}"

    def raw(p) -> bytes:
        return p if isinstance(p, bytes) else p.SerializeToString()

    try:
        if stream:
            svc.channel.stream_unary(path)(iter([raw(p) for p in payload]), metadata=auth, timeout=60)
        elif method == "FetchModel":
            for _ in svc.channel.unary_stream(path)(raw(payload), metadata=auth, timeout=60):
                pass
        else:
            svc.channel.unary_unary(path)(raw(payload), metadata=auth, timeout=60)
    except grpc.RpcError as exc:
        assert exc.code() in CALLER_ERRORS, f"{method}: {exc.code().name} {exc.details()}"
        return exc.code()
    return grpc.StatusCode.OK


def _check(svc, method: str, payload, auth: tuple = (), stream: bool = False) -> None:
    before = _rows(svc.url)
    code = _call(svc, method, payload, auth, stream)
    if code != grpc.StatusCode.OK:
        assert _rows(svc.url) == before, f"{method} refused with {code.name} but changed the database"


profiles = st.builds(
    pb.CapabilityProfile,
    device_name=TEXT,
    compute_macs=st.none() | FLOATS,
    memory_bytes=st.none() | EDGE_INTS,
    uplink_bps=st.none() | FLOATS,
    downlink_bps=st.none() | FLOATS,
    num_samples=EDGE_INTS,
    preferred_tier=st.none() | FLOATS,
)
registers = st.builds(
    pb.RegisterRequest,
    profile=profiles,
    enrollment_secret=st.sampled_from([SECRET, SECRET, "wrong"]) | TEXT,
    client_name=st.none() | TEXT,
)
chunks = st.builds(
    pb.TensorChunk,
    name=TEXT | st.sampled_from(["conv1.atoms", "head.bias", "fc1.weight_u"]),
    dtype=st.sampled_from(["float32", "float16", "int64", "complex64"]) | TEXT,
    shape=st.lists(EDGE_INTS, max_size=4),
    version=EDGE_INTS,
    offset=EDGE_INTS,
    data=st.binary(max_size=64),
    total_bytes=EDGE_INTS,
    kind=st.integers(min_value=0, max_value=5),
)
headers = st.builds(
    pb.PushHeader,
    round=EDGE_INTS,
    update_id=TEXT | st.just("u-1"),
    num_samples=EDGE_INTS,
    metrics=st.dictionaries(TEXT, FLOATS, max_size=3),
)
pushes = st.tuples(headers, st.lists(chunks, max_size=3)).map(
    lambda hc: [pb.PushMessage(header=hc[0]), *(pb.PushMessage(chunk=c) for c in hc[1])]
)
reports = st.builds(
    pb.EvaluationReport,
    round=EDGE_INTS,
    global_accuracy=FLOATS,
    global_loss=FLOATS,
    personalized_accuracy=st.none() | FLOATS,
    num_samples=EDGE_INTS,
)
fetches = st.builds(
    pb.FetchRequest,
    held=st.lists(st.builds(pb.TensorVersion, name=TEXT, version=EDGE_INTS), max_size=3),
    include_server_control=st.none() | st.booleans(),
    round=st.none() | EDGE_INTS,
    purpose=PURPOSES,
)
METHODS = ["Register", "Heartbeat", "GetTask", "FetchModel", "PushUpdate", "ReportEvaluation"]


@SETTINGS
@given(request=registers)
def test_register(live, request) -> None:
    svc, _ = live
    _check(svc, "Register", request)


@SETTINGS
@given(messages=pushes)
def test_push_update(live, messages) -> None:
    svc, client = live
    _check(svc, "PushUpdate", messages, client.auth, stream=True)


@SETTINGS
@given(report=reports, along=st.booleans())
def test_report_evaluation_and_get_task(live, report, along) -> None:
    svc, client = live
    if along:  # a report sent along with GetTask is recorded the same way
        _check(svc, "GetTask", pb.GetTaskRequest(report=report), client.auth)
    else:
        _check(svc, "ReportEvaluation", report, client.auth)


@SETTINGS
@given(request=fetches)
def test_fetch_model(live, request) -> None:
    svc, client = live
    _check(svc, "FetchModel", request, client.auth)


@SETTINGS
@given(method=st.sampled_from(METHODS), data=st.binary(min_size=1, max_size=64), authed=st.booleans())
def test_undecodable_bytes_are_invalid_argument(live, method, data, authed) -> None:
    svc, client = live
    auth = client.auth if authed else ()
    payload = [data] if method == "PushUpdate" else data
    before = _rows(svc.url)
    code = _call(svc, method, payload, auth, stream=method == "PushUpdate")
    if code != grpc.StatusCode.OK:
        assert _rows(svc.url) == before


@pytest.mark.parametrize(
    ("method", "payload"),
    [
        ("Register", b"\xff\xff\xff"),  # a truncated varint: "Exception deserializing request!" before the fix
        ("GetTask", b"\x0a\x05ab"),  # a length-delimited field running past the end
        ("PushUpdate", [b"\x0a\xff\xff\xff\xff\x0f"]),
    ],
)
def test_known_undecodable_requests_are_invalid_argument(live, method, payload) -> None:
    svc, client = live
    code = _call(svc, method, payload, client.auth, stream=method == "PushUpdate")
    assert code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("method", "payload"),
    [
        (
            "Register",
            pb.RegisterRequest(
                profile=pb.CapabilityProfile(num_samples=5), enrollment_secret=SECRET, client_name="a\x00b"
            ),
        ),
        (
            "Register",
            pb.RegisterRequest(
                profile=pb.CapabilityProfile(device_name="d" * 3_000_000, num_samples=5), enrollment_secret=SECRET
            ),
        ),
        ("Register", pb.RegisterRequest(profile=pb.CapabilityProfile(num_samples=-7), enrollment_secret=SECRET)),
        ("ReportEvaluation", pb.EvaluationReport(round=2**63 - 1, global_accuracy=0.5, global_loss=1.0, num_samples=1)),
        ("PushUpdate", [pb.PushMessage(header=pb.PushHeader(round=2**63 - 1, update_id="u", num_samples=1))]),
        (
            "PushUpdate",
            [pb.PushMessage(header=pb.PushHeader(round=1, update_id="u", num_samples=1, metrics={"lo\x00ss": 1.0}))],
        ),
    ],
)
def test_nul_bytes_huge_names_and_huge_rounds_are_invalid_argument(live, method, payload) -> None:
    """The issue's cases: INTERNAL on PostgreSQL (DataError, integer out of range) before the bounds."""
    svc, client = live
    before = _rows(svc.url)
    code = _call(svc, method, payload, client.auth, stream=method == "PushUpdate")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert _rows(svc.url) == before


def _header() -> pb.PushMessage:
    return pb.PushMessage(header=pb.PushHeader(round=1, update_id="u-shape", num_samples=1))


def _chunk(name: str, shape: list[int], nbytes: int = 0) -> pb.PushMessage:
    data = b"\0" * nbytes
    return pb.PushMessage(
        chunk=pb.TensorChunk(
            name=name, dtype="float32", shape=shape, total_bytes=nbytes, data=data, kind=pb.TENSOR_KIND_MODEL
        )
    )


@pytest.mark.parametrize(
    ("shape", "nbytes", "said"),
    [
        ([1] * 65, 4, "65 dimensions, at most 32"),  # numpy holds 64: its reshape raised ValueError (INTERNAL)
        ([1] * 33, 4, "33 dimensions, at most 32"),
        ([2**62, 2**62, 0], 0, "no array is this large"),  # 0 bytes, but numpy refuses the shape
        ([0, 2**63 - 1, 2**63 - 1], 0, "no array is this large"),
        ([2**40, 2**40], 0, "no array is this large"),
    ],
    ids=["65-dims", "33-dims", "huge-with-zero", "max-with-zero", "huge"],
)
def test_a_shape_no_array_can_have_is_invalid_argument(live, shape, nbytes, said) -> None:
    svc, client = live
    before = _rows(svc.url)
    with pytest.raises(grpc.RpcError) as info:
        svc.channel.stream_unary("/fedatoms.v1.Aggregator/PushUpdate")(
            iter([m.SerializeToString() for m in (_header(), _chunk("conv1.atoms", shape, nbytes))]),
            metadata=client.auth,
            timeout=60,
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert said in info.value.details()
    assert _rows(svc.url) == before


def test_a_push_names_only_tensors_of_the_model(live) -> None:
    """Empty tensors cost no payload byte: 5,000 of them under distinct names held their headers in memory."""
    svc, client = live
    before = _rows(svc.url)
    messages = [_header(), *(_chunk(f"empty.{i}", [0]) for i in range(5000))]
    with pytest.raises(grpc.RpcError) as info:
        svc.channel.stream_unary("/fedatoms.v1.Aggregator/PushUpdate")(
            iter([m.SerializeToString() for m in messages]), metadata=client.auth, timeout=60
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith("tensor 'empty.0': unknown tensor"), info.value.details()
    assert _rows(svc.url) == before


def _long_chunk(name: str, dtype: str) -> pb.PushMessage:
    return pb.PushMessage(
        chunk=pb.TensorChunk(name=name, dtype=dtype, shape=[1], total_bytes=4, data=b"\0" * 4, kind=1)
    )


@pytest.mark.parametrize(
    ("method", "payload", "said"),
    [
        ("PushUpdate", [_header(), _long_chunk("n" * 20_000, "float32")], "chunk.name is 20000 characters long"),
        ("PushUpdate", [_header(), _long_chunk("n" * 10_000, "float32")], "chunk.name is 10000 characters long"),
        ("PushUpdate", [_header(), _long_chunk("conv1.atoms", "f" * 20_000)], "chunk.dtype is 20000 characters long"),
        (
            "PushUpdate",
            [
                pb.PushMessage(
                    header=pb.PushHeader(
                        round=1, update_id="u", num_samples=1, metrics=dict.fromkeys((f"m{i}" for i in range(257)), 1.0)
                    )
                )
            ],
            "header.metrics has 257 entries; at most 256 are accepted",
        ),
        ("FetchModel", pb.FetchRequest(purpose=77), "purpose = 77 is not a value this server knows"),
    ],
    ids=["name-20k", "name-10k", "dtype-20k", "257-metrics", "purpose-77"],
)
def test_long_chunk_strings_many_metrics_and_unknown_purposes_are_invalid_argument(live, method, payload, said) -> None:
    """A push's chunks are parsed in place, past the checks every other message gets: a 20,000-character name was
    quoted whole in the refusal, whose trailer gRPC cut (RESOURCE_EXHAUSTED) and at 10,000 sometimes not; 100,000
    metric keys were stored in the round's metrics; an unknown fetch purpose was counted as a training fetch."""
    svc, client = live
    before = _rows(svc.url)
    with pytest.raises(grpc.RpcError) as info:
        if method == "FetchModel":
            list(svc.stub.FetchModel(payload, metadata=client.auth, timeout=60))
        else:
            svc.channel.stream_unary("/fedatoms.v1.Aggregator/PushUpdate")(
                iter([m.SerializeToString() for m in payload]), metadata=client.auth, timeout=60
            )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert said in info.value.details() and len(info.value.details()) < 300, info.value.details()[:300]
    assert _rows(svc.url) == before
