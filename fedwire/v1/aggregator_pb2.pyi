from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoundOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUND_OUTCOME_UNSPECIFIED: _ClassVar[RoundOutcome]
    ROUND_OUTCOME_OPEN: _ClassVar[RoundOutcome]
    ROUND_OUTCOME_CLOSED: _ClassVar[RoundOutcome]
    ROUND_OUTCOME_ABANDONED: _ClassVar[RoundOutcome]
    ROUND_OUTCOME_UNKNOWN: _ClassVar[RoundOutcome]

class TensorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_KIND_UNSPECIFIED: _ClassVar[TensorKind]
    TENSOR_KIND_MODEL: _ClassVar[TensorKind]
    TENSOR_KIND_SERVER_CONTROL: _ClassVar[TensorKind]
    TENSOR_KIND_CONTROL_DELTA: _ClassVar[TensorKind]

class FetchPurpose(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FETCH_PURPOSE_UNSPECIFIED: _ClassVar[FetchPurpose]
    FETCH_PURPOSE_TRAIN: _ClassVar[FetchPurpose]
    FETCH_PURPOSE_EVALUATE: _ClassVar[FetchPurpose]
ROUND_OUTCOME_UNSPECIFIED: RoundOutcome
ROUND_OUTCOME_OPEN: RoundOutcome
ROUND_OUTCOME_CLOSED: RoundOutcome
ROUND_OUTCOME_ABANDONED: RoundOutcome
ROUND_OUTCOME_UNKNOWN: RoundOutcome
TENSOR_KIND_UNSPECIFIED: TensorKind
TENSOR_KIND_MODEL: TensorKind
TENSOR_KIND_SERVER_CONTROL: TensorKind
TENSOR_KIND_CONTROL_DELTA: TensorKind
FETCH_PURPOSE_UNSPECIFIED: FetchPurpose
FETCH_PURPOSE_TRAIN: FetchPurpose
FETCH_PURPOSE_EVALUATE: FetchPurpose

class CapabilityProfile(_message.Message):
    __slots__ = ("device_name", "compute_macs", "memory_bytes", "uplink_bps", "downlink_bps", "num_samples", "preferred_tier")
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MACS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPLINK_BPS_FIELD_NUMBER: _ClassVar[int]
    DOWNLINK_BPS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_TIER_FIELD_NUMBER: _ClassVar[int]
    device_name: str
    compute_macs: float
    memory_bytes: int
    uplink_bps: float
    downlink_bps: float
    num_samples: int
    preferred_tier: float
    def __init__(self, device_name: _Optional[str] = ..., compute_macs: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., uplink_bps: _Optional[float] = ..., downlink_bps: _Optional[float] = ..., num_samples: _Optional[int] = ..., preferred_tier: _Optional[float] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("profile", "enrollment_secret", "client_name")
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    ENROLLMENT_SECRET_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    profile: CapabilityProfile
    enrollment_secret: str
    client_name: str
    def __init__(self, profile: _Optional[_Union[CapabilityProfile, _Mapping]] = ..., enrollment_secret: _Optional[str] = ..., client_name: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("client_id", "token", "tier", "model_spec_json", "federation", "heartbeat_interval_seconds", "normalization_mean", "normalization_std")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    MODEL_SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    FEDERATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZATION_MEAN_FIELD_NUMBER: _ClassVar[int]
    NORMALIZATION_STD_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    token: str
    tier: float
    model_spec_json: str
    federation: str
    heartbeat_interval_seconds: float
    normalization_mean: _containers.RepeatedScalarFieldContainer[float]
    normalization_std: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, client_id: _Optional[str] = ..., token: _Optional[str] = ..., tier: _Optional[float] = ..., model_spec_json: _Optional[str] = ..., federation: _Optional[str] = ..., heartbeat_interval_seconds: _Optional[float] = ..., normalization_mean: _Optional[_Iterable[float]] = ..., normalization_std: _Optional[_Iterable[float]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    def __init__(self, round: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("server_time_unix", "current_round", "last_closed_round", "round_outcome")
    SERVER_TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    LAST_CLOSED_ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    server_time_unix: float
    current_round: int
    last_closed_round: int
    round_outcome: RoundOutcome
    def __init__(self, server_time_unix: _Optional[float] = ..., current_round: _Optional[int] = ..., last_closed_round: _Optional[int] = ..., round_outcome: _Optional[_Union[RoundOutcome, str]] = ...) -> None: ...

class GetTaskRequest(_message.Message):
    __slots__ = ("report", "wait_seconds")
    REPORT_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    report: EvaluationReport
    wait_seconds: float
    def __init__(self, report: _Optional[_Union[EvaluationReport, _Mapping]] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("wait", "train", "done")
    class Wait(_message.Message):
        __slots__ = ("retry_after_seconds", "reason")
        RETRY_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
        REASON_FIELD_NUMBER: _ClassVar[int]
        retry_after_seconds: float
        reason: str
        def __init__(self, retry_after_seconds: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...
    class Train(_message.Message):
        __slots__ = ("round", "due_tensors", "train_config_json", "strategy_config_json", "continue_unsynced", "seed", "deadline_unix", "personal_atoms")
        ROUND_FIELD_NUMBER: _ClassVar[int]
        DUE_TENSORS_FIELD_NUMBER: _ClassVar[int]
        TRAIN_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
        STRATEGY_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
        CONTINUE_UNSYNCED_FIELD_NUMBER: _ClassVar[int]
        SEED_FIELD_NUMBER: _ClassVar[int]
        DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
        PERSONAL_ATOMS_FIELD_NUMBER: _ClassVar[int]
        round: int
        due_tensors: _containers.RepeatedScalarFieldContainer[str]
        train_config_json: str
        strategy_config_json: str
        continue_unsynced: bool
        seed: int
        deadline_unix: float
        personal_atoms: bool
        def __init__(self, round: _Optional[int] = ..., due_tensors: _Optional[_Iterable[str]] = ..., train_config_json: _Optional[str] = ..., strategy_config_json: _Optional[str] = ..., continue_unsynced: _Optional[bool] = ..., seed: _Optional[int] = ..., deadline_unix: _Optional[float] = ..., personal_atoms: _Optional[bool] = ...) -> None: ...
    class Done(_message.Message):
        __slots__ = ("reason", "final_round")
        REASON_FIELD_NUMBER: _ClassVar[int]
        FINAL_ROUND_FIELD_NUMBER: _ClassVar[int]
        reason: str
        final_round: int
        def __init__(self, reason: _Optional[str] = ..., final_round: _Optional[int] = ...) -> None: ...
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    wait: Task.Wait
    train: Task.Train
    done: Task.Done
    def __init__(self, wait: _Optional[_Union[Task.Wait, _Mapping]] = ..., train: _Optional[_Union[Task.Train, _Mapping]] = ..., done: _Optional[_Union[Task.Done, _Mapping]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "version", "offset", "data", "total_bytes", "kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    version: int
    offset: int
    data: bytes
    total_bytes: int
    kind: TensorKind
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., version: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., kind: _Optional[_Union[TensorKind, str]] = ...) -> None: ...

class TensorChunkBatch(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ...) -> None: ...

class TensorVersion(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("held", "include_server_control", "round", "purpose", "resume", "held_control", "chunk_bytes")
    HELD_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_SERVER_CONTROL_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PURPOSE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    HELD_CONTROL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    held: _containers.RepeatedCompositeFieldContainer[TensorVersion]
    include_server_control: bool
    round: int
    purpose: FetchPurpose
    resume: TensorResume
    held_control: _containers.RepeatedCompositeFieldContainer[TensorVersion]
    chunk_bytes: int
    def __init__(self, held: _Optional[_Iterable[_Union[TensorVersion, _Mapping]]] = ..., include_server_control: _Optional[bool] = ..., round: _Optional[int] = ..., purpose: _Optional[_Union[FetchPurpose, str]] = ..., resume: _Optional[_Union[TensorResume, _Mapping]] = ..., held_control: _Optional[_Iterable[_Union[TensorVersion, _Mapping]]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class TensorResume(_message.Message):
    __slots__ = ("name", "version", "offset", "kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    offset: int
    kind: TensorKind
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., offset: _Optional[int] = ..., kind: _Optional[_Union[TensorKind, str]] = ...) -> None: ...

class PushMessage(_message.Message):
    __slots__ = ("header", "chunk", "chunks")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: TensorChunk
    chunks: TensorChunkBatch
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., chunks: _Optional[_Union[TensorChunkBatch, _Mapping]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("round", "update_id", "num_samples", "metrics", "resume")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROUND_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    round: int
    update_id: str
    num_samples: int
    metrics: _containers.ScalarMap[str, float]
    resume: bool
    def __init__(self, round: _Optional[int] = ..., update_id: _Optional[str] = ..., num_samples: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., resume: _Optional[bool] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("accepted", "duplicate", "round", "message", "move_scale")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MOVE_SCALE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    duplicate: bool
    round: int
    message: str
    move_scale: float
    def __init__(self, accepted: _Optional[bool] = ..., duplicate: _Optional[bool] = ..., round: _Optional[int] = ..., message: _Optional[str] = ..., move_scale: _Optional[float] = ...) -> None: ...

class UploadProgressRequest(_message.Message):
    __slots__ = ("update_id",)
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    def __init__(self, update_id: _Optional[str] = ...) -> None: ...

class UploadProgress(_message.Message):
    __slots__ = ("kept", "round", "tensors", "offset")
    KEPT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    kept: bool
    round: int
    tensors: int
    offset: int
    def __init__(self, kept: _Optional[bool] = ..., round: _Optional[int] = ..., tensors: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class EvaluationReport(_message.Message):
    __slots__ = ("round", "global_accuracy", "global_loss", "personalized_accuracy", "num_samples")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    PERSONALIZED_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    round: int
    global_accuracy: float
    global_loss: float
    personalized_accuracy: float
    num_samples: int
    def __init__(self, round: _Optional[int] = ..., global_accuracy: _Optional[float] = ..., global_loss: _Optional[float] = ..., personalized_accuracy: _Optional[float] = ..., num_samples: _Optional[int] = ...) -> None: ...

class EvaluationReply(_message.Message):
    __slots__ = ("recorded",)
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    recorded: bool
    def __init__(self, recorded: _Optional[bool] = ...) -> None: ...
