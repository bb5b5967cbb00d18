"""The wire contract: committed stubs are fresh, every message round-trips, chunks stay small.

The loopback test at the end runs the generated stubs over real gRPC, so a contract the
server cannot implement (wrong streaming flags, an unimportable stub) fails here first.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf.message import Message

from fedcore import codec
from fedcore.spec import ModelSpec
from fedcore.tiers import CapabilityProfile
from fedcore.training import TrainConfig
from fedwire import protogen
from fedwire.framing import from_chunk, to_chunk
from fedwire.v1 import aggregator_pb2 as pb
from fedwire.v1 import aggregator_pb2_grpc as pb_grpc

GRPC_DEFAULT_MAX_MESSAGE = 4 * 1024 * 1024


# ----------------------------------------------------------------------------- helpers


def roundtrip(msg: Message) -> Message:
    back = type(msg).FromString(msg.SerializeToString())
    assert back == msg, f"{type(msg).__name__} changed on the wire:\n{msg}\n≠\n{back}"
    return back


def all_message_names(descriptors) -> set[str]:
    out: set[str] = set()
    for d in descriptors:
        if d.GetOptions().map_entry:  # PushHeader.MetricsEntry: protoc's, not ours
            continue
        out.add(d.full_name)
        out |= all_message_names(d.nested_types)
    return out


# --------------------------------------------------------------------------- freshness


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    written = protogen.generate(tmp_path)
    assert written, "protogen generated nothing"
    stale = []
    for path in written:
        rel = path.relative_to(tmp_path)
        committed = protogen.REPO_ROOT / rel
        if not committed.is_file() or committed.read_bytes() != path.read_bytes():
            stale.append(str(rel))
    assert not stale, f"stubs are stale: run python -m fedwire.protogen ({', '.join(stale)})"
    generated = {p.relative_to(tmp_path) for p in written}
    orphans = [
        str(p.relative_to(protogen.REPO_ROOT))
        for p in (protogen.REPO_ROOT / protogen.STUB_PACKAGE).rglob("*_pb2*.py*")
        if p.relative_to(protogen.REPO_ROOT) not in generated
    ]
    assert not orphans, f"stubs are stale: run python -m fedwire.protogen and delete {', '.join(orphans)}"


def test_stubs_import_as_a_package() -> None:
    assert pb.DESCRIPTOR.package == "fedatoms.v1"
    assert pb.DESCRIPTOR.name == "fedatoms/v1/aggregator.proto"
    assert (
        pb_grpc.fedatoms_dot_v1_dot_aggregator__pb2 is pb
    )  # the grpc stub imports `from fedwire.v1 import aggregator_pb2`


# -------------------------------------------------------------------------- round trips


def representative_messages() -> list[Message]:
    profile = pb.CapabilityProfile(
        device_name="raspberry-pi-4",
        compute_macs=2.5e8,
        memory_bytes=512 * 2**20,
        uplink_bps=1e7,
        downlink_bps=5e7,
        num_samples=1200,
        preferred_tier=0.5,
    )
    spec = ModelSpec("lenet-cifar10", 10, "atoms-lowrank").at_tier(0.5)
    chunk = pb.TensorChunk(
        name="features.0.atoms",
        dtype="float32",
        shape=[9, 3, 3],
        version=4,
        offset=0,
        data=np.arange(81, dtype="<f4").tobytes(),
        total_bytes=324,
        kind=pb.TENSOR_KIND_MODEL,
    )
    train = pb.Task.Train(
        round=12,
        due_tensors=["features.0.atoms", "classifier.weight"],
        train_config_json=json.dumps(TrainConfig(local_epochs=2, prox_mu=0.01).to_dict()),
        strategy_config_json=json.dumps({"prox_mu": 0.01}),
        continue_unsynced=True,
        seed=(1 << 63) - 1,
        deadline_unix=1_900_000_000.5,
        personal_atoms=True,
    )
    return [
        profile,
        pb.RegisterRequest(profile=profile, enrollment_secret="s3cret", client_name="pi-kitchen"),
        pb.RegisterReply(
            client_id="c-0001",
            token="tok-abc",
            tier=0.5,
            model_spec_json=spec.to_json(),
            federation="cifar10-demo",
            heartbeat_interval_seconds=15.0,
        ),
        pb.HeartbeatRequest(),
        pb.HeartbeatReply(server_time_unix=1_900_000_000.25, current_round=12),
        pb.GetTaskRequest(),
        pb.GetTaskRequest(report=pb.EvaluationReport(round=11, global_accuracy=0.6, global_loss=1.2, num_samples=300)),
        pb.Task(wait=pb.Task.Wait(retry_after_seconds=2.5, reason="not selected for round 12")),
        pb.Task.Wait(retry_after_seconds=0.0, reason=""),
        pb.Task(train=train),
        train,
        pb.Task(done=pb.Task.Done(reason="federation finished after 100 rounds", final_round=100)),
        pb.Task.Done(reason="retired", final_round=7),
        chunk,
        pb.TensorVersion(name="features.0.atoms", version=4),
        pb.FetchRequest(held=[pb.TensorVersion(name="features.0.atoms", version=4)], include_server_control=True),
        pb.TensorResume(name="fc1.weight", version=4, offset=3 * 2**20),
        pb.FetchRequest(resume=pb.TensorResume(name="fc1.weight", version=4, offset=2**20)),
        pb.FetchRequest(chunk_bytes=2**16, resume=pb.TensorResume(name="fc1.weight", version=4, offset=3 * 2**16)),
        pb.FetchRequest(
            include_server_control=True,
            held_control=[pb.TensorVersion(name="conv1.weight", version=3)],
            resume=pb.TensorResume(name="fc1.weight", version=3, offset=2**20, kind=pb.TENSOR_KIND_SERVER_CONTROL),
        ),
        pb.PushMessage(
            header=pb.PushHeader(
                round=12,
                update_id="0b6f1c1e-3d52-4c1b-9a53-3f0f0e6d4a11",
                num_samples=1200,
                metrics={"train_loss": 0.71, "train_accuracy": 0.75, "steps": 38.0},
            )
        ),
        pb.PushMessage(chunk=chunk),
        pb.TensorChunkBatch(chunks=[chunk, chunk]),
        pb.PushMessage(chunks=pb.TensorChunkBatch(chunks=[chunk])),
        pb.PushHeader(round=12, update_id="u-1", num_samples=1, metrics={}),
        pb.PushReply(accepted=True, duplicate=True, round=12, message="stored 14 tensors, 3.2 MiB"),
        pb.EvaluationReport(
            round=12, global_accuracy=0.61, global_loss=1.12, personalized_accuracy=0.74, num_samples=300
        ),
        pb.EvaluationReply(recorded=True),
        pb.PushHeader(round=12, update_id="u-1", num_samples=1, metrics={}, resume=True),
        pb.UploadProgressRequest(update_id="u-1"),
        pb.UploadProgress(kept=True, round=12, tensors=3, offset=4096),
    ]


def test_every_message_type_round_trips() -> None:
    messages = representative_messages()
    for msg in messages:
        roundtrip(msg)
    covered = {m.DESCRIPTOR.full_name for m in messages}
    declared = all_message_names(pb.DESCRIPTOR.message_types_by_name.values())
    assert declared - covered == set(), f"add a representative message for {sorted(declared - covered)}"


def test_payloads_survive_the_wire() -> None:
    spec = ModelSpec("lenet-cifar10", 10, "atoms-lowrank").at_tier(0.25)
    reply = roundtrip(pb.RegisterReply(tier=0.25, model_spec_json=spec.to_json()))
    assert ModelSpec.from_dict(json.loads(reply.model_spec_json)) == spec
    config = TrainConfig(local_epochs=3, batch_size=16, lr=0.05, personal_epochs=1)
    train = roundtrip(pb.Task.Train(train_config_json=json.dumps(config.to_dict()), seed=2**64 - 1))
    assert TrainConfig.from_dict(json.loads(train.train_config_json)) == config
    assert train.seed == 2**64 - 1  # uint64: derive_seed's 63-bit seeds fit with room to spare


def test_optional_fields_keep_presence() -> None:
    """Unset ≠ 0: an unset budget means "no limit" (None in CapabilityProfile)."""
    bare = roundtrip(pb.CapabilityProfile(device_name="x", num_samples=10))
    for field in ("compute_macs", "memory_bytes", "uplink_bps", "downlink_bps", "preferred_tier"):
        assert not bare.HasField(field), field
    zero = roundtrip(pb.CapabilityProfile(memory_bytes=0, preferred_tier=0.125))
    assert zero.HasField("memory_bytes") and zero.memory_bytes == 0
    assert zero.HasField("preferred_tier")
    assert not roundtrip(pb.RegisterRequest()).HasField("client_name")
    assert not roundtrip(pb.FetchRequest()).HasField("include_server_control")
    assert not roundtrip(pb.EvaluationReport(global_accuracy=0.5)).HasField("personalized_accuracy")
    assert roundtrip(pb.EvaluationReport(personalized_accuracy=0.0)).HasField("personalized_accuracy")


def test_profile_mirrors_fedcore() -> None:
    proto_fields = {f.name for f in pb.CapabilityProfile.DESCRIPTOR.fields}
    assert proto_fields == {f.name for f in dataclasses.fields(CapabilityProfile)}
    declared = CapabilityProfile(device_name="jetson", memory_bytes=2**30, num_samples=5)
    msg = roundtrip(pb.CapabilityProfile(**{k: v for k, v in declared.to_dict().items() if v is not None}))
    back = CapabilityProfile(
        **{
            f: (getattr(msg, f) if msg.HasField(f) else None)
            for f in proto_fields
            if f not in ("device_name", "num_samples")
        },
        device_name=msg.device_name,
        num_samples=msg.num_samples,
    )
    assert back == declared


def test_tensor_chunk_mirrors_codec_chunk() -> None:
    proto_fields = [f.name for f in pb.TensorChunk.DESCRIPTOR.fields]
    assert proto_fields == [f.name for f in dataclasses.fields(codec.Chunk)] + ["kind"]
    kinds = pb.TensorKind.keys()
    assert kinds == [
        "TENSOR_KIND_UNSPECIFIED",
        "TENSOR_KIND_MODEL",
        "TENSOR_KIND_SERVER_CONTROL",
        "TENSOR_KIND_CONTROL_DELTA",
    ]
    assert pb.TensorKind.Value("TENSOR_KIND_UNSPECIFIED") == 0


# ------------------------------------------------------------------------------ oneofs


def test_task_oneof() -> None:
    task = pb.Task()
    assert task.WhichOneof("kind") is None
    task.wait.retry_after_seconds = 3.0
    assert task.WhichOneof("kind") == "wait"
    task.train.round = 5
    assert task.WhichOneof("kind") == "train"
    assert not task.HasField("wait")
    task.done.final_round = 5
    assert roundtrip(task).WhichOneof("kind") == "done"
    assert [f.name for f in pb.Task.DESCRIPTOR.oneofs_by_name["kind"].fields] == ["wait", "train", "done"]
    # An empty Wait is still a Wait: presence survives the wire even with all-default fields.
    assert roundtrip(pb.Task(wait=pb.Task.Wait())).WhichOneof("kind") == "wait"


def test_push_message_oneof() -> None:
    msg = pb.PushMessage(header=pb.PushHeader(round=1, update_id="u"))
    assert roundtrip(msg).WhichOneof("payload") == "header"
    msg.chunk.name = "w"
    assert msg.WhichOneof("payload") == "chunk"
    assert not msg.HasField("header")
    assert roundtrip(pb.PushMessage(chunk=pb.TensorChunk())).WhichOneof("payload") == "chunk"
    assert pb.PushMessage().WhichOneof("payload") is None
    assert [f.name for f in pb.PushMessage.DESCRIPTOR.oneofs_by_name["payload"].fields] == ["header", "chunk", "chunks"]


# ----------------------------------------------------------------------------- service

EXPECTED_RPCS = {
    # name: (request, response, client_streaming, server_streaming)
    "Register": ("RegisterRequest", "RegisterReply", False, False),
    "Heartbeat": ("HeartbeatRequest", "HeartbeatReply", False, False),
    "GetTask": ("GetTaskRequest", "Task", False, False),
    "FetchModel": ("FetchRequest", "TensorChunkBatch", False, True),
    "PushUpdate": ("PushMessage", "PushReply", True, False),
    "GetUploadProgress": ("UploadProgressRequest", "UploadProgress", False, False),
    "ReportEvaluation": ("EvaluationReport", "EvaluationReply", False, False),
}


def test_service_has_exactly_the_seven_rpcs() -> None:
    service = pb.DESCRIPTOR.services_by_name["Aggregator"]
    assert service.full_name == "fedatoms.v1.Aggregator"
    assert list(pb.DESCRIPTOR.services_by_name) == ["Aggregator"]
    got = {
        m.name: (m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming) for m in service.methods
    }
    assert got == EXPECTED_RPCS
    for name in EXPECTED_RPCS:
        assert callable(getattr(pb_grpc.AggregatorServicer, name))


# ----------------------------------------------------------------------------- chunking


def test_chunks_of_a_3_mib_tensor_stay_well_under_grpc_limit() -> None:
    array = np.random.default_rng(0).standard_normal((768, 256, 4), dtype=np.float32)
    encoded = codec.encode(array)
    assert encoded.nbytes == 3 * 2**20
    chunks = [from_chunk(c) for c in codec.iter_chunks("features.3.coefficients", encoded, version=7)]
    assert len(chunks) == 3
    assert [c.offset for c in chunks] == [0, 2**20, 2 * 2**20]
    reassembler = codec.Reassembler()
    for chunk in chunks:
        assert len(chunk.data) <= codec.CHUNK_BYTES
        for msg in (chunk, pb.PushMessage(chunk=chunk)):
            size = msg.ByteSize()
            assert size == len(msg.SerializeToString())
            assert size <= codec.CHUNK_BYTES + 1024, f"{size} bytes: header overhead grew"
            assert size < GRPC_DEFAULT_MAX_MESSAGE // 2
        reassembler.add(to_chunk(roundtrip(chunk)))
    assert reassembler.versions() == {"features.3.coefficients": 7}
    np.testing.assert_array_equal(reassembler.finish()["features.3.coefficients"], array)


# ----------------------------------------------------------------------------- loopback


class _EchoAggregator(pb_grpc.AggregatorServicer):
    """Just enough of a server to prove the stubs carry streams and metadata over real gRPC."""

    def __init__(self, tensors: dict[str, np.ndarray]) -> None:
        self.tensors = tensors

    @staticmethod
    def _authorized(context: grpc.ServicerContext) -> None:
        if dict(context.invocation_metadata()).get("authorization") != "Bearer tok":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")

    def FetchModel(self, request, context):
        self._authorized(context)
        held = {h.name: h.version for h in request.held}
        for name, array in self.tensors.items():
            if held.get(name, -1) < 1:
                for chunk in codec.iter_chunks(name, codec.encode(array), version=1):
                    yield pb.TensorChunkBatch(chunks=[from_chunk(chunk)])

    def PushUpdate(self, request_iterator, context):
        self._authorized(context)
        first = next(request_iterator)
        if first.WhichOneof("payload") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first PushMessage must be a header")
        reassembler = codec.Reassembler()
        for msg in request_iterator:
            reassembler.add(to_chunk(msg.chunk))
        n = len(reassembler.finish())
        return pb.PushReply(accepted=True, round=first.header.round, message=f"stored {n} tensors")


@pytest.fixture
def loopback():
    tensors = {"big": np.ones((3 * 2**18,), dtype=np.float32), "small": np.arange(5, dtype=np.int64)}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_AggregatorServicer_to_server(_EchoAggregator(tensors), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.AggregatorStub(channel), tensors
    finally:
        channel.close()
        server.stop(None)


def test_streams_over_real_grpc_with_default_limits(loopback) -> None:
    stub, tensors = loopback
    auth = (("authorization", "Bearer tok"),)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.FetchModel(pb.FetchRequest()))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

    chunks = [c for batch in stub.FetchModel(pb.FetchRequest(), metadata=auth, timeout=30) for c in batch.chunks]
    assert [c.name for c in chunks] == ["big"] * 3 + ["small"]
    assert not list(
        stub.FetchModel(pb.FetchRequest(held=[pb.TensorVersion(name=n, version=1) for n in tensors]), metadata=auth)
    )

    messages = [pb.PushMessage(header=pb.PushHeader(round=3, update_id="u-1", num_samples=10))]
    messages += [pb.PushMessage(chunk=c) for c in chunks]
    reply = stub.PushUpdate(iter(messages), metadata=auth, timeout=30)
    assert (reply.accepted, reply.round, reply.message) == (True, 3, "stored 2 tensors")
