from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_DEVICE: _ClassVar[KvTier]
    KV_TIER_HOST: _ClassVar[KvTier]
    KV_TIER_STORE: _ClassVar[KvTier]
KV_TIER_DEVICE: KvTier
KV_TIER_HOST: KvTier
KV_TIER_STORE: KvTier

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "return_logprobs", "skip_special_tokens", "guided_kind", "guided_value", "logit_bias", "min_tokens", "prompt_logprobs", "include_stop_str_in_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_KIND_FIELD_NUMBER: _ClassVar[int]
    GUIDED_VALUE_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int
    return_logprobs: bool
    skip_special_tokens: bool
    guided_kind: str
    guided_value: str
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    prompt_logprobs: int
    include_stop_str_in_output: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: bool = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., return_logprobs: bool = ..., skip_special_tokens: bool = ..., guided_kind: _Optional[str] = ..., guided_value: _Optional[str] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., include_stop_str_in_output: bool = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("model_fingerprint", "layout_version", "dtype", "block_size", "block_keys", "num_tokens", "connector", "source_address", "transfer_id", "lora_identity")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    layout_version: int
    dtype: str
    block_size: int
    block_keys: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: int
    connector: str
    source_address: str
    transfer_id: str
    lora_identity: str
    def __init__(self, model_fingerprint: _Optional[str] = ..., layout_version: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., block_keys: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[int] = ..., connector: _Optional[str] = ..., source_address: _Optional[str] = ..., transfer_id: _Optional[str] = ..., lora_identity: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "priority", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    priority: int
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., lora_name: _Optional[str] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "kv_committed", "timings")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    kv_committed: KvHandle
    timings: PhaseTimings
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., kv_committed: _Optional[_Union[KvHandle, _Mapping]] = ..., timings: _Optional[_Union[PhaseTimings, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "text", "logprob", "num_cached_tokens", "finished", "finish_reason", "prompt_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: TokenLogprob
    num_cached_tokens: int
    finished: bool
    finish_reason: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., finished: bool = ..., finish_reason: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "generated_token_ids", "params", "kv_handle", "priority", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    kv_handle: KvHandle
    priority: int
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv_handle: _Optional[_Union[KvHandle, _Mapping]] = ..., priority: _Optional[int] = ..., lora_name: _Optional[str] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finished", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "timings", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finished: bool
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    timings: PhaseTimings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finished: bool = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[PhaseTimings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class PhaseTimings(_message.Message):
    __slots__ = ("queue_s", "compute_s", "kv_save_s", "kv_load_s", "kv_blocks_loaded", "kv_blocks_recomputed", "kv_blocks_local", "kv_bytes_loaded")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    KV_SAVE_S_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_S_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_LOADED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_LOCAL_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    compute_s: float
    kv_save_s: float
    kv_load_s: float
    kv_blocks_loaded: int
    kv_blocks_recomputed: int
    kv_blocks_local: int
    kv_bytes_loaded: int
    def __init__(self, queue_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., kv_save_s: _Optional[float] = ..., kv_load_s: _Optional[float] = ..., kv_blocks_loaded: _Optional[int] = ..., kv_blocks_recomputed: _Optional[int] = ..., kv_blocks_local: _Optional[int] = ..., kv_bytes_loaded: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: bool = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadInfo(_message.Message):
    __slots__ = ("waiting", "running", "free_kv_blocks", "total_kv_blocks", "prefix_hit_rate", "model_fingerprint", "model_name", "draining", "lora_adapters", "resident_lora_adapters")
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    waiting: int
    running: int
    free_kv_blocks: int
    total_kv_blocks: int
    prefix_hit_rate: float
    model_fingerprint: str
    model_name: str
    draining: bool
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    resident_lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, waiting: _Optional[int] = ..., running: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., prefix_hit_rate: _Optional[float] = ..., model_fingerprint: _Optional[str] = ..., model_name: _Optional[str] = ..., draining: bool = ..., lora_adapters: _Optional[_Iterable[str]] = ..., resident_lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoRAAdaptersReply(_message.Message):
    __slots__ = ("lora_adapters",)
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class KvBlockEvent(_message.Message):
    __slots__ = ("kind", "tier", "block_hashes", "parent_hash")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STORED: _ClassVar[KvBlockEvent.Kind]
        REMOVED: _ClassVar[KvBlockEvent.Kind]
        CLEARED: _ClassVar[KvBlockEvent.Kind]
    STORED: KvBlockEvent.Kind
    REMOVED: KvBlockEvent.Kind
    CLEARED: KvBlockEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    kind: KvBlockEvent.Kind
    tier: KvTier
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    def __init__(self, kind: _Optional[_Union[KvBlockEvent.Kind, str]] = ..., tier: _Optional[_Union[KvTier, str]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ...) -> None: ...

class KvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("instance_epoch", "seq", "snapshot", "events")
    INSTANCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    instance_epoch: str
    seq: int
    snapshot: bool
    events: _containers.RepeatedCompositeFieldContainer[KvBlockEvent]
    def __init__(self, instance_epoch: _Optional[str] = ..., seq: _Optional[int] = ..., snapshot: bool = ..., events: _Optional[_Iterable[_Union[KvBlockEvent, _Mapping]]] = ...) -> None: ...
