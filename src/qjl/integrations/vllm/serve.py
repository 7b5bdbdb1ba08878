"""``python -m qjl.integrations.vllm.serve``: vLLM's OpenAI-compatible server with the qjl backend.

    python -m qjl.integrations.vllm.serve --preset tq-k45v3 --port 8000
    python -m qjl.integrations.vllm.serve --model /path/to/hf-model -- --max-num-seqs 32

Converts the embedded model for vLLM once (:mod:`.convert`), sets ``QJL_VLLM_PRESET`` and the
CPU settings this machine kind needs (2 OMP threads bound to cores 0-1, no reserved core, a
``VLLM_CPU_KVCACHE_SPACE`` in GiB; each only if not already set), and replaces itself with
vLLM's OpenAI server (``vllm serve``'s module) bound to 127.0.0.1 with ``--enforce-eager``.  Arguments after ``--`` go to vLLM.
"""

from __future__ import annotations

import argparse
import os
import sys

from .settings import ENV_PRESET, VLLMSettings

__all__ = ["serve_command", "main"]

CPU_DEFAULTS = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def serve_command(model: str, preset: str, port: int, kv_space: int, max_model_len: int, extra: list) -> tuple:
    """(argv, environment) of the ``vllm serve`` process."""
    from .convert import vllm_model_dir

    VLLMSettings(preset=preset)  # a bad preset fails here, naming it
    path = vllm_model_dir(model)
    env = dict(os.environ)
    env[ENV_PRESET] = preset
    for k, v in {**CPU_DEFAULTS, "VLLM_CPU_KVCACHE_SPACE": str(kv_space)}.items():
        env.setdefault(k, v)
    # vLLM's OpenAI server module, not the `vllm` script: the script asks importlib.metadata for a
    # distribution named "vllm", and the CPU build is installed as "vllm-cpu"
    head = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    name = "smollm2" if model == "smollm2" else os.path.basename(os.path.normpath(model))
    argv = head + ["--model", path, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
                   "--served-model-name", name, "--max-model-len", str(max_model_len)] + list(extra)
    return argv, env


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m qjl.integrations.vllm.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="'smollm2' (embedded), a .gguf file or a model directory")
    ap.add_argument("--preset", default=os.environ.get(ENV_PRESET) or "tq-k45v3")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--kv-space", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB) unless already set")
    ap.add_argument("--max-model-len", type=int, default=4096)
    a = ap.parse_args(argv)
    cmd, env = serve_command(a.model, a.preset, a.port, a.kv_space, a.max_model_len, extra)
    print("exec:", " ".join(cmd), flush=True)
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
