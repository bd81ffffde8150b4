from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InstanceType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEFAULT: _ClassVar[InstanceType]
    PREFILL: _ClassVar[InstanceType]
    DECODE: _ClassVar[InstanceType]
    MIX: _ClassVar[InstanceType]
DEFAULT: InstanceType
PREFILL: InstanceType
DECODE: InstanceType
MIX: InstanceType

class Status(_message.Message):
    __slots__ = ("ok", "message", "code")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    code: int
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ..., code: _Optional[int] = ...) -> None: ...

class StatusCode(_message.Message):
    __slots__ = ("status_code", "message")
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    status_code: int
    message: str
    def __init__(self, status_code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StatusSet(_message.Message):
    __slots__ = ("all_status",)
    ALL_STATUS_FIELD_NUMBER: _ClassVar[int]
    all_status: _containers.RepeatedCompositeFieldContainer[Status]
    def __init__(self, all_status: _Optional[_Iterable[_Union[Status, _Mapping]]] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceID(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class InstanceIDs(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class InstanceMetaInfo(_message.Message):
    __slots__ = ("name", "rpc_address", "type", "cluster_ids", "addrs", "ports", "dp_size", "incarnation_id", "register_ts_ms", "kv_split_size", "schema_version", "model", "block_size", "kv_layout", "kv_dtype", "tp_size", "num_layers", "num_kv_heads", "head_dim", "num_blocks", "http_address", "worker_rpc_addrs", "draining", "transfer_keys", "pp_size", "rank_kv")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_IDS_FIELD_NUMBER: _ClassVar[int]
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTER_TS_MS_FIELD_NUMBER: _ClassVar[int]
    KV_SPLIT_SIZE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_RPC_ADDRS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_KEYS_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_KV_FIELD_NUMBER: _ClassVar[int]
    name: str
    rpc_address: str
    type: InstanceType
    cluster_ids: _containers.RepeatedScalarFieldContainer[int]
    addrs: _containers.RepeatedScalarFieldContainer[str]
    ports: _containers.RepeatedScalarFieldContainer[int]
    dp_size: int
    incarnation_id: str
    register_ts_ms: int
    kv_split_size: int
    schema_version: int
    model: str
    block_size: int
    kv_layout: str
    kv_dtype: str
    tp_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    http_address: str
    worker_rpc_addrs: _containers.RepeatedScalarFieldContainer[str]
    draining: bool
    transfer_keys: _containers.RepeatedScalarFieldContainer[str]
    pp_size: int
    rank_kv: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., rpc_address: _Optional[str] = ..., type: _Optional[_Union[InstanceType, str]] = ..., cluster_ids: _Optional[_Iterable[int]] = ..., addrs: _Optional[_Iterable[str]] = ..., ports: _Optional[_Iterable[int]] = ..., dp_size: _Optional[int] = ..., incarnation_id: _Optional[str] = ..., register_ts_ms: _Optional[int] = ..., kv_split_size: _Optional[int] = ..., schema_version: _Optional[int] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., kv_layout: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., tp_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., num_blocks: _Optional[int] = ..., http_address: _Optional[str] = ..., worker_rpc_addrs: _Optional[_Iterable[str]] = ..., draining: _Optional[bool] = ..., transfer_keys: _Optional[_Iterable[str]] = ..., pp_size: _Optional[int] = ..., rank_kv: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadMetrics(_message.Message):
    __slots__ = ("waiting_requests_num", "gpu_cache_usage_perc", "running_requests_num")
    WAITING_REQUESTS_NUM_FIELD_NUMBER: _ClassVar[int]
    GPU_CACHE_USAGE_PERC_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_NUM_FIELD_NUMBER: _ClassVar[int]
    waiting_requests_num: int
    gpu_cache_usage_perc: float
    running_requests_num: int
    def __init__(self, waiting_requests_num: _Optional[int] = ..., gpu_cache_usage_perc: _Optional[float] = ..., running_requests_num: _Optional[int] = ...) -> None: ...

class LatencyMetrics(_message.Message):
    __slots__ = ("recent_max_ttft", "recent_max_tbt")
    RECENT_MAX_TTFT_FIELD_NUMBER: _ClassVar[int]
    RECENT_MAX_TBT_FIELD_NUMBER: _ClassVar[int]
    recent_max_ttft: int
    recent_max_tbt: int
    def __init__(self, recent_max_ttft: _Optional[int] = ..., recent_max_tbt: _Optional[int] = ...) -> None: ...

class KvCacheEvent(_message.Message):
    __slots__ = ("stored_cache", "removed_cache", "full_snapshot")
    STORED_CACHE_FIELD_NUMBER: _ClassVar[int]
    REMOVED_CACHE_FIELD_NUMBER: _ClassVar[int]
    FULL_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    stored_cache: _containers.RepeatedScalarFieldContainer[bytes]
    removed_cache: _containers.RepeatedScalarFieldContainer[bytes]
    full_snapshot: bool
    def __init__(self, stored_cache: _Optional[_Iterable[bytes]] = ..., removed_cache: _Optional[_Iterable[bytes]] = ..., full_snapshot: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("name", "incarnation_id", "load_metrics", "latency_metrics", "cache_event")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_METRICS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_METRICS_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    incarnation_id: str
    load_metrics: LoadMetrics
    latency_metrics: LatencyMetrics
    cache_event: KvCacheEvent
    def __init__(self, name: _Optional[str] = ..., incarnation_id: _Optional[str] = ..., load_metrics: _Optional[_Union[LoadMetrics, _Mapping]] = ..., latency_metrics: _Optional[_Union[LatencyMetrics, _Mapping]] = ..., cache_event: _Optional[_Union[KvCacheEvent, _Mapping]] = ...) -> None: ...

class StopSequence(_message.Message):
    __slots__ = ("seq_tokens", "text")
    SEQ_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    seq_tokens: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, seq_tokens: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class RoutingInfo(_message.Message):
    __slots__ = ("prefill_name", "decode_name")
    PREFILL_NAME_FIELD_NUMBER: _ClassVar[int]
    DECODE_NAME_FIELD_NUMBER: _ClassVar[int]
    prefill_name: str
    decode_name: str
    def __init__(self, prefill_name: _Optional[str] = ..., decode_name: _Optional[str] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DisaggRequest(_message.Message):
    __slots__ = ("req_id", "service_req_id", "tokens_num", "prompt", "prompt_tokens", "stream", "x_request_id", "x_request_time", "max_tokens", "max_context_len", "seq_capacity", "ignore_eos", "eos_token_id", "stop_token_ids", "stop_sequences", "n", "best_of", "frequency_penalty", "presence_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "logprobs", "top_logprobs", "echo", "skip_special_tokens", "offline", "priority", "ttft_slo", "tpot_slo", "source_xservice_addr", "min_p", "has_seed", "seed", "routing", "eos_token_ids", "include_stop_str_in_output", "schema_version", "has_temperature", "prompt_logprobs", "min_tokens", "has_prompt_logprobs", "logit_bias", "has_max_tokens", "allowed_token_ids", "bad_words", "prediction_token_ids", "structured_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_NUM_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    X_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    X_REQUEST_TIME_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    SEQ_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_FIELD_NUMBER: _ClassVar[int]
    SOURCE_XSERVICE_ADDR_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    HAS_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    HAS_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    service_req_id: str
    tokens_num: int
    prompt: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    stream: bool
    x_request_id: str
    x_request_time: str
    max_tokens: int
    max_context_len: int
    seq_capacity: int
    ignore_eos: bool
    eos_token_id: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_sequences: _containers.RepeatedCompositeFieldContainer[StopSequence]
    n: int
    best_of: int
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    temperature: float
    top_p: float
    top_k: int
    logprobs: bool
    top_logprobs: int
    echo: bool
    skip_special_tokens: bool
    offline: bool
    priority: int
    ttft_slo: int
    tpot_slo: int
    source_xservice_addr: str
    min_p: float
    has_seed: bool
    seed: int
    routing: RoutingInfo
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    schema_version: int
    has_temperature: bool
    prompt_logprobs: int
    min_tokens: int
    has_prompt_logprobs: bool
    logit_bias: _containers.ScalarMap[int, float]
    has_max_tokens: bool
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    prediction_token_ids: _containers.RepeatedScalarFieldContainer[int]
    structured_output: StructuredOutput
    def __init__(self, req_id: _Optional[str] = ..., service_req_id: _Optional[str] = ..., tokens_num: _Optional[int] = ..., prompt: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., stream: _Optional[bool] = ..., x_request_id: _Optional[str] = ..., x_request_time: _Optional[str] = ..., max_tokens: _Optional[int] = ..., max_context_len: _Optional[int] = ..., seq_capacity: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., eos_token_id: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_sequences: _Optional[_Iterable[_Union[StopSequence, _Mapping]]] = ..., n: _Optional[int] = ..., best_of: _Optional[int] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., echo: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., offline: _Optional[bool] = ..., priority: _Optional[int] = ..., ttft_slo: _Optional[int] = ..., tpot_slo: _Optional[int] = ..., source_xservice_addr: _Optional[str] = ..., min_p: _Optional[float] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., routing: _Optional[_Union[RoutingInfo, _Mapping]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., schema_version: _Optional[int] = ..., has_temperature: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., has_prompt_logprobs: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., has_max_tokens: _Optional[bool] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., prediction_token_ids: _Optional[_Iterable[int]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "value", "has_whitespace_pattern", "whitespace_pattern")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    HAS_WHITESPACE_PATTERN_FIELD_NUMBER: _ClassVar[int]
    WHITESPACE_PATTERN_FIELD_NUMBER: _ClassVar[int]
    kind: str
    value: str
    has_whitespace_pattern: bool
    whitespace_pattern: str
    def __init__(self, kind: _Optional[str] = ..., value: _Optional[str] = ..., has_whitespace_pattern: _Optional[bool] = ..., whitespace_pattern: _Optional[str] = ...) -> None: ...

class ClusterInfo(_message.Message):
    __slots__ = ("cluster_ids", "addrs", "ports", "dp_size", "worker_rpc_addrs")
    CLUSTER_IDS_FIELD_NUMBER: _ClassVar[int]
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKER_RPC_ADDRS_FIELD_NUMBER: _ClassVar[int]
    cluster_ids: _containers.RepeatedScalarFieldContainer[int]
    addrs: _containers.RepeatedScalarFieldContainer[str]
    ports: _containers.RepeatedScalarFieldContainer[int]
    dp_size: int
    worker_rpc_addrs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cluster_ids: _Optional[_Iterable[int]] = ..., addrs: _Optional[_Iterable[str]] = ..., ports: _Optional[_Iterable[int]] = ..., dp_size: _Optional[int] = ..., worker_rpc_addrs: _Optional[_Iterable[str]] = ...) -> None: ...

class DisaggRequests(_message.Message):
    __slots__ = ("prefill_name", "reqs", "cluster_infos")
    PREFILL_NAME_FIELD_NUMBER: _ClassVar[int]
    REQS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_INFOS_FIELD_NUMBER: _ClassVar[int]
    prefill_name: str
    reqs: _containers.RepeatedCompositeFieldContainer[DisaggRequest]
    cluster_infos: ClusterInfo
    def __init__(self, prefill_name: _Optional[str] = ..., reqs: _Optional[_Iterable[_Union[DisaggRequest, _Mapping]]] = ..., cluster_infos: _Optional[_Union[ClusterInfo, _Mapping]] = ...) -> None: ...

class DisaggResponse(_message.Message):
    __slots__ = ("req_id", "status_code", "blocks_ids", "dp_rank", "status_msg", "num_cached_tokens")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_IDS_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    STATUS_MSG_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    status_code: int
    blocks_ids: _containers.RepeatedScalarFieldContainer[int]
    dp_rank: int
    status_msg: str
    num_cached_tokens: int
    def __init__(self, req_id: _Optional[str] = ..., status_code: _Optional[int] = ..., blocks_ids: _Optional[_Iterable[int]] = ..., dp_rank: _Optional[int] = ..., status_msg: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class DisaggResponses(_message.Message):
    __slots__ = ("reqs",)
    REQS_FIELD_NUMBER: _ClassVar[int]
    reqs: _containers.RepeatedCompositeFieldContainer[DisaggResponse]
    def __init__(self, reqs: _Optional[_Iterable[_Union[DisaggResponse, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class RemoteToken(_message.Message):
    __slots__ = ("token_id", "has_logprob", "logprob", "top_tokens", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    has_logprob: bool
    logprob: float
    top_tokens: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., has_logprob: _Optional[bool] = ..., logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class DisaggGenerationsRequest(_message.Message):
    __slots__ = ("req_id", "tokens", "kv_cache_transfer_mode", "cluster_ids", "addrs", "block_ids", "dp_size", "dp_rank", "seq_index", "worker_rpc_addrs", "num_computed_tokens", "failed", "status_msg", "prefill_name")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TRANSFER_MODE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_IDS_FIELD_NUMBER: _ClassVar[int]
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    SEQ_INDEX_FIELD_NUMBER: _ClassVar[int]
    WORKER_RPC_ADDRS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    STATUS_MSG_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NAME_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    tokens: _containers.RepeatedCompositeFieldContainer[RemoteToken]
    kv_cache_transfer_mode: str
    cluster_ids: _containers.RepeatedScalarFieldContainer[int]
    addrs: _containers.RepeatedScalarFieldContainer[str]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    dp_size: int
    dp_rank: int
    seq_index: int
    worker_rpc_addrs: _containers.RepeatedScalarFieldContainer[str]
    num_computed_tokens: int
    failed: bool
    status_msg: str
    prefill_name: str
    def __init__(self, req_id: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[RemoteToken, _Mapping]]] = ..., kv_cache_transfer_mode: _Optional[str] = ..., cluster_ids: _Optional[_Iterable[int]] = ..., addrs: _Optional[_Iterable[str]] = ..., block_ids: _Optional[_Iterable[int]] = ..., dp_size: _Optional[int] = ..., dp_rank: _Optional[int] = ..., seq_index: _Optional[int] = ..., worker_rpc_addrs: _Optional[_Iterable[str]] = ..., num_computed_tokens: _Optional[int] = ..., failed: _Optional[bool] = ..., status_msg: _Optional[str] = ..., prefill_name: _Optional[str] = ...) -> None: ...

class DisaggGenerationsRequests(_message.Message):
    __slots__ = ("gens",)
    GENS_FIELD_NUMBER: _ClassVar[int]
    gens: _containers.RepeatedCompositeFieldContainer[DisaggGenerationsRequest]
    def __init__(self, gens: _Optional[_Iterable[_Union[DisaggGenerationsRequest, _Mapping]]] = ...) -> None: ...

class LogProbData(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "token_bytes")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    token_bytes: bytes
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., token_bytes: _Optional[bytes] = ...) -> None: ...

class LogProb(_message.Message):
    __slots__ = ("data", "top_logprobs")
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    data: LogProbData
    top_logprobs: _containers.RepeatedCompositeFieldContainer[LogProbData]
    def __init__(self, data: _Optional[_Union[LogProbData, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[LogProbData, _Mapping]]] = ...) -> None: ...

class SequenceOutput(_message.Message):
    __slots__ = ("index", "text", "token_ids", "finish_reason", "logprobs", "stop_str", "has_stop_token", "stop_token")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    HAS_STOP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    logprobs: _containers.RepeatedCompositeFieldContainer[LogProb]
    stop_str: str
    has_stop_token: bool
    stop_token: int
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[LogProb, _Mapping]]] = ..., stop_str: _Optional[str] = ..., has_stop_token: _Optional[bool] = ..., stop_token: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("num_prompt_tokens", "num_generated_tokens", "num_total_tokens", "num_cached_tokens", "num_accepted_prediction_tokens", "num_rejected_prediction_tokens")
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_prompt_tokens: int
    num_generated_tokens: int
    num_total_tokens: int
    num_cached_tokens: int
    num_accepted_prediction_tokens: int
    num_rejected_prediction_tokens: int
    def __init__(self, num_prompt_tokens: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., num_total_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_accepted_prediction_tokens: _Optional[int] = ..., num_rejected_prediction_tokens: _Optional[int] = ...) -> None: ...

class GenStatus(_message.Message):
    __slots__ = ("status_code", "status_msg")
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MSG_FIELD_NUMBER: _ClassVar[int]
    status_code: int
    status_msg: str
    def __init__(self, status_code: _Optional[int] = ..., status_msg: _Optional[str] = ...) -> None: ...

class DisaggStreamGeneration(_message.Message):
    __slots__ = ("req_id", "service_req_id", "gen_status", "outputs", "usage", "finished", "finished_on_prefill_instance", "prompt_token_ids", "unreachable_instance", "prompt_logprobs")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_REQ_ID_FIELD_NUMBER: _ClassVar[int]
    GEN_STATUS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_ON_PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    service_req_id: str
    gen_status: GenStatus
    outputs: _containers.RepeatedCompositeFieldContainer[SequenceOutput]
    usage: Usage
    finished: bool
    finished_on_prefill_instance: bool
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    unreachable_instance: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[LogProb]
    def __init__(self, req_id: _Optional[str] = ..., service_req_id: _Optional[str] = ..., gen_status: _Optional[_Union[GenStatus, _Mapping]] = ..., outputs: _Optional[_Iterable[_Union[SequenceOutput, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., finished: _Optional[bool] = ..., finished_on_prefill_instance: _Optional[bool] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., unreachable_instance: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[LogProb, _Mapping]]] = ...) -> None: ...

class DisaggStreamGenerations(_message.Message):
    __slots__ = ("gens", "instance_name")
    GENS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_NAME_FIELD_NUMBER: _ClassVar[int]
    gens: _containers.RepeatedCompositeFieldContainer[DisaggStreamGeneration]
    instance_name: str
    def __init__(self, gens: _Optional[_Iterable[_Union[DisaggStreamGeneration, _Mapping]]] = ..., instance_name: _Optional[str] = ...) -> None: ...

class MultiGenerationsRequest(_message.Message):
    __slots__ = ("request", "generated_token_ids", "kv", "num_unread_tokens", "has_num_unread_tokens")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    NUM_UNREAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_NUM_UNREAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request: DisaggRequest
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv: DisaggGenerationsRequest
    num_unread_tokens: int
    has_num_unread_tokens: bool
    def __init__(self, request: _Optional[_Union[DisaggRequest, _Mapping]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., kv: _Optional[_Union[DisaggGenerationsRequest, _Mapping]] = ..., num_unread_tokens: _Optional[int] = ..., has_num_unread_tokens: _Optional[bool] = ...) -> None: ...

class MultiGenerationsRequests(_message.Message):
    __slots__ = ("reqs",)
    REQS_FIELD_NUMBER: _ClassVar[int]
    reqs: _containers.RepeatedCompositeFieldContainer[MultiGenerationsRequest]
    def __init__(self, reqs: _Optional[_Iterable[_Union[MultiGenerationsRequest, _Mapping]]] = ...) -> None: ...

class PullSignal(_message.Message):
    __slots__ = ("req_id", "source_instance_name", "preferred_req_len", "max_total_len")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INSTANCE_NAME_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_REQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_LEN_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    source_instance_name: str
    preferred_req_len: int
    max_total_len: int
    def __init__(self, req_id: _Optional[str] = ..., source_instance_name: _Optional[str] = ..., preferred_req_len: _Optional[int] = ..., max_total_len: _Optional[int] = ...) -> None: ...

class PullReply(_message.Message):
    __slots__ = ("status", "num_handed")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDED_FIELD_NUMBER: _ClassVar[int]
    status: Status
    num_handed: int
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., num_handed: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("req_id", "service_req_id", "reason")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_REQ_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    service_req_id: str
    reason: str
    def __init__(self, req_id: _Optional[str] = ..., service_req_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class InstanceClusterInfo(_message.Message):
    __slots__ = ("instance_name", "cluster_ids", "addrs", "ports", "dp_size", "worker_rpc_addrs", "meta")
    INSTANCE_NAME_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_IDS_FIELD_NUMBER: _ClassVar[int]
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKER_RPC_ADDRS_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    instance_name: str
    cluster_ids: _containers.RepeatedScalarFieldContainer[int]
    addrs: _containers.RepeatedScalarFieldContainer[str]
    ports: _containers.RepeatedScalarFieldContainer[int]
    dp_size: int
    worker_rpc_addrs: _containers.RepeatedScalarFieldContainer[str]
    meta: InstanceMetaInfo
    def __init__(self, instance_name: _Optional[str] = ..., cluster_ids: _Optional[_Iterable[int]] = ..., addrs: _Optional[_Iterable[str]] = ..., ports: _Optional[_Iterable[int]] = ..., dp_size: _Optional[int] = ..., worker_rpc_addrs: _Optional[_Iterable[str]] = ..., meta: _Optional[_Union[InstanceMetaInfo, _Mapping]] = ...) -> None: ...

class PullKVCacheRequest(_message.Message):
    __slots__ = ("cluster_id", "addr", "src_blocks", "dst_blocks", "req_id", "transfer_key", "src_head_start", "dst_head_start", "num_heads", "src_layer_start", "dst_layer_start", "num_layers")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_KEY_FIELD_NUMBER: _ClassVar[int]
    SRC_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    DST_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    SRC_LAYER_START_FIELD_NUMBER: _ClassVar[int]
    DST_LAYER_START_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    cluster_id: int
    addr: str
    src_blocks: _containers.RepeatedScalarFieldContainer[int]
    dst_blocks: _containers.RepeatedScalarFieldContainer[int]
    req_id: str
    transfer_key: str
    src_head_start: int
    dst_head_start: int
    num_heads: int
    src_layer_start: int
    dst_layer_start: int
    num_layers: int
    def __init__(self, cluster_id: _Optional[int] = ..., addr: _Optional[str] = ..., src_blocks: _Optional[_Iterable[int]] = ..., dst_blocks: _Optional[_Iterable[int]] = ..., req_id: _Optional[str] = ..., transfer_key: _Optional[str] = ..., src_head_start: _Optional[int] = ..., dst_head_start: _Optional[int] = ..., num_heads: _Optional[int] = ..., src_layer_start: _Optional[int] = ..., dst_layer_start: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class PushKVCacheRequest(_message.Message):
    __slots__ = ("cluster_id", "addr", "src_blocks", "dst_blocks", "req_id", "transfer_key", "src_head_start", "dst_head_start", "num_heads", "src_layer_start", "dst_layer_start", "num_layers")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_KEY_FIELD_NUMBER: _ClassVar[int]
    SRC_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    DST_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    SRC_LAYER_START_FIELD_NUMBER: _ClassVar[int]
    DST_LAYER_START_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    cluster_id: int
    addr: str
    src_blocks: _containers.RepeatedScalarFieldContainer[int]
    dst_blocks: _containers.RepeatedScalarFieldContainer[int]
    req_id: str
    transfer_key: str
    src_head_start: int
    dst_head_start: int
    num_heads: int
    src_layer_start: int
    dst_layer_start: int
    num_layers: int
    def __init__(self, cluster_id: _Optional[int] = ..., addr: _Optional[str] = ..., src_blocks: _Optional[_Iterable[int]] = ..., dst_blocks: _Optional[_Iterable[int]] = ..., req_id: _Optional[str] = ..., transfer_key: _Optional[str] = ..., src_head_start: _Optional[int] = ..., dst_head_start: _Optional[int] = ..., num_heads: _Optional[int] = ..., src_layer_start: _Optional[int] = ..., dst_layer_start: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class ClusterLink(_message.Message):
    __slots__ = ("cluster_ids", "addrs", "meta")
    CLUSTER_IDS_FIELD_NUMBER: _ClassVar[int]
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    cluster_ids: _containers.RepeatedScalarFieldContainer[int]
    addrs: _containers.RepeatedScalarFieldContainer[str]
    meta: InstanceMetaInfo
    def __init__(self, cluster_ids: _Optional[_Iterable[int]] = ..., addrs: _Optional[_Iterable[str]] = ..., meta: _Optional[_Union[InstanceMetaInfo, _Mapping]] = ...) -> None: ...

class CacheInfo(_message.Message):
    __slots__ = ("cluster_id", "addr", "num_blocks", "block_size", "num_layers", "num_kv_heads", "head_dim", "kv_dtype", "kv_layout", "block_bytes")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    cluster_id: int
    addr: str
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    kv_layout: str
    block_bytes: int
    def __init__(self, cluster_id: _Optional[int] = ..., addr: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., kv_layout: _Optional[str] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class TransferOpMetrics(_message.Message):
    __slots__ = ("op", "bytes", "blocks", "bucket_counts", "seconds_sum")
    OP_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    op: str
    bytes: int
    blocks: int
    bucket_counts: _containers.RepeatedScalarFieldContainer[int]
    seconds_sum: float
    def __init__(self, op: _Optional[str] = ..., bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., bucket_counts: _Optional[_Iterable[int]] = ..., seconds_sum: _Optional[float] = ...) -> None: ...

class TransferFailureMetrics(_message.Message):
    __slots__ = ("op", "reason", "count")
    OP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    op: str
    reason: str
    count: int
    def __init__(self, op: _Optional[str] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class TransferMetrics(_message.Message):
    __slots__ = ("buckets", "ops", "failures")
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    buckets: _containers.RepeatedScalarFieldContainer[float]
    ops: _containers.RepeatedCompositeFieldContainer[TransferOpMetrics]
    failures: _containers.RepeatedCompositeFieldContainer[TransferFailureMetrics]
    def __init__(self, buckets: _Optional[_Iterable[float]] = ..., ops: _Optional[_Iterable[_Union[TransferOpMetrics, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[TransferFailureMetrics, _Mapping]]] = ...) -> None: ...
