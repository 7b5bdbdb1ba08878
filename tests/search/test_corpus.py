"""Passages from local text: splitting, filtering, man-page markup, and a held-out split disjoint from the corpus."""

import gzip

from qjl.search.corpus import CorpusConfig, collect_passages, file_text, split_passages


def test_split_respects_word_bounds_and_drops_junk():
    text = ("alpha beta gamma delta " * 3 + "\n\n" + "x " * 50 + "\n\n" + "12 34 56 78 90 11 " * 4 + "\n\nend")
    out = split_passages(text, min_words=5, max_words=20)
    assert all(5 <= len(p.split()) <= 20 for p in out)
    assert not any("12 34" in p for p in out)  # mostly non-letters: dropped
    assert out[0].startswith("alpha beta")


def test_man_page_markup_is_stripped(tmp_path):
    d = tmp_path / "man" / "man1"
    d.mkdir(parents=True)
    page = d / "tool.1.gz"
    with gzip.open(page, "wt") as f:
        f.write('.\\" comment\n.TH TOOL 1\n.SH DESCRIPTION\n\\fBtool\\fR prints \\-v the version of things\n')
    text = file_text(page)
    assert "DESCRIPTION" in text and "tool prints" in text and "the version of things" in text and "\\f" not in text and "comment" not in text


def test_held_out_files_never_reach_the_corpus(tmp_path):
    for i in range(60):
        (tmp_path / f"f{i}.txt").write_text(f"file {i} says " + " ".join(f"word{i}x{j}" for j in range(30)) + "\n\nshared "
                                            "paragraph that appears in every file with enough words to count here")
    corpus, held = collect_passages([tmp_path], CorpusConfig(min_words=10, max_words=40, holdout_every=4), progress=False)
    assert corpus and held and not set(corpus) & set(held)
    assert len(corpus) + len(held) == len(set(corpus) | set(held))  # deduplicated
    assert sum("shared paragraph" in p for p in corpus + held) == 1
