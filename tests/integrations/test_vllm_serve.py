"""The served path: ``python -m qjl.integrations.vllm.serve`` on localhost, concurrent completion and chat
requests through a real HTTP client, then the server is stopped (``pytest -m vllm``)."""

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_helpers import ENGINE_ENV

# two balanced halves for `-n 2` (.ci/run): engine + server (~190 s) and the two TP=2 tests (~190 s)
pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-engine-server")]
pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("QJL_VLLM_PRESET", "QJL_VLLM_CONFIG")}
    env.update(ENGINE_ENV)
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "qjl.integrations.vllm.serve", "--preset", "tq-k45v3", "--port",
                             str(port), "--max-model-len", "2048", "--", "--max-num-seqs", "8"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            if proc.poll() is not None:
                raise AssertionError("server exited:\n" + (tmp_path / "server.log").read_text()[-5000:])
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            raise AssertionError("server did not come up:\n" + (tmp_path / "server.log").read_text()[-5000:])
        yield base, tmp_path / "server.log"
    finally:
        _stop(proc)
        log.close()


def _stop(proc):
    """SIGTERM the server's process group (vLLM's engine processes included), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def test_server_answers_concurrent_completions_and_chats(server):
    base, log = server
    assert "smollm2" in httpx.get(base + "/v1/models", timeout=10).text

    def completion(prompt):
        r = httpx.post(base + "/v1/completions", timeout=300,
                       json={"model": "smollm2", "prompt": prompt, "max_tokens": 16, "temperature": 0})
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    def chat(question):
        r = httpx.post(base + "/v1/chat/completions", timeout=300,
                       json={"model": "smollm2", "messages": [{"role": "user", "content": question}],
                             "max_tokens": 16, "temperature": 0})
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(6) as pool:
        comps = [pool.submit(completion, p) for p in ("The capital of France is", "1, 2, 3, 4, 5,",
                                                       "def add(a, b):\n    return")]
        chats = [pool.submit(chat, q) for q in ("What is the capital of France? Answer in one word.",
                                                "What is 2 + 2? Answer with a number.",
                                                "Name a primary color.")]
        comps, chats = [f.result() for f in comps], [f.result() for f in chats]
    assert "paris" in comps[0].lower(), comps
    assert "6" in comps[1], comps
    assert "a + b" in comps[2], comps
    assert "paris" in chats[0].lower(), chats
    assert "4" in chats[1], chats
    assert "color" in chats[2].lower(), chats  # each answer belongs to its own concurrent request
    assert "qjl backend" in log.read_text()  # the compressed cache served these answers
