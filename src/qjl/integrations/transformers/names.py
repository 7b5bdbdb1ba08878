"""The name under which transformers takes a cache: ``past_key_values`` up to 5.23, ``cache`` from 5.24.

transformers 5.24 renamed the argument of every model's ``forward`` and of ``generate`` (and the field of their
outputs) from ``past_key_values`` to ``cache``; the old name still works there but warns (a ``FutureWarning`` from
``generate``, a logged warning from ``forward``) and goes in 6.0.  Code that must run on either side passes
``**cache_kwargs(cache)``::

    out = model.generate(ids, **qjl.cache_kwargs(cache), max_new_tokens=32)

Read from the installed distribution's version, without importing transformers.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re

RENAMED_IN = (5, 24)


def parse_version(version: str) -> tuple[int, int]:
    """``"5.24.0"`` / ``"5.24.0.dev0"`` / ``"6.0.0rc1"`` -> (major, minor).  Raises ValueError on anything else."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(version))
    if m is None:
        raise ValueError(f"version: expected 'major.minor[...]', got {version!r}")
    return int(m.group(1)), int(m.group(2))


def arg_name(version: str) -> str:
    """The keyword a model's ``forward`` and ``generate`` take the cache under, in transformers ``version``."""
    return "cache" if parse_version(version) >= RENAMED_IN else "past_key_values"


@functools.cache
def cache_arg() -> str:
    """:func:`arg_name` of the installed transformers ("past_key_values" where its version cannot be read)."""
    try:
        return arg_name(importlib.metadata.version("transformers"))
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return "past_key_values"


def cache_kwargs(cache) -> dict:
    """``{name: cache}`` with the installed transformers' name for it: ``model(ids, **cache_kwargs(cache))``."""
    return {cache_arg(): cache}
