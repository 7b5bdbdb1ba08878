"""``import qjl`` is lean: it imports no heavy dependency, builds no codec and writes no file."""

import json
import os
import subprocess
import sys


HEAVY = ("torch", "transformers", "numba", "triton", "vllm", "faiss")


def _run(code: str, tmp_path) -> dict:
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    cache.mkdir()
    env = {**os.environ, "HOME": str(home), "QJL_CACHE_DIR": str(cache), "XDG_CACHE_HOME": str(cache)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return {"stdout": json.loads(out.stdout.strip().splitlines()[-1]),
            "files": sorted(str(p) for p in (*home.rglob("*"), *cache.rglob("*")))}


def test_import_qjl_loads_nothing_heavy_and_writes_nothing(tmp_path):
    r = _run("import json, sys, qjl; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
             f"{HEAVY!r})))", tmp_path)
    assert r["stdout"] == [], f"import qjl pulled in {r['stdout']}"
    assert r["files"] == [], f"import qjl wrote {r['files']}"


def test_public_names_load_on_first_use(tmp_path):
    """The lazy names resolve to the real objects; the presets module builds no codec and writes no file."""
    r = _run("import json, sys, qjl; from qjl.cache import presets; "
             "assert qjl.QJLConfig is presets.QJLConfig and 'tq-k45v3' in qjl.PRESETS; "
             "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'numba', 'triton'))))",
             tmp_path)
    assert r["stdout"] == []
    assert r["files"] == [], f"importing the presets wrote {r['files']}"


def test_unknown_public_name_raises_attribute_error():
    import qjl

    try:
        qjl.not_a_name  # noqa: B018
    except AttributeError as e:
        assert "not_a_name" in str(e)
    else:
        raise AssertionError("qjl.not_a_name did not raise")
