"""Building the C kernels: a missing or uncompilable source falls back (None + one warning), never raises."""

import warnings

import pytest

from qjl.kernels.cpu import build


def test_missing_source_returns_none_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("QJL_CACHE_DIR", str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build.load_extension("_qjl_missing", [tmp_path / "nope.c"]) is None
        assert build.load_extension("_qjl_missing", [tmp_path / "nope.c"]) is None  # cached: no second warning
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1


def test_uncompilable_source_returns_none_with_one_warning(tmp_path, monkeypatch):
    pytest.importorskip("cffi")
    bad = tmp_path / "bad.c"
    bad.write_text("QJL_EXPORT int qjl_bad(int x) { return x +; }\n#define QJL_EXPORT\n")
    monkeypatch.setenv("QJL_CACHE_DIR", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert build.load_extension("_qjl_bad", [bad], "int qjl_bad(int x);") is None


def test_decode_sources_ship_and_declare_the_struct():
    for src in build.SOURCES:
        assert src.exists(), src
    cdef = build.kernels_cdef()
    assert "qjl_decode_args" in cdef and "int qjl_paged_decode(const qjl_decode_args *a);" in cdef


def test_bad_extension_name_is_refused():
    with pytest.raises(ValueError, match="name"):
        build.load_extension("not a name", [])
