"""gRPC statuses with a machine-readable `google.rpc.ErrorInfo` (grpcio-status)."""
from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "tinyloop.dev"


class ServiceError(Exception):
    """Raised inside the servicer; the handler wrapper aborts the RPC with it."""

    def __init__(self, code: grpc.StatusCode | str, reason: str, message: str):
        super().__init__(message)
        self.code = grpc.StatusCode[code] if isinstance(code, str) else code
        self.reason = reason
        self.message = message

    @classmethod
    def from_worker(cls, err: dict) -> "ServiceError":
        return cls(err["code"], err["reason"], err["message"])

    def to_status(self) -> grpc.Status:
        info = any_pb2.Any()
        info.Pack(error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN))
        return rpc_status.to_status(status_pb2.Status(code=self.code.value[0], message=self.message,
                                                      details=[info]))


def invalid(message: str, reason: str = "INVALID_ARGUMENT") -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, reason, message)
