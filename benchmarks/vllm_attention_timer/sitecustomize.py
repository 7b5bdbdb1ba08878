"""Times every attention call of a vLLM engine process: ``benchmarks/vllm_bench.py --time-attention`` puts this
directory first on the workers' ``PYTHONPATH`` and names the output file in ``QJL_ATTENTION_TIMES``.

It wraps, as they are imported, the ``forward`` of vLLM's CPU attention (``CPUAttentionBackendImpl``, native) and of
qjl's backend (``QJLAttentionImpl``), and within the latter the functions its ``forward`` calls (key and value
smoothing, the code write, ``forward_batch``), and at exit writes ``{kind: [calls, seconds]}`` from the process that
ran the model: ``native.decode``, ``qjl.decode`` (steps whose queries are one token per sequence),
``native.prefill.q<Q>.s<S>`` (a step of Q query tokens at most per sequence and S tokens at most after it), and
``qjl.<function>.<decode or prefill>`` for the parts.  A diagnostic (wall time of each call, the wrappers' own
cost included); not a test.
"""

import atexit
import importlib.abc
import importlib.util
import json
import os
import sys
import time

_TIMES: dict = {}
_STEP = ["decode"]  # the kind of the call in progress ("decode" / "prefill"), for its parts' tags


def _add(tag: str, seconds: float) -> None:
    e = _TIMES.setdefault(tag, [0, 0.0])
    e[0] += 1
    e[1] += seconds


def _kind(metadata) -> str:
    q = getattr(metadata, "max_query_len", 1)
    if q <= 1:
        return "decode"
    return f"prefill.q{q}.s{int(metadata.seq_lens.max())}"


def _timed_forward(f, tag):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        kind = None if attn_metadata is None else _kind(attn_metadata)
        _STEP[0] = (kind or "decode").split(".")[0]
        t0 = time.perf_counter()
        out = f(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        if kind is not None:
            _add(f"{tag}.{kind}", time.perf_counter() - t0)
        return out
    return forward


def _timed(f, tag):
    def g(*args, **kwargs):
        t0 = time.perf_counter()
        out = f(*args, **kwargs)
        _add(f"{tag}.{_STEP[0]}", time.perf_counter() - t0)
        return out
    return g


def _patch_qjl(mod) -> None:
    mod.QJLAttentionImpl.forward = _timed_forward(mod.QJLAttentionImpl.forward, "qjl")
    for name in ("smooth_keys", "smooth_values", "write_codes", "forward_batch"):
        setattr(mod, name, _timed(getattr(mod, name), f"qjl.{name}"))


def _patch_native(mod) -> None:
    mod.CPUAttentionBackendImpl.forward = _timed_forward(mod.CPUAttentionBackendImpl.forward, "native")


_TARGETS = {"qjl.integrations.vllm.backend": _patch_qjl, "vllm.v1.attention.backends.cpu_attn": _patch_native}


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _TARGETS[name](module)

        spec.loader.exec_module = exec_module
        return spec


def _write() -> None:
    dest = os.environ.get("QJL_ATTENTION_TIMES")
    if dest and _TIMES:
        with open(dest, "w") as fh:
            json.dump(_TIMES, fh)


if os.environ.get("QJL_ATTENTION_TIMES"):
    sys.meta_path.insert(0, _Hook())
    atexit.register(_write)
