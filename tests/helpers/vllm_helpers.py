"""Helpers for the vLLM engine tests: tiny local models and scripts run in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def run_script(code: str, tmp_path: Path, env: dict | None = None, timeout: int = 900) -> dict:
    """Run ``code`` (which must write its result as JSON to the path in argv[1]) in a new process."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    script, out, log = tmp_path / "script.py", tmp_path / "out.json", tmp_path / "log.txt"
    script.write_text(textwrap.dedent(code))
    full = {k: v for k, v in os.environ.items() if k not in ("QJL_VLLM_PRESET", "QJL_VLLM_CONFIG")}
    full.update(ENGINE_ENV)
    full.update(env or {})
    with open(log, "w") as fh:
        rc = subprocess.run([sys.executable, str(script), str(out)], env=full, stdout=fh, stderr=subprocess.STDOUT,
                            timeout=timeout).returncode
    text = log.read_text()
    if rc:
        raise AssertionError(f"script failed (rc {rc}):\n{text[-6000:]}")
    result = json.loads(out.read_text())
    result["_log"] = text
    return result


def tiny_llama_dir(path: Path, heads: int = 4, kv_heads: int = 2, layers: int = 4, layer_types=None,
                   sliding_window: int | None = None) -> str:
    """A tiny random Llama (even head counts, so TP=2 splits it), saved with the embedded model's tokenizer;
    ``layer_types`` ("sliding_attention" / "full_attention" per layer) and ``sliding_window``: a hybrid model as
    vLLM's Llama reads one (Gemma-3-style interleaving)."""
    import torch
    import transformers as tf

    from qjl.integrations.vllm.convert import vllm_model_dir

    tok = tf.AutoTokenizer.from_pretrained(vllm_model_dir())
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64,
                         max_position_embeddings=2048, initializer_range=0.05, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if layer_types is not None:
        cfg.layer_types, cfg.sliding_window = list(layer_types), sliding_window
    model = tf.LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
