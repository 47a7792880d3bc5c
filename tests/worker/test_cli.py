"""The in-process CLI: init-model writes a loadable checkpoint; generate prints a stream."""
import pytest

from tinyloop.cli import main
from tinyloop.worker import Model


def test_init_model_then_generate(tmp_path, capsys):
    out = tmp_path / "m.tinyloop"
    assert main(["init-model", "--preset", "tiny", "--seed", "3", "-o", str(out)]) == 0
    assert "0.1M parameters" in capsys.readouterr().out
    with Model(out) as m:
        assert m.config.d_model == 64
    assert main(["generate", "--model", str(out), "--prompt", "hi", "--loops", "2", "--max-tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("hi") and "[finish: length, 5 tokens, L=2, kv_mode kv]" in captured.err


def test_generate_takes_the_cache_mode(tmp_path, capsys):
    # store-h rebuilds K and V from h: the same greedy text as the K/V cache (fp32)
    out = tmp_path / "m.tinyloop"
    assert main(["init-model", "--preset", "tiny", "--seed", "3", "-o", str(out)]) == 0
    texts = {}
    for mode in ("kv", "h"):
        capsys.readouterr()
        assert main(["generate", "--model", str(out), "--prompt", "hi", "--max-tokens", "8", "--kv-mode", mode]) == 0
        captured = capsys.readouterr()
        assert f"kv_mode {mode}]" in captured.err
        texts[mode] = captured.out
    assert texts["h"] == texts["kv"]
    with pytest.raises(SystemExit):  # argparse: not one of the modes
        main(["generate", "--model", str(out), "--prompt", "hi", "--kv-mode", "int3"])


def test_cli_reports_bad_arguments(tmp_path, capsys):
    out = tmp_path / "m.tinyloop"
    main(["init-model", "--preset", "tiny", "-o", str(out)])
    assert main(["generate", "--model", str(out), "--prompt", "hi", "--loops", "99"]) == 2
    assert "loops=99 out of range" in capsys.readouterr().err
    assert main(["init-model", "--preset", "huge", "-o", str(out)]) == 2
