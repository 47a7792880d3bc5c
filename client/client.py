"""`TinyLoopClient` (blocking) and `AsyncTinyLoopClient` (asyncio) over the generated stubs.

    with TinyLoopClient("127.0.0.1:50051") as c:
        stream = c.generate("def fib(n):", loops=8, max_tokens=32, include_text=True)
        for chunk in stream:
            print(chunk.text, end="")
        print(stream.complete.finish_reason)

Errors raise `TinyLoopError` with the gRPC `code` and the machine-readable `reason` from the
status's `google.rpc.ErrorInfo`.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import grpc
import numpy as np
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tinyloop.client import tinyloop_pb2 as pb
from tinyloop.client import tinyloop_pb2_grpc as pb_grpc

CALLER_KEY = "x-tinyloop-caller"
FINISH_NAMES = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop",
                pb.FINISH_REASON_SAFETY: "safety", pb.FINISH_REASON_UNSPECIFIED: "unspecified"}
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                   ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
                   ("grpc.keepalive_permit_without_calls", 1)]
SERVICE = "tinyloop.v1.TinyLoop"
MAX_ATTEMPTS = 4  # gRPC caps a retry policy at 5


def channel_options(max_attempts: int = MAX_ATTEMPTS) -> list[tuple[str, object]]:
    """CHANNEL_OPTIONS with gRPC's own retry policy: a call answered UNAVAILABLE before any
    response message (a gateway draining for a rolling update, a worker lost before the call's
    first token, a gateway not reachable yet) is tried again, up to `max_attempts` attempts in
    all, after a randomized exponential backoff (0.1 s doubling to 1 s), so that the channel's
    load balancing (several gateway addresses behind one name) can take it elsewhere. A stream
    that has sent a message is committed and never replayed: its tokens are not duplicated.
    Retries are throttled per channel (gRPC's retryThrottling) so that a failing service sees
    no storm of them. max_attempts 1: no retry."""
    import json
    if not 1 <= max_attempts <= 5:
        raise ValueError(f"max_attempts must be in [1, 5] (gRPC's retry policy caps it at 5), got {max_attempts}")
    if max_attempts == 1:
        return [*CHANNEL_OPTIONS, ("grpc.enable_retries", 0)]
    config = {"methodConfig": [{"name": [{"service": SERVICE}],
                                "retryPolicy": {"maxAttempts": max_attempts, "initialBackoff": "0.1s",
                                                "maxBackoff": "1s", "backoffMultiplier": 2,
                                                "retryableStatusCodes": ["UNAVAILABLE"]}}],
              "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}}
    return [*CHANNEL_OPTIONS, ("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config))]


class TinyLoopError(RuntimeError):
    """A failed RPC: `.code` (grpc.StatusCode), `.reason` (ErrorInfo reason or the code's
    name), `.message`."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str):
        super().__init__(f"{code.name} {reason}: {message}")
        self.code, self.reason, self.message = code, reason, message

    @classmethod
    def from_rpc_error(cls, e: grpc.RpcError) -> "TinyLoopError":
        reason = e.code().name
        try:
            status = rpc_status.from_call(e)
        except ValueError:
            status = None
        if status is not None:
            for detail in status.details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    reason = info.reason
        return cls(e.code(), reason, e.details() or "")


@dataclass
class Chunk:
    ids: list[int]
    text: str = ""


@dataclass
class Complete:
    request_id: str
    finish_reason: str
    usage: dict
    worker_id: str
    handle_id: str = ""


@dataclass
class Handle:
    handle_id: str
    seq_len: int
    loops_used: int
    max_loops: int
    nbytes: int
    worker_id: str
    expires_in_s: float


def _prompt(prompt) -> pb.Prompt:
    if isinstance(prompt, str):
        return pb.Prompt(text=prompt)
    return pb.Prompt(ids=pb.TokenIds(ids=[int(t) for t in prompt]))


def _sampling(temperature, top_k, top_p, repetition_penalty, seed) -> pb.SamplingParams:
    s = pb.SamplingParams()
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                        ("repetition_penalty", repetition_penalty), ("seed", seed)):
        if value is not None:
            setattr(s, name, value)
    return s


def generate_request(prompt, *, loops=None, max_tokens=None, temperature=None, top_k=None, top_p=None,
                     repetition_penalty=None, seed=None, stop_token_ids=(), cache_window=0,
                     include_text=False, speculative: dict | None = None, return_handle=False,
                     handle_max_loops=None, l_warmup_tokens=0, l_warmup_loops=None, safety_check=False,
                     safety_norm_threshold=None, request_id=None, kv_mode="",
                     early_exit: dict | None = None) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id or uuid.uuid4().hex, prompt=_prompt(prompt),
                             sampling=_sampling(temperature, top_k, top_p, repetition_penalty, seed),
                             stop_token_ids=list(stop_token_ids), cache_window=cache_window,
                             include_text=include_text, return_handle=return_handle,
                             l_warmup_tokens=l_warmup_tokens, safety_check=safety_check, kv_mode=kv_mode)
    if l_warmup_loops is not None:
        req.l_warmup_loops = l_warmup_loops
    if safety_norm_threshold is not None:
        req.safety_norm_threshold = safety_norm_threshold
    if loops is not None:
        req.loops = loops
    if max_tokens is not None:
        req.max_tokens = max_tokens
    if handle_max_loops is not None:
        req.handle_max_loops = handle_max_loops
    if speculative:
        req.speculative.CopyFrom(pb.SpeculativeOptions(**speculative))
    if early_exit is not None:
        # {criterion, threshold, min_loops, patience, cache}, the in-process Model's keys
        req.early_exit.CopyFrom(pb.EarlyExit(**{k: v for k, v in early_exit.items() if v is not None}))
    return req


def resume_request(handle_id, new_loops, *, max_tokens=None, temperature=None, top_k=None, top_p=None,
                   repetition_penalty=None, seed=None, stop_token_ids=(), cache_window=0, include_text=False,
                   request_id=None, kv_mode="") -> pb.ResumeRequest:
    req = pb.ResumeRequest(request_id=request_id or uuid.uuid4().hex, handle_id=handle_id, new_loops=new_loops,
                           sampling=_sampling(temperature, top_k, top_p, repetition_penalty, seed),
                           stop_token_ids=list(stop_token_ids), cache_window=cache_window,
                           include_text=include_text, kv_mode=kv_mode)
    if max_tokens is not None:
        req.max_tokens = max_tokens
    return req


def build_request(prompt, l_used=None, max_loops=None, cache_window=0, seed=None, request_id=None, kv_mode=""):
    req = pb.BuildResumeHandleRequest(request_id=request_id or uuid.uuid4().hex, prompt=_prompt(prompt),
                                      cache_window=cache_window, kv_mode=kv_mode)
    if seed is not None:
        req.seed = seed
    if l_used is not None:
        req.l_used = l_used
    if max_loops is not None:
        req.max_loops = max_loops
    return req


def _complete(resp: pb.GenerateResponse) -> Complete:
    c, u = resp.complete, resp.complete.usage
    usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
             "loop_iterations": u.loop_iterations, "loop_token_iterations": u.loop_token_iterations,
             "accepted_per_verify": u.accepted_per_verify, "acceptance_rate": u.acceptance_rate}
    if u.iterations_histogram:
        usage["iterations_per_token"] = u.iterations_per_token
        usage["iterations_histogram"] = list(u.iterations_histogram)
    return Complete(resp.request_id, FINISH_NAMES[c.finish_reason], usage, c.worker_id, c.handle_id)


def _handle(r: pb.BuildResumeHandleResponse) -> Handle:
    return Handle(r.handle_id, r.seq_len, r.loops_used, r.max_loops, r.nbytes, r.worker_id, r.expires_in_s)


def _score(r: pb.ScoreResponse) -> dict:
    if r.WhichOneof("result") == "consistency":
        c = r.consistency
        return {"agree": c.agree, "answer_a": list(c.answer_a), "answer_b": list(c.answer_b),
                "first_divergence": c.first_divergence, "worker_id": r.worker_id}
    return {"kl": r.uncertainty.kl, "logits": np.asarray(r.uncertainty.logits, dtype=np.float32),
            "worker_id": r.worker_id}


def _trajectory(r: pb.ScoreTrajectoryResponse) -> dict:
    hidden = np.asarray(r.hidden, dtype=np.float32).reshape(len(r.labels), r.d_model)
    return {"labels": list(r.labels), "hidden": hidden, "worker_id": r.worker_id}


def _info(r: pb.ModelInfoResponse) -> dict:
    from google.protobuf.json_format import MessageToDict
    return MessageToDict(r, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


class _Stream:
    """What the sync and asyncio streams share: one response becomes a `Chunk` or the `Complete`."""

    def __init__(self, call):
        self._call = call
        self.complete: Complete | None = None
        self.request_id: str | None = None

    def _event(self, resp) -> Chunk | None:
        self.request_id = resp.request_id
        if resp.WhichOneof("event") == "chunk":
            return Chunk(list(resp.chunk.ids), resp.chunk.text)
        self.complete = _complete(resp)
        return None

    def cancel(self) -> None:
        self._call.cancel()


class GenerateStream(_Stream):
    """Iterates over `Chunk`s; afterwards `.complete` holds the `Complete`. `cancel()` stops it
    (the worker frees its lane within one decode step)."""

    def __iter__(self):
        try:
            for resp in self._call:
                if (chunk := self._event(resp)) is not None:
                    yield chunk
        except grpc.RpcError as e:
            raise TinyLoopError.from_rpc_error(e) from None

    def collect(self) -> tuple[list[int], Complete]:
        ids = [t for chunk in self for t in chunk.ids]
        return ids, self.complete


def tls_credentials(root_certificates: bytes | None = None, private_key: bytes | None = None,
                    certificate_chain: bytes | None = None) -> grpc.ChannelCredentials | None:
    """TLS channel credentials (PEM bytes): the CA that signed the gateway's certificate (None:
    the system's roots), and for mutual TLS this client's key and certificate. None when no
    argument is given: a plaintext channel."""
    if root_certificates is None and private_key is None and certificate_chain is None:
        return None
    if (private_key is None) != (certificate_chain is None):
        raise ValueError("mutual TLS needs both private_key and certificate_chain")
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


class TinyLoopClient:
    """Blocking client. `caller` is the identity that owns the handles you build; `token` a
    bearer token when the gateway enforces auth. `root_certificates` (PEM bytes) connects over
    TLS; with `private_key` and `certificate_chain` too, mutual TLS. `max_attempts`: a call
    answered UNAVAILABLE before any response is tried up to this many times (`channel_options`;
    1: never again); a `channel` of your own keeps its own options."""

    def __init__(self, address: str = "127.0.0.1:50051", caller: str | None = None, token: str | None = None,
                 channel: grpc.Channel | None = None, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None,
                 max_attempts: int = MAX_ATTEMPTS):
        creds = tls_credentials(root_certificates, private_key, certificate_chain)
        options = channel_options(max_attempts)
        if channel is None:
            channel = (grpc.insecure_channel(address, options=options) if creds is None
                       else grpc.secure_channel(address, creds, options=options))
        self.channel = channel
        self.stub = pb_grpc.TinyLoopStub(self.channel)
        self.metadata = _metadata(caller, token)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _unary(self, method, request, timeout):
        try:
            return method(request, metadata=self.metadata, timeout=timeout)
        except grpc.RpcError as e:
            raise TinyLoopError.from_rpc_error(e) from None

    def generate(self, prompt, *, timeout: float | None = None, **kwargs) -> GenerateStream:
        return GenerateStream(self.stub.Generate(generate_request(prompt, **kwargs), metadata=self.metadata,
                                                 timeout=timeout))

    def resume(self, handle_id: str, new_loops: int, *, timeout: float | None = None, **kwargs) -> GenerateStream:
        return GenerateStream(self.stub.Resume(resume_request(handle_id, new_loops, **kwargs),
                                               metadata=self.metadata, timeout=timeout))

    def build_resume_handle(self, prompt, l_used=None, max_loops=None, cache_window=0, *, seed=None,
                            timeout: float | None = None) -> Handle:
        return _handle(self._unary(self.stub.BuildResumeHandle,
                                   build_request(prompt, l_used, max_loops, cache_window, seed), timeout))

    def free_handle(self, handle_id: str, *, timeout: float | None = None) -> bool:
        return self._unary(self.stub.FreeHandle, pb.FreeHandleRequest(handle_id=handle_id), timeout).freed

    def score_consistency(self, prompt, loops_a: int, loops_b: int, max_tokens: int | None = None, *,
                          timeout: float | None = None) -> dict:
        c = pb.ConsistencyScore(loops_a=loops_a, loops_b=loops_b)
        if max_tokens is not None:
            c.max_tokens = max_tokens
        return _score(self._unary(self.stub.Score, pb.ScoreRequest(prompt=_prompt(prompt), consistency=c), timeout))

    def score_uncertainty(self, prompt, l_lo: int, l_hi: int, return_logits: bool = True, *,
                          timeout: float | None = None) -> dict:
        u = pb.UncertaintyScore(l_lo=l_lo, l_hi=l_hi, return_logits=return_logits)
        return _score(self._unary(self.stub.Score, pb.ScoreRequest(prompt=_prompt(prompt), uncertainty=u), timeout))

    def score_trajectory(self, prompt, n_loops: int, *, timeout: float | None = None) -> dict:
        return _trajectory(self._unary(self.stub.ScoreTrajectory,
                                       pb.ScoreTrajectoryRequest(prompt=_prompt(prompt), n_loops=n_loops), timeout))

    def model_info(self, *, timeout: float | None = None) -> dict:
        return _info(self._unary(self.stub.ModelInfo, pb.ModelInfoRequest(), timeout))


class AsyncGenerateStream(_Stream):
    """The asyncio `GenerateStream`: `async for chunk in stream`."""

    async def __aiter__(self):
        try:
            async for resp in self._call:
                if (chunk := self._event(resp)) is not None:
                    yield chunk
        except grpc.RpcError as e:
            raise TinyLoopError.from_rpc_error(e) from None

    async def collect(self) -> tuple[list[int], Complete]:
        ids = [t async for chunk in self for t in chunk.ids]
        return ids, self.complete


class AsyncTinyLoopClient:
    """The asyncio client: same methods as `TinyLoopClient`, awaitable; streams are async
    iterables."""

    def __init__(self, address: str = "127.0.0.1:50051", caller: str | None = None, token: str | None = None,
                 root_certificates: bytes | None = None, private_key: bytes | None = None,
                 certificate_chain: bytes | None = None, max_attempts: int = MAX_ATTEMPTS):
        creds = tls_credentials(root_certificates, private_key, certificate_chain)
        options = channel_options(max_attempts)
        self.channel = (grpc.aio.insecure_channel(address, options=options) if creds is None
                        else grpc.aio.secure_channel(address, creds, options=options))
        self.stub = pb_grpc.TinyLoopStub(self.channel)
        self.metadata = _metadata(caller, token)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _unary(self, method, request, timeout):
        try:
            return await method(request, metadata=self.metadata, timeout=timeout)
        except grpc.RpcError as e:
            raise TinyLoopError.from_rpc_error(e) from None

    def generate(self, prompt, *, timeout: float | None = None, **kwargs) -> AsyncGenerateStream:
        return AsyncGenerateStream(self.stub.Generate(generate_request(prompt, **kwargs), metadata=self.metadata,
                                                      timeout=timeout))

    def resume(self, handle_id: str, new_loops: int, *, timeout: float | None = None,
               **kwargs) -> AsyncGenerateStream:
        return AsyncGenerateStream(self.stub.Resume(resume_request(handle_id, new_loops, **kwargs),
                                                    metadata=self.metadata, timeout=timeout))

    async def build_resume_handle(self, prompt, l_used=None, max_loops=None, cache_window=0, *, seed=None,
                                  timeout: float | None = None) -> Handle:
        return _handle(await self._unary(self.stub.BuildResumeHandle,
                                         build_request(prompt, l_used, max_loops, cache_window, seed), timeout))

    async def free_handle(self, handle_id: str, *, timeout: float | None = None) -> bool:
        return (await self._unary(self.stub.FreeHandle, pb.FreeHandleRequest(handle_id=handle_id), timeout)).freed

    async def score_consistency(self, prompt, loops_a: int, loops_b: int, max_tokens: int | None = None, *,
                                timeout: float | None = None) -> dict:
        c = pb.ConsistencyScore(loops_a=loops_a, loops_b=loops_b)
        if max_tokens is not None:
            c.max_tokens = max_tokens
        return _score(await self._unary(self.stub.Score, pb.ScoreRequest(prompt=_prompt(prompt), consistency=c),
                                        timeout))

    async def score_uncertainty(self, prompt, l_lo: int, l_hi: int, return_logits: bool = True, *,
                                timeout: float | None = None) -> dict:
        u = pb.UncertaintyScore(l_lo=l_lo, l_hi=l_hi, return_logits=return_logits)
        return _score(await self._unary(self.stub.Score, pb.ScoreRequest(prompt=_prompt(prompt), uncertainty=u),
                                        timeout))

    async def score_trajectory(self, prompt, n_loops: int, *, timeout: float | None = None) -> dict:
        return _trajectory(await self._unary(self.stub.ScoreTrajectory,
                                             pb.ScoreTrajectoryRequest(prompt=_prompt(prompt), n_loops=n_loops),
                                             timeout))

    async def model_info(self, *, timeout: float | None = None) -> dict:
        return _info(await self._unary(self.stub.ModelInfo, pb.ModelInfoRequest(), timeout))


def _metadata(caller: str | None, token: str | None) -> tuple:
    md = []
    if caller:
        md.append((CALLER_KEY, caller))
    if token:
        md.append(("authorization", f"Bearer {token}"))
    return tuple(md)
