"""The `qjl` command line: help that names the choices and defaults, bad names refused before any model loads,
and `qjl generate` on a tiny model (the memory line, the note for prompts too short to compress)."""

import pytest

from qjl.tools import cli


@pytest.fixture
def no_model(monkeypatch):
    import qjl.tools.models as models

    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_model", refuse)


def _help(capsys, *argv):
    with pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_help_lists_names_and_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # no wrapping: argparse breaks lines at hyphens
    from qjl.cache.presets import DEFAULT_PRESET, PRESETS

    text = _help(capsys, "eval")
    assert all(name in text for name in ("tq-k3v2", "qjl-paper", "kivi-k2v2", "hf-quanto-k4v4"))
    assert "held-out" in text and "bash-manual" in text and "(default: 1536)" in text and "(default: 2)" in text
    text = _help(capsys, "generate")
    assert all(name in text for name in PRESETS)
    assert f"default: {DEFAULT_PRESET}" in text and "--max-new-tokens" in text and "(default: 96)" in text
    assert "(default: 1024,4096,16384,65536)" in _help(capsys, "bench")
    text = _help(capsys, "stats")
    assert "paper 001" not in text and "seed 003" not in text and "QJL paper" in text


@pytest.mark.parametrize("argv, message", [
    (["eval", "--methods", "tq-k9"], "unknown 'tq-k9'"),
    (["eval", "--texts", "nope"], "'nope' is neither"),
    (["eval", "--model", "/nonexistent"], "model must be"),
    (["eval", "--passkey-lengths", "10"], "passkey_lengths"),
    (["generate", "--preset", "tq-k9"], "preset must be one of"),
    (["generate", "--prompt", "a", "--prompt-file", "b"], "not both"),
])
def test_bad_names_fail_before_the_model_loads(no_model, capsys, argv, message):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.fixture
def tiny(monkeypatch):
    import qjl.tools.models as models
    from byte_lm import byte_llama, byte_tokenizer

    model, tok = byte_llama(), byte_tokenizer()
    model.config.head_dim = 64
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (model, tok))
    monkeypatch.setattr(models, "check_model_name", lambda name: None)


def test_generate_prints_the_memory_and_says_why_a_short_prompt_is_exact(tiny, capsys):
    assert cli.main(["generate", "--prompt", "hi", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "cache holds" in out and "nothing is compressed yet" in out
    assert cli.main(["generate", "--max-new-tokens", "3"]) == 0  # the default prompt: ~6k bytes here
    out = capsys.readouterr().out
    assert "nothing is compressed yet" not in out
    key_codes = float(out.split("key codes ")[1].split(" MiB")[0])
    assert key_codes > 0


def test_stats_and_bits_print_their_tables(tmp_path, capsys):
    assert cli.main(["stats", "--dim", "32", "--seeds", "100", "--vectors", "1000", "--kinds", "gaussian",
                     "--quiet", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "var/theory" in out and "PolarQuant levels" in out and "paper" in out and "seed003" not in out
    assert (tmp_path / "stats.json").exists() and (tmp_path / "codecs.png").exists()
    assert cli.main(["bits", "--dim", "64"]) == 0
    assert "vs fp16" in capsys.readouterr().out
