from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoundState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUND_STATE_UNSPECIFIED: _ClassVar[RoundState]
    ROUND_STATE_WAITING_FOR_CLIENTS: _ClassVar[RoundState]
    ROUND_STATE_OPEN: _ClassVar[RoundState]
    ROUND_STATE_FINISHED: _ClassVar[RoundState]
    ROUND_STATE_AGGREGATING: _ClassVar[RoundState]

class SecureStage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SECURE_STAGE_UNSPECIFIED: _ClassVar[SecureStage]
    SECURE_STAGE_ADVERTISING: _ClassVar[SecureStage]
    SECURE_STAGE_SHARING: _ClassVar[SecureStage]
    SECURE_STAGE_UPLOADING: _ClassVar[SecureStage]
    SECURE_STAGE_UNMASKING: _ClassVar[SecureStage]
    SECURE_STAGE_CONSISTENCY: _ClassVar[SecureStage]

class ShareKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARE_KIND_UNSPECIFIED: _ClassVar[ShareKind]
    SHARE_KIND_SELF_MASK: _ClassVar[ShareKind]
    SHARE_KIND_MASKING: _ClassVar[ShareKind]
ROUND_STATE_UNSPECIFIED: RoundState
ROUND_STATE_WAITING_FOR_CLIENTS: RoundState
ROUND_STATE_OPEN: RoundState
ROUND_STATE_FINISHED: RoundState
ROUND_STATE_AGGREGATING: RoundState
SECURE_STAGE_UNSPECIFIED: SecureStage
SECURE_STAGE_ADVERTISING: SecureStage
SECURE_STAGE_SHARING: SecureStage
SECURE_STAGE_UPLOADING: SecureStage
SECURE_STAGE_UNMASKING: SecureStage
SECURE_STAGE_CONSISTENCY: SecureStage
SHARE_KIND_UNSPECIFIED: ShareKind
SHARE_KIND_SELF_MASK: ShareKind
SHARE_KIND_MASKING: ShareKind

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class AdapterSchema(_message.Message):
    __slots__ = ("tensors", "adapter_config_json")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    adapter_config_json: str
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., adapter_config_json: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("client_id", "env", "base_model", "schema")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    env: str
    base_model: str
    schema: AdapterSchema
    def __init__(self, client_id: _Optional[str] = ..., env: _Optional[str] = ..., base_model: _Optional[str] = ..., schema: _Optional[_Union[AdapterSchema, _Mapping]] = ...) -> None: ...

class RunConfig(_message.Message):
    __slots__ = ("run_id", "num_rounds", "min_clients", "round_deadline_s", "strategy", "max_chunk_bytes", "wait_after_min_s", "heartbeat_timeout_s", "heartbeat_interval_s", "secure_aggregation", "secure_threshold", "secure_stage_timeout_s", "clip_norm", "noise_multiplier", "secure_neighbours", "secure_signed", "secure_max_roster", "dp_delta", "selector", "clients_per_round", "selection_fraction", "fairness_rounds", "mode", "async_concurrency", "async_buffer", "async_max_staleness", "max_lora_rank")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MIN_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    ROUND_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    WAIT_AFTER_MIN_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    SECURE_AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    SECURE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    SECURE_STAGE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    SECURE_NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    SECURE_SIGNED_FIELD_NUMBER: _ClassVar[int]
    SECURE_MAX_ROSTER_FIELD_NUMBER: _ClassVar[int]
    DP_DELTA_FIELD_NUMBER: _ClassVar[int]
    SELECTOR_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    SELECTION_FRACTION_FIELD_NUMBER: _ClassVar[int]
    FAIRNESS_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    ASYNC_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    ASYNC_BUFFER_FIELD_NUMBER: _ClassVar[int]
    ASYNC_MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    num_rounds: int
    min_clients: int
    round_deadline_s: float
    strategy: str
    max_chunk_bytes: int
    wait_after_min_s: float
    heartbeat_timeout_s: float
    heartbeat_interval_s: float
    secure_aggregation: bool
    secure_threshold: int
    secure_stage_timeout_s: float
    clip_norm: float
    noise_multiplier: float
    secure_neighbours: int
    secure_signed: bool
    secure_max_roster: int
    dp_delta: float
    selector: str
    clients_per_round: int
    selection_fraction: float
    fairness_rounds: int
    mode: str
    async_concurrency: int
    async_buffer: int
    async_max_staleness: int
    max_lora_rank: int
    def __init__(self, run_id: _Optional[str] = ..., num_rounds: _Optional[int] = ..., min_clients: _Optional[int] = ..., round_deadline_s: _Optional[float] = ..., strategy: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ..., wait_after_min_s: _Optional[float] = ..., heartbeat_timeout_s: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ..., secure_aggregation: _Optional[bool] = ..., secure_threshold: _Optional[int] = ..., secure_stage_timeout_s: _Optional[float] = ..., clip_norm: _Optional[float] = ..., noise_multiplier: _Optional[float] = ..., secure_neighbours: _Optional[int] = ..., secure_signed: _Optional[bool] = ..., secure_max_roster: _Optional[int] = ..., dp_delta: _Optional[float] = ..., selector: _Optional[str] = ..., clients_per_round: _Optional[int] = ..., selection_fraction: _Optional[float] = ..., fairness_rounds: _Optional[int] = ..., mode: _Optional[str] = ..., async_concurrency: _Optional[int] = ..., async_buffer: _Optional[int] = ..., async_max_staleness: _Optional[int] = ..., max_lora_rank: _Optional[int] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("config", "current_round")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    config: RunConfig
    current_round: int
    def __init__(self, config: _Optional[_Union[RunConfig, _Mapping]] = ..., current_round: _Optional[int] = ...) -> None: ...

class RoundStatusRequest(_message.Message):
    __slots__ = ("client_id",)
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    def __init__(self, client_id: _Optional[str] = ...) -> None: ...

class RoundStatus(_message.Message):
    __slots__ = ("run_id", "round", "state", "num_rounds", "joined", "uploaded", "deadline_unix", "global_sha256", "round_nonce", "secure_stage", "selective", "selected")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SHA256_FIELD_NUMBER: _ClassVar[int]
    ROUND_NONCE_FIELD_NUMBER: _ClassVar[int]
    SECURE_STAGE_FIELD_NUMBER: _ClassVar[int]
    SELECTIVE_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    state: RoundState
    num_rounds: int
    joined: _containers.RepeatedScalarFieldContainer[str]
    uploaded: _containers.RepeatedScalarFieldContainer[str]
    deadline_unix: float
    global_sha256: str
    round_nonce: str
    secure_stage: SecureStage
    selective: bool
    selected: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., state: _Optional[_Union[RoundState, str]] = ..., num_rounds: _Optional[int] = ..., joined: _Optional[_Iterable[str]] = ..., uploaded: _Optional[_Iterable[str]] = ..., deadline_unix: _Optional[float] = ..., global_sha256: _Optional[str] = ..., round_nonce: _Optional[str] = ..., secure_stage: _Optional[_Union[SecureStage, str]] = ..., selective: _Optional[bool] = ..., selected: _Optional[_Iterable[str]] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("round", "offset", "sha256", "transport_dtype")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    round: int
    offset: int
    sha256: str
    transport_dtype: str
    def __init__(self, round: _Optional[int] = ..., offset: _Optional[int] = ..., sha256: _Optional[str] = ..., transport_dtype: _Optional[str] = ...) -> None: ...

class AdapterHeader(_message.Message):
    __slots__ = ("run_id", "round", "client_id", "sha256", "size", "adapter_config_json", "num_examples", "num_successes", "round_nonce", "offset", "transport_dtype")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_SUCCESSES_FIELD_NUMBER: _ClassVar[int]
    ROUND_NONCE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    client_id: str
    sha256: str
    size: int
    adapter_config_json: str
    num_examples: int
    num_successes: int
    round_nonce: str
    offset: int
    transport_dtype: str
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., client_id: _Optional[str] = ..., sha256: _Optional[str] = ..., size: _Optional[int] = ..., adapter_config_json: _Optional[str] = ..., num_examples: _Optional[int] = ..., num_successes: _Optional[int] = ..., round_nonce: _Optional[str] = ..., offset: _Optional[int] = ..., transport_dtype: _Optional[str] = ...) -> None: ...

class AdapterChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: AdapterHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[AdapterHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadAck(_message.Message):
    __slots__ = ("round", "sha256", "size")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    round: int
    sha256: str
    size: int
    def __init__(self, round: _Optional[int] = ..., sha256: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class UploadStateRequest(_message.Message):
    __slots__ = ("client_id", "round", "sha256")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    round: int
    sha256: str
    def __init__(self, client_id: _Optional[str] = ..., round: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class UploadState(_message.Message):
    __slots__ = ("received_bytes", "complete")
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    complete: bool
    def __init__(self, received_bytes: _Optional[int] = ..., complete: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("client_id", "round", "phase")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    round: int
    phase: str
    def __init__(self, client_id: _Optional[str] = ..., round: _Optional[int] = ..., phase: _Optional[str] = ...) -> None: ...

class HeartbeatAck(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: RoundStatus
    def __init__(self, status: _Optional[_Union[RoundStatus, _Mapping]] = ...) -> None: ...

class MetricsReport(_message.Message):
    __slots__ = ("client_id", "round", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    round: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, client_id: _Optional[str] = ..., round: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class MetricsAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClientStatus(_message.Message):
    __slots__ = ("client_id", "env", "uploaded", "alive", "last_seen_unix", "phase_round", "phase", "partial_upload_bytes", "metrics_round", "metrics", "secure_step", "selected", "selection_reason", "lora_rank")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    PHASE_ROUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_UPLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    METRICS_ROUND_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SECURE_STEP_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    SELECTION_REASON_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    env: str
    uploaded: bool
    alive: bool
    last_seen_unix: float
    phase_round: int
    phase: str
    partial_upload_bytes: int
    metrics_round: int
    metrics: _containers.ScalarMap[str, float]
    secure_step: str
    selected: bool
    selection_reason: str
    lora_rank: int
    def __init__(self, client_id: _Optional[str] = ..., env: _Optional[str] = ..., uploaded: _Optional[bool] = ..., alive: _Optional[bool] = ..., last_seen_unix: _Optional[float] = ..., phase_round: _Optional[int] = ..., phase: _Optional[str] = ..., partial_upload_bytes: _Optional[int] = ..., metrics_round: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., secure_step: _Optional[str] = ..., selected: _Optional[bool] = ..., selection_reason: _Optional[str] = ..., lora_rank: _Optional[int] = ...) -> None: ...

class SelectionRecord(_message.Message):
    __slots__ = ("round", "policy", "chosen", "reasoning", "fallback_reason")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    round: int
    policy: str
    chosen: _containers.RepeatedScalarFieldContainer[str]
    reasoning: _containers.RepeatedScalarFieldContainer[str]
    fallback_reason: str
    def __init__(self, round: _Optional[int] = ..., policy: _Optional[str] = ..., chosen: _Optional[_Iterable[str]] = ..., reasoning: _Optional[_Iterable[str]] = ..., fallback_reason: _Optional[str] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("config", "round", "clients", "round_seconds", "base_model", "dp_accounted", "dp_epsilon_round", "dp_epsilon_total", "dp_releases", "selection", "selector_fallbacks", "clients_without_metrics")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    ROUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    DP_ACCOUNTED_FIELD_NUMBER: _ClassVar[int]
    DP_EPSILON_ROUND_FIELD_NUMBER: _ClassVar[int]
    DP_EPSILON_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DP_RELEASES_FIELD_NUMBER: _ClassVar[int]
    SELECTION_FIELD_NUMBER: _ClassVar[int]
    SELECTOR_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_WITHOUT_METRICS_FIELD_NUMBER: _ClassVar[int]
    config: RunConfig
    round: RoundStatus
    clients: _containers.RepeatedCompositeFieldContainer[ClientStatus]
    round_seconds: _containers.RepeatedScalarFieldContainer[float]
    base_model: str
    dp_accounted: bool
    dp_epsilon_round: float
    dp_epsilon_total: float
    dp_releases: int
    selection: SelectionRecord
    selector_fallbacks: int
    clients_without_metrics: int
    def __init__(self, config: _Optional[_Union[RunConfig, _Mapping]] = ..., round: _Optional[_Union[RoundStatus, _Mapping]] = ..., clients: _Optional[_Iterable[_Union[ClientStatus, _Mapping]]] = ..., round_seconds: _Optional[_Iterable[float]] = ..., base_model: _Optional[str] = ..., dp_accounted: _Optional[bool] = ..., dp_epsilon_round: _Optional[float] = ..., dp_epsilon_total: _Optional[float] = ..., dp_releases: _Optional[int] = ..., selection: _Optional[_Union[SelectionRecord, _Mapping]] = ..., selector_fallbacks: _Optional[int] = ..., clients_without_metrics: _Optional[int] = ...) -> None: ...

class StageAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdvertiseKeysRequest(_message.Message):
    __slots__ = ("client_id", "round", "round_nonce", "encryption_key", "masking_key", "self_mask_commitment", "certificate", "signature", "lora_rank")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_NONCE_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTION_KEY_FIELD_NUMBER: _ClassVar[int]
    MASKING_KEY_FIELD_NUMBER: _ClassVar[int]
    SELF_MASK_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    round: int
    round_nonce: str
    encryption_key: bytes
    masking_key: bytes
    self_mask_commitment: bytes
    certificate: bytes
    signature: bytes
    lora_rank: int
    def __init__(self, client_id: _Optional[str] = ..., round: _Optional[int] = ..., round_nonce: _Optional[str] = ..., encryption_key: _Optional[bytes] = ..., masking_key: _Optional[bytes] = ..., self_mask_commitment: _Optional[bytes] = ..., certificate: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., lora_rank: _Optional[int] = ...) -> None: ...

class RosterMember(_message.Message):
    __slots__ = ("client_id", "encryption_key", "masking_key", "self_mask_commitment", "index", "certificate", "signature", "lora_rank")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTION_KEY_FIELD_NUMBER: _ClassVar[int]
    MASKING_KEY_FIELD_NUMBER: _ClassVar[int]
    SELF_MASK_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    encryption_key: bytes
    masking_key: bytes
    self_mask_commitment: bytes
    index: int
    certificate: bytes
    signature: bytes
    lora_rank: int
    def __init__(self, client_id: _Optional[str] = ..., encryption_key: _Optional[bytes] = ..., masking_key: _Optional[bytes] = ..., self_mask_commitment: _Optional[bytes] = ..., index: _Optional[int] = ..., certificate: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., lora_rank: _Optional[int] = ...) -> None: ...

class SealedShare(_message.Message):
    __slots__ = ("client_id", "sealed", "self_mask_commitment", "masking_commitment")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    SELF_MASK_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    MASKING_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    sealed: bytes
    self_mask_commitment: bytes
    masking_commitment: bytes
    def __init__(self, client_id: _Optional[str] = ..., sealed: _Optional[bytes] = ..., self_mask_commitment: _Optional[bytes] = ..., masking_commitment: _Optional[bytes] = ...) -> None: ...

class ShareKeysRequest(_message.Message):
    __slots__ = ("client_id", "round", "round_nonce", "shares")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_NONCE_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    round: int
    round_nonce: str
    shares: _containers.RepeatedCompositeFieldContainer[SealedShare]
    def __init__(self, client_id: _Optional[str] = ..., round: _Optional[int] = ..., round_nonce: _Optional[str] = ..., shares: _Optional[_Iterable[_Union[SealedShare, _Mapping]]] = ...) -> None: ...

class SecureRoundRequest(_message.Message):
    __slots__ = ("client_id", "round", "round_nonce")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_NONCE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    round: int
    round_nonce: str
    def __init__(self, client_id: _Optional[str] = ..., round: _Optional[int] = ..., round_nonce: _Optional[str] = ...) -> None: ...

class SecureRound(_message.Message):
    __slots__ = ("round", "round_nonce", "stage", "threshold", "roster", "shared", "inbound", "uploaded", "consistency")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_NONCE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ROSTER_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    INBOUND_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    round: int
    round_nonce: str
    stage: SecureStage
    threshold: int
    roster: _containers.RepeatedCompositeFieldContainer[RosterMember]
    shared: _containers.RepeatedScalarFieldContainer[str]
    inbound: _containers.RepeatedCompositeFieldContainer[SealedShare]
    uploaded: _containers.RepeatedScalarFieldContainer[str]
    consistency: _containers.RepeatedCompositeFieldContainer[UploaderSignature]
    def __init__(self, round: _Optional[int] = ..., round_nonce: _Optional[str] = ..., stage: _Optional[_Union[SecureStage, str]] = ..., threshold: _Optional[int] = ..., roster: _Optional[_Iterable[_Union[RosterMember, _Mapping]]] = ..., shared: _Optional[_Iterable[str]] = ..., inbound: _Optional[_Iterable[_Union[SealedShare, _Mapping]]] = ..., uploaded: _Optional[_Iterable[str]] = ..., consistency: _Optional[_Iterable[_Union[UploaderSignature, _Mapping]]] = ...) -> None: ...

class UploaderSignature(_message.Message):
    __slots__ = ("client_id", "signature")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    signature: bytes
    def __init__(self, client_id: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ConsistencyRequest(_message.Message):
    __slots__ = ("client_id", "round", "round_nonce", "signature")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    round: int
    round_nonce: str
    signature: bytes
    def __init__(self, client_id: _Optional[str] = ..., round: _Optional[int] = ..., round_nonce: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class RevealedShare(_message.Message):
    __slots__ = ("client_id", "kind", "share")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    kind: ShareKind
    share: bytes
    def __init__(self, client_id: _Optional[str] = ..., kind: _Optional[_Union[ShareKind, str]] = ..., share: _Optional[bytes] = ...) -> None: ...

class UnmaskRequest(_message.Message):
    __slots__ = ("client_id", "round", "round_nonce", "shares")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_NONCE_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    round: int
    round_nonce: str
    shares: _containers.RepeatedCompositeFieldContainer[RevealedShare]
    def __init__(self, client_id: _Optional[str] = ..., round: _Optional[int] = ..., round_nonce: _Optional[str] = ..., shares: _Optional[_Iterable[_Union[RevealedShare, _Mapping]]] = ...) -> None: ...
