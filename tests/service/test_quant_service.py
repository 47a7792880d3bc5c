"""The service serves a quantized checkpoint unchanged: the same tokens as the in-process
Model on the same file, and ModelInfo names the weight format."""
import pytest
from service_helpers import MAX_SEQ_LEN, running_service

PROMPT = [5, 17, 3, 99, 42]


@pytest.fixture(scope="module")
def qpath(tmp_path_factory, model_path):
    from tinyloop.cli import main
    path = tmp_path_factory.mktemp("qsvc") / "q.tinyloop"
    assert main(["quantize", model_path, str(path), "--group-size", "32"]) == 0
    return str(path)


def test_quantized_model_through_the_service(ray_cluster, qpath):
    from tinyloop.client import TinyLoopClient
    from tinyloop.worker.api import Model
    with Model(qpath, max_seq_len=MAX_SEQ_LEN) as local, running_service(qpath, "w-quant", n=1) as (_, gw), \
            TinyLoopClient(gw.address, caller="alice") as c:
        info = c.model_info()
        assert info["weight_format"] == local.weight_format == "int4-g32-rtn"
        ids, _ = c.generate(PROMPT, loops=3, max_tokens=10).collect()
        assert ids == local.generate(PROMPT, loops=3, max_tokens=10)[len(PROMPT):]
