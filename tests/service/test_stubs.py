"""The contract's plumbing: stubs are fresh, handle ids round-trip, the gateway has no torch."""
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "proto"))


def _normalise(text: str) -> str:
    # Version banners depend on the grpcio-tools that ran, not on the contract.
    text = re.sub(r"^# Protobuf Python Version: .*$", "", text, flags=re.M)
    text = re.sub(r"^GRPC_GENERATED_VERSION = .*$", "", text, flags=re.M)
    return re.sub(r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)", "", text, flags=re.S)


def test_committed_stubs_are_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    import generate
    pairs = generate.generate(tmp_path)
    assert {c.name for _, c in pairs} >= {"tinyloop_pb2.py", "tinyloop_pb2_grpc.py", "channel_pb2.py"}
    for fresh, committed in pairs:
        assert committed.exists(), f"{committed} is missing: run `make proto`"
        assert _normalise(committed.read_text()) == _normalise(fresh.read_text()), (
            f"{committed.name} is stale against its .proto under proto/: run `make proto`")


def test_stub_imports_by_package_path():
    from tinyloop.client import tinyloop_pb2, tinyloop_pb2_grpc
    assert tinyloop_pb2_grpc.tinyloop__pb2 is tinyloop_pb2
    svc = tinyloop_pb2.DESCRIPTOR.services_by_name["TinyLoop"]
    assert {m.name for m in svc.methods} == {"Generate", "BuildResumeHandle", "Resume", "FreeHandle", "Score",
                                             "ScoreTrajectory", "ModelInfo"}
    from tinyloop.worker.serving import channel_pb2
    assert channel_pb2.LinkFrame.__module__ == "tinyloop.worker.serving.channel_pb2"  # pickles by reference
    assert not channel_pb2.DESCRIPTOR.services_by_name  # the channel is frames on a TCP stream, not a gRPC service
    assert set(channel_pb2.LinkFrame.DESCRIPTOR.oneofs_by_name["body"].fields) == {
        channel_pb2.LinkFrame.DESCRIPTOR.fields_by_name[n] for n in ("hello", "start", "cancel", "event")}


def test_sampling_fields_with_nonzero_defaults_are_optional():
    from tinyloop.client import tinyloop_pb2 as pb
    s = pb.SamplingParams()
    for name in ("temperature", "top_k", "top_p", "repetition_penalty", "seed"):
        assert not s.HasField(name)
    g = pb.GenerateRequest()
    assert not g.HasField("loops") and not g.HasField("max_tokens")


def test_handle_ids_round_trip_and_reject_garbage():
    from tinyloop.gateway import handles
    token = bytes(range(16))
    hid = handles.encode(3, 7, token)
    assert handles.decode(hid) == (3, 7, token)
    assert re.fullmatch(r"[A-Za-z0-9_-]+", hid)
    for bad in ("", "xyz", hid[:-1], hid + "A", "!" * len(hid), handles.encode(0, 0, token).replace("A", "B", 1)):
        with pytest.raises(ValueError):
            handles.decode(bad)


def test_gateway_never_imports_torch():
    code = ("import sys, tinyloop.gateway.server, tinyloop.gateway.cli, tinyloop.gateway.workers; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
            "assert not bad, bad[:5]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
