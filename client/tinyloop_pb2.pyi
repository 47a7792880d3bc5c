from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_SAFETY: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_SAFETY: FinishReason

class Prompt(_message.Message):
    __slots__ = ("text", "ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    ids: TokenIds
    def __init__(self, text: _Optional[str] = ..., ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "repetition_penalty", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SpeculativeOptions(_message.Message):
    __slots__ = ("draft_loops", "verify_loops", "draft_ahead", "k_branches")
    DRAFT_LOOPS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_LOOPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    K_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    draft_loops: int
    verify_loops: int
    draft_ahead: int
    k_branches: int
    def __init__(self, draft_loops: _Optional[int] = ..., verify_loops: _Optional[int] = ..., draft_ahead: _Optional[int] = ..., k_branches: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "loops", "max_tokens", "sampling", "stop_token_ids", "cache_window", "include_text", "speculative", "return_handle", "handle_max_loops", "l_warmup_tokens", "l_warmup_loops", "safety_check", "safety_norm_threshold", "kv_mode", "early_exit")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    LOOPS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TEXT_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    RETURN_HANDLE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_MAX_LOOPS_FIELD_NUMBER: _ClassVar[int]
    L_WARMUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    L_WARMUP_LOOPS_FIELD_NUMBER: _ClassVar[int]
    SAFETY_CHECK_FIELD_NUMBER: _ClassVar[int]
    SAFETY_NORM_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    KV_MODE_FIELD_NUMBER: _ClassVar[int]
    EARLY_EXIT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: Prompt
    loops: int
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_window: int
    include_text: bool
    speculative: SpeculativeOptions
    return_handle: bool
    handle_max_loops: int
    l_warmup_tokens: int
    l_warmup_loops: int
    safety_check: bool
    safety_norm_threshold: float
    kv_mode: str
    early_exit: EarlyExit
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., loops: _Optional[int] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., cache_window: _Optional[int] = ..., include_text: _Optional[bool] = ..., speculative: _Optional[_Union[SpeculativeOptions, _Mapping]] = ..., return_handle: _Optional[bool] = ..., handle_max_loops: _Optional[int] = ..., l_warmup_tokens: _Optional[int] = ..., l_warmup_loops: _Optional[int] = ..., safety_check: _Optional[bool] = ..., safety_norm_threshold: _Optional[float] = ..., kv_mode: _Optional[str] = ..., early_exit: _Optional[_Union[EarlyExit, _Mapping]] = ...) -> None: ...

class EarlyExit(_message.Message):
    __slots__ = ("criterion", "threshold", "min_loops", "patience", "cache")
    CRITERION_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MIN_LOOPS_FIELD_NUMBER: _ClassVar[int]
    PATIENCE_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    criterion: str
    threshold: float
    min_loops: int
    patience: int
    cache: str
    def __init__(self, criterion: _Optional[str] = ..., threshold: _Optional[float] = ..., min_loops: _Optional[int] = ..., patience: _Optional[int] = ..., cache: _Optional[str] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("request_id", "handle_id", "new_loops", "max_tokens", "sampling", "stop_token_ids", "cache_window", "include_text", "kv_mode")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_LOOPS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TEXT_FIELD_NUMBER: _ClassVar[int]
    KV_MODE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    handle_id: str
    new_loops: int
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_window: int
    include_text: bool
    kv_mode: str
    def __init__(self, request_id: _Optional[str] = ..., handle_id: _Optional[str] = ..., new_loops: _Optional[int] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., cache_window: _Optional[int] = ..., include_text: _Optional[bool] = ..., kv_mode: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "complete")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: Chunk
    complete: Complete
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., complete: _Optional[_Union[Complete, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("ids", "text")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class Complete(_message.Message):
    __slots__ = ("finish_reason", "usage", "worker_id", "handle_id")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: Usage
    worker_id: str
    handle_id: str
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., worker_id: _Optional[str] = ..., handle_id: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "loop_iterations", "loop_token_iterations", "accepted_per_verify", "acceptance_rate", "iterations_per_token", "iterations_histogram")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOP_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    LOOP_TOKEN_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_VERIFY_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    loop_iterations: int
    loop_token_iterations: int
    accepted_per_verify: float
    acceptance_rate: float
    iterations_per_token: float
    iterations_histogram: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., loop_iterations: _Optional[int] = ..., loop_token_iterations: _Optional[int] = ..., accepted_per_verify: _Optional[float] = ..., acceptance_rate: _Optional[float] = ..., iterations_per_token: _Optional[float] = ..., iterations_histogram: _Optional[_Iterable[int]] = ...) -> None: ...

class BuildResumeHandleRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "l_used", "max_loops", "cache_window", "seed", "kv_mode")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    L_USED_FIELD_NUMBER: _ClassVar[int]
    MAX_LOOPS_FIELD_NUMBER: _ClassVar[int]
    CACHE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    KV_MODE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: Prompt
    l_used: int
    max_loops: int
    cache_window: int
    seed: int
    kv_mode: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., l_used: _Optional[int] = ..., max_loops: _Optional[int] = ..., cache_window: _Optional[int] = ..., seed: _Optional[int] = ..., kv_mode: _Optional[str] = ...) -> None: ...

class BuildResumeHandleResponse(_message.Message):
    __slots__ = ("request_id", "handle_id", "seq_len", "loops_used", "max_loops", "nbytes", "worker_id", "expires_in_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    LOOPS_USED_FIELD_NUMBER: _ClassVar[int]
    MAX_LOOPS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    handle_id: str
    seq_len: int
    loops_used: int
    max_loops: int
    nbytes: int
    worker_id: str
    expires_in_s: float
    def __init__(self, request_id: _Optional[str] = ..., handle_id: _Optional[str] = ..., seq_len: _Optional[int] = ..., loops_used: _Optional[int] = ..., max_loops: _Optional[int] = ..., nbytes: _Optional[int] = ..., worker_id: _Optional[str] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class FreeHandleRequest(_message.Message):
    __slots__ = ("request_id", "handle_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    handle_id: str
    def __init__(self, request_id: _Optional[str] = ..., handle_id: _Optional[str] = ...) -> None: ...

class FreeHandleResponse(_message.Message):
    __slots__ = ("request_id", "freed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    freed: bool
    def __init__(self, request_id: _Optional[str] = ..., freed: _Optional[bool] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "consistency", "uncertainty")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    UNCERTAINTY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: Prompt
    consistency: ConsistencyScore
    uncertainty: UncertaintyScore
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., consistency: _Optional[_Union[ConsistencyScore, _Mapping]] = ..., uncertainty: _Optional[_Union[UncertaintyScore, _Mapping]] = ...) -> None: ...

class ConsistencyScore(_message.Message):
    __slots__ = ("loops_a", "loops_b", "max_tokens")
    LOOPS_A_FIELD_NUMBER: _ClassVar[int]
    LOOPS_B_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    loops_a: int
    loops_b: int
    max_tokens: int
    def __init__(self, loops_a: _Optional[int] = ..., loops_b: _Optional[int] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class UncertaintyScore(_message.Message):
    __slots__ = ("l_lo", "l_hi", "return_logits")
    L_LO_FIELD_NUMBER: _ClassVar[int]
    L_HI_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    l_lo: int
    l_hi: int
    return_logits: bool
    def __init__(self, l_lo: _Optional[int] = ..., l_hi: _Optional[int] = ..., return_logits: _Optional[bool] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("request_id", "worker_id", "consistency", "uncertainty")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    UNCERTAINTY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker_id: str
    consistency: ConsistencyResult
    uncertainty: UncertaintyResult
    def __init__(self, request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., consistency: _Optional[_Union[ConsistencyResult, _Mapping]] = ..., uncertainty: _Optional[_Union[UncertaintyResult, _Mapping]] = ...) -> None: ...

class ConsistencyResult(_message.Message):
    __slots__ = ("agree", "answer_a", "answer_b", "first_divergence")
    AGREE_FIELD_NUMBER: _ClassVar[int]
    ANSWER_A_FIELD_NUMBER: _ClassVar[int]
    ANSWER_B_FIELD_NUMBER: _ClassVar[int]
    FIRST_DIVERGENCE_FIELD_NUMBER: _ClassVar[int]
    agree: bool
    answer_a: _containers.RepeatedScalarFieldContainer[int]
    answer_b: _containers.RepeatedScalarFieldContainer[int]
    first_divergence: int
    def __init__(self, agree: _Optional[bool] = ..., answer_a: _Optional[_Iterable[int]] = ..., answer_b: _Optional[_Iterable[int]] = ..., first_divergence: _Optional[int] = ...) -> None: ...

class UncertaintyResult(_message.Message):
    __slots__ = ("kl", "logits")
    KL_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    kl: float
    logits: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, kl: _Optional[float] = ..., logits: _Optional[_Iterable[float]] = ...) -> None: ...

class ScoreTrajectoryRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "n_loops")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    N_LOOPS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: Prompt
    n_loops: int
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., n_loops: _Optional[int] = ...) -> None: ...

class ScoreTrajectoryResponse(_message.Message):
    __slots__ = ("request_id", "labels", "d_model", "hidden", "worker_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    D_MODEL_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    d_model: int
    hidden: _containers.RepeatedScalarFieldContainer[float]
    worker_id: str
    def __init__(self, request_id: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., d_model: _Optional[int] = ..., hidden: _Optional[_Iterable[float]] = ..., worker_id: _Optional[str] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model_name", "vocab_size", "d_model", "default_loops", "max_loops", "max_seq_len", "eos_id", "workers", "config_json", "kv_mode", "kv_bytes_per_token_layer", "weight_format")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    D_MODEL_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_LOOPS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOOPS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    KV_MODE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_LAYER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    d_model: int
    default_loops: int
    max_loops: int
    max_seq_len: int
    eos_id: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    config_json: str
    kv_mode: str
    kv_bytes_per_token_layer: float
    weight_format: str
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., d_model: _Optional[int] = ..., default_loops: _Optional[int] = ..., max_loops: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., eos_id: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., config_json: _Optional[str] = ..., kv_mode: _Optional[str] = ..., kv_bytes_per_token_layer: _Optional[float] = ..., weight_format: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "epoch", "device", "lanes", "active_lanes", "handles", "handle_bytes", "alive")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LANES_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    HANDLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    device: str
    lanes: int
    active_lanes: int
    handles: int
    handle_bytes: int
    alive: bool
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., device: _Optional[str] = ..., lanes: _Optional[int] = ..., active_lanes: _Optional[int] = ..., handles: _Optional[int] = ..., handle_bytes: _Optional[int] = ..., alive: _Optional[bool] = ...) -> None: ...
