"""The in-process CLI: init-model writes a loadable checkpoint; generate prints a stream."""
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
    assert captured.out.startswith("hi") and "[finish: length, 5 tokens, L=2]" in captured.err


def test_cli_reports_bad_arguments(tmp_path, capsys):
    out = tmp_path / "m.tinyloop"
    main(["init-model", "--preset", "tiny", "-o", str(out)])
    assert main(["generate", "--model", str(out), "--prompt", "hi", "--loops", "99"]) == 2
    assert "loops=99 out of range" in capsys.readouterr().err
    assert main(["init-model", "--preset", "huge", "-o", str(out)]) == 2
