from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LinkFrame(_message.Message):
    __slots__ = ("key", "hello", "start", "cancel", "event")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    key: str
    hello: LinkHello
    start: StreamCall
    cancel: bool
    event: StreamEvent
    def __init__(self, key: _Optional[str] = ..., hello: _Optional[_Union[LinkHello, _Mapping]] = ..., start: _Optional[_Union[StreamCall, _Mapping]] = ..., cancel: _Optional[bool] = ..., event: _Optional[_Union[StreamEvent, _Mapping]] = ...) -> None: ...

class LinkHello(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class StreamCall(_message.Message):
    __slots__ = ("key", "caller", "generate", "resume", "handle_token", "handle_epoch")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    HANDLE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HANDLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    key: str
    caller: str
    generate: GenerateParams
    resume: ResumeParams
    handle_token: bytes
    handle_epoch: int
    def __init__(self, key: _Optional[str] = ..., caller: _Optional[str] = ..., generate: _Optional[_Union[GenerateParams, _Mapping]] = ..., resume: _Optional[_Union[ResumeParams, _Mapping]] = ..., handle_token: _Optional[bytes] = ..., handle_epoch: _Optional[int] = ...) -> None: ...

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

class Sampling(_message.Message):
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

class Speculative(_message.Message):
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

class EarlyExit(_message.Message):
    __slots__ = ("criterion", "cache", "threshold", "min_loops", "patience")
    CRITERION_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MIN_LOOPS_FIELD_NUMBER: _ClassVar[int]
    PATIENCE_FIELD_NUMBER: _ClassVar[int]
    criterion: str
    cache: str
    threshold: float
    min_loops: int
    patience: int
    def __init__(self, criterion: _Optional[str] = ..., cache: _Optional[str] = ..., threshold: _Optional[float] = ..., min_loops: _Optional[int] = ..., patience: _Optional[int] = ...) -> None: ...

class GenerateParams(_message.Message):
    __slots__ = ("prompt", "loops", "max_tokens", "stop_token_ids", "cache_window", "include_text", "sampling", "speculative", "l_warmup_tokens", "l_warmup_loops", "safety_check", "safety_norm_threshold", "kv_mode", "early_exit", "return_handle", "handle_max_loops", "timeout_s")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    LOOPS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    L_WARMUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    L_WARMUP_LOOPS_FIELD_NUMBER: _ClassVar[int]
    SAFETY_CHECK_FIELD_NUMBER: _ClassVar[int]
    SAFETY_NORM_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    KV_MODE_FIELD_NUMBER: _ClassVar[int]
    EARLY_EXIT_FIELD_NUMBER: _ClassVar[int]
    RETURN_HANDLE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_MAX_LOOPS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    prompt: Prompt
    loops: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_window: int
    include_text: bool
    sampling: Sampling
    speculative: Speculative
    l_warmup_tokens: int
    l_warmup_loops: int
    safety_check: bool
    safety_norm_threshold: float
    kv_mode: str
    early_exit: EarlyExit
    return_handle: bool
    handle_max_loops: int
    timeout_s: float
    def __init__(self, prompt: _Optional[_Union[Prompt, _Mapping]] = ..., loops: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., cache_window: _Optional[int] = ..., include_text: _Optional[bool] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., speculative: _Optional[_Union[Speculative, _Mapping]] = ..., l_warmup_tokens: _Optional[int] = ..., l_warmup_loops: _Optional[int] = ..., safety_check: _Optional[bool] = ..., safety_norm_threshold: _Optional[float] = ..., kv_mode: _Optional[str] = ..., early_exit: _Optional[_Union[EarlyExit, _Mapping]] = ..., return_handle: _Optional[bool] = ..., handle_max_loops: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class BuildParams(_message.Message):
    __slots__ = ("prompt", "l_used", "max_loops", "cache_window", "seed", "kv_mode")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    L_USED_FIELD_NUMBER: _ClassVar[int]
    MAX_LOOPS_FIELD_NUMBER: _ClassVar[int]
    CACHE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    KV_MODE_FIELD_NUMBER: _ClassVar[int]
    prompt: Prompt
    l_used: int
    max_loops: int
    cache_window: int
    seed: int
    kv_mode: str
    def __init__(self, prompt: _Optional[_Union[Prompt, _Mapping]] = ..., l_used: _Optional[int] = ..., max_loops: _Optional[int] = ..., cache_window: _Optional[int] = ..., seed: _Optional[int] = ..., kv_mode: _Optional[str] = ...) -> None: ...

class ScoreParams(_message.Message):
    __slots__ = ("prompt", "consistency", "uncertainty")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    UNCERTAINTY_FIELD_NUMBER: _ClassVar[int]
    prompt: Prompt
    consistency: Consistency
    uncertainty: Uncertainty
    def __init__(self, prompt: _Optional[_Union[Prompt, _Mapping]] = ..., consistency: _Optional[_Union[Consistency, _Mapping]] = ..., uncertainty: _Optional[_Union[Uncertainty, _Mapping]] = ...) -> None: ...

class Consistency(_message.Message):
    __slots__ = ("loops_a", "loops_b", "max_tokens")
    LOOPS_A_FIELD_NUMBER: _ClassVar[int]
    LOOPS_B_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    loops_a: int
    loops_b: int
    max_tokens: int
    def __init__(self, loops_a: _Optional[int] = ..., loops_b: _Optional[int] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class Uncertainty(_message.Message):
    __slots__ = ("l_lo", "l_hi", "return_logits")
    L_LO_FIELD_NUMBER: _ClassVar[int]
    L_HI_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    l_lo: int
    l_hi: int
    return_logits: bool
    def __init__(self, l_lo: _Optional[int] = ..., l_hi: _Optional[int] = ..., return_logits: _Optional[bool] = ...) -> None: ...

class TrajectoryParams(_message.Message):
    __slots__ = ("prompt", "n_loops")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    N_LOOPS_FIELD_NUMBER: _ClassVar[int]
    prompt: Prompt
    n_loops: int
    def __init__(self, prompt: _Optional[_Union[Prompt, _Mapping]] = ..., n_loops: _Optional[int] = ...) -> None: ...

class ResumeParams(_message.Message):
    __slots__ = ("new_loops", "max_tokens", "stop_token_ids", "cache_window", "include_text", "sampling", "kv_mode", "timeout_s")
    NEW_LOOPS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_MODE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    new_loops: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_window: int
    include_text: bool
    sampling: Sampling
    kv_mode: str
    timeout_s: float
    def __init__(self, new_loops: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., cache_window: _Optional[int] = ..., include_text: _Optional[bool] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., kv_mode: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class StreamEvent(_message.Message):
    __slots__ = ("chunk", "complete", "error")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    complete: Complete
    error: Error
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., complete: _Optional[_Union[Complete, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("ids", "text")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class Complete(_message.Message):
    __slots__ = ("reason", "worker_id", "usage", "handle")
    REASON_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    worker_id: str
    usage: Usage
    handle: Handle
    def __init__(self, reason: _Optional[str] = ..., worker_id: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., handle: _Optional[_Union[Handle, _Mapping]] = ...) -> None: ...

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

class Handle(_message.Message):
    __slots__ = ("token", "epoch", "seq_len", "loops_used", "max_loops", "nbytes", "worker_id", "expires_in_s")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    LOOPS_USED_FIELD_NUMBER: _ClassVar[int]
    MAX_LOOPS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    epoch: int
    seq_len: int
    loops_used: int
    max_loops: int
    nbytes: int
    worker_id: str
    expires_in_s: float
    def __init__(self, token: _Optional[bytes] = ..., epoch: _Optional[int] = ..., seq_len: _Optional[int] = ..., loops_used: _Optional[int] = ..., max_loops: _Optional[int] = ..., nbytes: _Optional[int] = ..., worker_id: _Optional[str] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class BuildResult(_message.Message):
    __slots__ = ("handle", "error")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    handle: Handle
    error: Error
    def __init__(self, handle: _Optional[_Union[Handle, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class FreeResult(_message.Message):
    __slots__ = ("freed", "error")
    FREED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    freed: bool
    error: Error
    def __init__(self, freed: _Optional[bool] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("worker_id", "consistency", "uncertainty", "error")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    UNCERTAINTY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    consistency: ConsistencyAnswer
    uncertainty: UncertaintyAnswer
    error: Error
    def __init__(self, worker_id: _Optional[str] = ..., consistency: _Optional[_Union[ConsistencyAnswer, _Mapping]] = ..., uncertainty: _Optional[_Union[UncertaintyAnswer, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class ConsistencyAnswer(_message.Message):
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

class UncertaintyAnswer(_message.Message):
    __slots__ = ("kl", "logits")
    KL_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    kl: float
    logits: bytes
    def __init__(self, kl: _Optional[float] = ..., logits: _Optional[bytes] = ...) -> None: ...

class TrajectoryResult(_message.Message):
    __slots__ = ("worker_id", "trajectory", "error")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    trajectory: Trajectory
    error: Error
    def __init__(self, worker_id: _Optional[str] = ..., trajectory: _Optional[_Union[Trajectory, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("labels", "d_model", "hidden")
    LABELS_FIELD_NUMBER: _ClassVar[int]
    D_MODEL_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.RepeatedScalarFieldContainer[str]
    d_model: int
    hidden: bytes
    def __init__(self, labels: _Optional[_Iterable[str]] = ..., d_model: _Optional[int] = ..., hidden: _Optional[bytes] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "reason", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    reason: str
    message: str
    def __init__(self, code: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
