"""TLS and mutual TLS over real gRPC, with certificates the test makes (trustme): a client that
trusts the gateway's CA streams the tokens of the model run alone; a plaintext client, or one
that trusts another CA, gets no answer; under mutual TLS a client without a certificate signed
by the configured CA is refused at the handshake."""
from __future__ import annotations

import grpc
import pytest
import ray

from tinyloop.client import TinyLoopClient, TinyLoopError

from service_helpers import start_service

trustme = pytest.importorskip("trustme")
pytestmark = pytest.mark.slow
PROMPT = [5, 17, 99, 3, 42]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.private_key_pem.write_to_path(str(d / "server.key"))
    server.cert_chain_pems[0].write_to_path(str(d / "server.crt"))
    for pem in server.cert_chain_pems[1:]:
        pem.write_to_path(str(d / "server.crt"), append=True)
    ca.cert_pem.write_to_path(str(d / "ca.crt"))
    client = ca.issue_cert("alice@clients.tinyloop.test")
    stranger = other.issue_cert("mallory@elsewhere.test")
    return {"dir": d, "ca": ca.cert_pem.bytes(), "other_ca": other.cert_pem.bytes(),
            "client": (client.private_key_pem.bytes(), b"".join(p.bytes() for p in client.cert_chain_pems)),
            "stranger": (stranger.private_key_pem.bytes(), b"".join(p.bytes() for p in stranger.cert_chain_pems))}


@pytest.fixture(scope="module")
def tls_service(ray_cluster, model_path, pki):
    d = pki["dir"]
    actors, gw = start_service(model_path, "w-tls", n=1, lanes=2, tls_cert_file=str(d / "server.crt"),
                               tls_key_file=str(d / "server.key"))
    from tinyloop.gateway.server import GatewayOptions, GatewayThread
    mtls = GatewayThread(actors, GatewayOptions(port=0, tls_cert_file=str(d / "server.crt"),
                                                tls_key_file=str(d / "server.key"),
                                                tls_client_ca_file=str(d / "ca.crt")))
    yield gw, mtls
    mtls.stop(0.5)
    gw.stop(0.5)
    for a in actors:
        ray.kill(a, no_restart=True)


def _refused(client: TinyLoopClient) -> TinyLoopError:
    with pytest.raises(TinyLoopError) as e:
        client.generate(PROMPT, loops=3, max_tokens=4, timeout=5).collect()
    client.close()
    return e.value


def test_tls_round_trip(tls_service, pki, local_model):
    gw, _ = tls_service
    want = local_model.generate(PROMPT, loops=3, max_tokens=6)[len(PROMPT):]
    with TinyLoopClient(gw.address, caller="alice", root_certificates=pki["ca"]) as c:
        ids, comp = c.generate(PROMPT, loops=3, max_tokens=6, timeout=30).collect()
        assert ids == want and comp.finish_reason == "length"
    assert _refused(TinyLoopClient(gw.address)).code == grpc.StatusCode.UNAVAILABLE  # plaintext
    assert _refused(TinyLoopClient(gw.address, root_certificates=pki["other_ca"])).code == \
        grpc.StatusCode.UNAVAILABLE  # a CA that did not sign the gateway's certificate


def test_mutual_tls(tls_service, pki, local_model):
    _, gw = tls_service
    want = local_model.generate(PROMPT, loops=3, max_tokens=6)[len(PROMPT):]
    key, chain = pki["client"]
    with TinyLoopClient(gw.address, caller="alice", root_certificates=pki["ca"], private_key=key,
                        certificate_chain=chain) as c:
        assert c.generate(PROMPT, loops=3, max_tokens=6, timeout=30).collect()[0] == want
    assert _refused(TinyLoopClient(gw.address, root_certificates=pki["ca"])).code == grpc.StatusCode.UNAVAILABLE
    key, chain = pki["stranger"]
    assert _refused(TinyLoopClient(gw.address, root_certificates=pki["ca"], private_key=key,
                                   certificate_chain=chain)).code == grpc.StatusCode.UNAVAILABLE


def test_tls_options_are_checked():
    from tinyloop.client import client as client_mod
    from tinyloop.gateway.server import GatewayOptions, _listen
    with pytest.raises(ValueError, match="both private_key and certificate_chain"):
        client_mod.tls_credentials(b"ca", private_key=b"k")
    with pytest.raises(ValueError, match="both tls_cert_file and tls_key_file"):
        _listen(None, GatewayOptions(tls_cert_file="x.crt"))
    with pytest.raises(ValueError, match="mutual TLS is TLS"):
        _listen(None, GatewayOptions(tls_client_ca_file="ca.crt"))
