"""The evaluation corpus: every text is there, held out except the tuning text, read deterministically."""

import hashlib

import pytest

from qjl.tools import texts


def test_every_corpus_text_reads_and_is_long_enough_for_8k():
    kinds = set()
    for name in texts.CORPUS:
        text, meta = texts.load_text(name)
        kinds.add(meta["kind"])
        assert meta["sha256"] == hashlib.sha256(text.encode()).hexdigest()
        assert meta["role"] == ("tuning" if name == texts.TUNING_TEXT else "held-out")
        # 8,192 tokens at the embedded tokenizer's densest (about 4.6 chars per token on prose);
        # the tuning text (GPL-3, 7,658 tokens) serves the 1.5k context only
        if name != texts.TUNING_TEXT:
            assert len(text) > 8192 * 4.5, name
    assert {"license", "manual", "changelog", "source", "prose"} <= kinds
    assert texts.load_text("bash-manual")[1]["sha256"] == texts.load_text("bash-manual")[1]["sha256"]


def test_held_out_never_contains_the_tuning_text():
    assert texts.TUNING_TEXT not in texts.held_out() and len(texts.held_out()) >= 5
    assert texts.resolve_texts(["held-out"]) == texts.held_out()
    assert texts.resolve_texts(["all"])[0] == texts.TUNING_TEXT
    assert texts.resolve_texts(["gpl-3", "all"]) == list(texts.CORPUS)  # no repeats, order kept


def test_files_and_bad_names(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello")
    assert texts.resolve_texts([str(f)]) == [str(f)]
    assert texts.load_text(str(f))[1]["role"] == "user"
    with pytest.raises(ValueError, match="texts: 'nope'.*gpl-3"):
        texts.resolve_texts(["nope"])
    with pytest.raises(TypeError, match="texts"):
        texts.resolve_texts("gpl-3")
    for wrong in ("no such file", "a text passed in place of its name\n" * 200, str(tmp_path)):
        with pytest.raises(FileNotFoundError, match="corpus name"):
            texts.load_text(wrong)
    with pytest.raises(TypeError, match="name_or_path"):
        texts.load_text(3)


def test_strip_troff():
    src = "\n".join([
        '.\\" a comment', ".de XX", "macro body", "..", ".TH T 1", ".SH NAME", "prog \\- does things",
        ".SH DESCRIPTION", ".B prog", "reads \\fIfiles\\fP and", ".BR ls (1)", "output.", ".PP",
        ".if n nroff text", ".if t troff text", ".ie \\n(zZ=1 register text", ".el else text",
        ".ie t a", ".el \\{ block", "lines", "\\}", ".TP", ".B \\-x", "an option",
        ".nf", "kept", "as is", ".fi", "Copyright \\(co 2024 \\(em done\\&."])
    out = texts.strip_troff(src)
    assert "comment" not in out and "macro body" not in out and "troff text" not in out
    assert "register text" not in out and " a " not in out
    assert "NAME\nprog - does things" in out
    assert "prog reads files and ls(1) output." in out
    assert "nroff text else text block lines" in out
    assert "-x\nan option" in out
    assert "kept\nas is\n" in out
    assert out.rstrip().endswith("Copyright (C) 2024 -- done.")
