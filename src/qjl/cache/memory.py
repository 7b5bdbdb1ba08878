"""The memory report of a compressed cache: bytes really held, by part, against the alternatives.

Bytes are the storage behind the tensors held (each storage counted once, buffer capacity included), so
the report cannot miss a tensor that keeps a larger one alive.  Two references:

* ``baseline_bytes``: the cache the model would otherwise use -- transformers' own ``DynamicCache``
  layers at the model's dtype for the same tokens (the headline ratio, ``compression_vs_baseline``);
* ``fp16_bytes``: the same tokens at 16 bits (``compression_vs_fp16``), a dtype-independent figure.

:class:`MemoryReport` is a read-only mapping (``report["bytes"]``) with a readable ``str()``.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["MemoryReport", "LayerMemory"]


class LayerMemory(dict):
    """One layer: kind ("compressed"/"exact"), codecs, tokens, bytes by part, baseline bytes."""


def _mib(b: float) -> str:
    return f"{b / 2**20:9.2f} MiB"


class MemoryReport(Mapping):
    """Totals (keys below) and ``layers``: a list of :class:`LayerMemory`.

    Keys: ``bytes``, ``key_code_bytes``, ``value_code_bytes``, ``exact_bytes`` (sinks + window),
    ``smoothing_bytes`` (key and value means), ``other_bytes`` (per-sequence fits, padding offsets),
    ``uncompressed_layer_bytes`` (layers kept exact, e.g. sliding-window layers), ``baseline_bytes``,
    ``fp16_bytes``, ``compression_vs_baseline``, ``compression_vs_fp16``, ``key_bits`` / ``value_bits``
    (per coordinate of the compressed tokens), ``compressed_bits`` (bits per value of the compressed part with
    everything it holds: codes, key and value means, per-sequence fits), ``exact_bits``, ``bits_per_value`` (everything held per stored
    coordinate of keys and values), ``tokens``, ``widths`` (per compressed layer: key and value codecs),
    ``allocation`` (widths chosen from the prompt: where its proxy took each layer's error, "errors in the residual
    stream" or "errors at the attention output" (:class:`qjl.cache.allocation.AutoBits` ``residual_weights``);
    else None).
    """

    def __init__(self, layers: list, allocation: str | None = None):
        self.layers = layers
        tot = lambda k: sum(layer.get(k, 0) for layer in layers)  # noqa: E731
        parts = {p: tot(p) for p in ("key_codes", "value_codes", "exact", "smoothing", "fit", "uncompressed")}
        total = sum(parts.values())
        compressed, exact_c, coords = tot("compressed_coords"), tot("exact_coords"), tot("coords")
        per = lambda nbytes, n: 8 * nbytes / n if n else 0.0  # noqa: E731
        baseline, fp16 = tot("baseline"), 2 * 2 * coords
        self._d = {
            "bytes": total, "key_code_bytes": parts["key_codes"], "value_code_bytes": parts["value_codes"],
            "exact_bytes": parts["exact"], "smoothing_bytes": parts["smoothing"], "other_bytes": parts["fit"],
            "uncompressed_layer_bytes": parts["uncompressed"], "baseline_bytes": baseline, "fp16_bytes": fp16,
            "compression_vs_baseline": baseline / total if total else 0.0,
            "compression_vs_fp16": fp16 / total if total else 0.0,
            "key_bits": per(parts["key_codes"], compressed), "value_bits": per(parts["value_codes"], compressed),
            "compressed_bits": per(parts["key_codes"] + parts["value_codes"] + parts["smoothing"] + parts["fit"],
                                   2 * compressed),
            "exact_bits": per(parts["exact"], 2 * exact_c), "bits_per_value": per(total, 2 * coords),
            "tokens": max((layer.get("tokens", 0) for layer in layers), default=0),
            "widths": {layer["layer"]: (layer["key"], layer["value"]) for layer in layers if "key" in layer},
            "allocation": allocation,
        }

    def __getitem__(self, key):
        return self._d[key]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)

    def __repr__(self):
        return f"MemoryReport({self._d!r})"

    def __str__(self):
        d = self._d
        rows = [("key codes", d["key_code_bytes"], f"{d['key_bits']:.2f} bits/coord"),
                ("value codes", d["value_code_bytes"], f"{d['value_bits']:.2f} bits/coord"),
                ("exact sinks/heavy/window", d["exact_bytes"], f"{d['exact_bits']:.2f} bits/coord"),
                ("smoothing means", d["smoothing_bytes"], ""),
                ("other (fits, padding)", d["other_bytes"], ""),
                ("layers kept exact", d["uncompressed_layer_bytes"], "")]
        lines = [f"QJLCache memory, {d['tokens']} tokens:"]
        lines += [f"  {name:<24}{_mib(b)}  {note}" for name, b, note in rows if b or name.endswith("codes")]
        lines.append(f"  {'total held':<24}{_mib(d['bytes'])}  {d['bits_per_value']:.2f} bits per stored value")
        own = "the model's own cache"
        lines.append(f"  {own:<24}{_mib(d['baseline_bytes'])}  "
                     f"{d['compression_vs_baseline']:.2f}x smaller held")
        lines.append(f"  {'same tokens at fp16':<24}{_mib(d['fp16_bytes'])}  {d['compression_vs_fp16']:.2f}x smaller held")
        widths = {}
        for layer, kv in d["widths"].items():
            widths.setdefault(kv, []).append(layer)
        for (k, v), layers in widths.items():
            lines.append(f"  layers {_ranges(layers)}: keys {k}, values {v}")
        if d["allocation"]:
            lines.append(f"  widths chosen from the prompt, {d['allocation']}")
        return "\n".join(lines)


def _ranges(idx: list) -> str:
    out, start = [], None
    for i, x in enumerate(idx):
        if start is None:
            start = x
        if i + 1 == len(idx) or idx[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)
