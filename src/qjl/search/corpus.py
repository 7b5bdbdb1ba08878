"""Real passages from local text: Debian docs and changelogs, man pages, licenses, Python's sources.

:func:`collect_passages` walks a fixed list of roots in sorted order (so a machine with the
same files gives the same corpus), turns every file into plain text (gzip opened, roff
markup of man pages stripped), cuts the text into passages of ``min_words``..``max_words``
words at paragraph boundaries, drops near-empty or mostly non-text passages and exact
duplicates, and splits them by *file* into a corpus and a held-out pool: every passage of
a held-out file is kept out of the corpus, and a query equal to a corpus passage is
dropped, so no query is in the corpus.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CorpusConfig", "default_roots", "collect_passages", "file_text", "split_passages"]

_WORD = re.compile(r"\S+")
_ROFF_ESC = re.compile(r"\\f[BIRPC1-9]|\\f\(..|\\\(..|\\[*$]\(?..?|\\s[-+]?\d|\\[&|^e%-]|\\\"[^\n]*")
_ALPHA = re.compile(r"[A-Za-z]")


def default_roots() -> list:
    """The text this project's machines carry: Debian docs, English man pages, licenses, the stdlib."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    man = [Path("/usr/share/man") / f"man{i}" for i in range(1, 9)]
    return [Path("/usr/share/common-licenses"), Path("/usr/share/doc"), *man, stdlib]


@dataclass(frozen=True)
class CorpusConfig:
    """What to collect.

    Args:
        min_words, max_words: passage length in words (paragraphs are merged up to max_words).
        holdout_every: one file in ``holdout_every`` (by a hash of its path) goes to the query pool.
        max_file_bytes: longer files are cut (a few huge changelogs would otherwise dominate).
    """

    min_words: int = 10
    max_words: int = 32
    holdout_every: int = 40
    max_file_bytes: int = 400_000

    def __post_init__(self):
        if not 1 <= self.min_words <= self.max_words:
            raise ValueError(f"need 1 <= min_words <= max_words, got {self.min_words}, {self.max_words}")
        if self.holdout_every < 2:
            raise ValueError(f"holdout_every must be >= 2, got {self.holdout_every}")


def _is_text_file(path: Path) -> bool:
    name = path.name
    if name.endswith(".py"):
        return True
    if "/man/" in str(path):
        return name.endswith(".gz") or name[-1:].isdigit()
    if name.endswith((".html", ".htm", ".png", ".jpg", ".gif", ".svg", ".pdf", ".css", ".js", ".so", ".pyc")):
        return False
    return True


def _strip_roff(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if line.startswith((".\\\"", "'\\\"")):
            continue
        if line.startswith((".", "'")):  # a request: keep the words of .SH/.B/.I/.TP-like lines
            parts = line.split(None, 1)
            line = parts[1].replace('"', "") if len(parts) == 2 and parts[0][1:3] in ("SH", "SS", "B", "I", "BR", "IR", "RB", "BI", "IB", "RI") else ""
        lines.append(_ROFF_ESC.sub("", line).replace("\\-", "-").replace("\\ ", " "))
    return "\n".join(lines)


def file_text(path: Path, max_bytes: int = 400_000) -> str:
    """The plain text of ``path`` ('' when it is not UTF-8 text)."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                raw = f.read(max_bytes)
        else:
            with open(path, "rb") as f:
                raw = f.read(max_bytes)
    except (OSError, EOFError, gzip.BadGzipFile):
        return ""
    if b"\0" in raw[:4096]:
        return ""
    text = raw.decode("utf-8", errors="ignore")
    return _strip_roff(text) if "/man/" in str(path) else text


def split_passages(text: str, min_words: int, max_words: int) -> list:
    """Paragraphs (blank-line separated) merged up to ``max_words``; long ones cut; short tails dropped."""
    out, cur = [], []
    for para in re.split(r"\n\s*\n", text):
        words = _WORD.findall(para)
        while len(words) > max_words:
            if cur:
                out.append(cur)
                cur = []
            out.append(words[:max_words])
            words = words[max_words:]
        if len(cur) + len(words) > max_words:
            out.append(cur)
            cur = []
        cur = cur + words
        if len(cur) >= min_words:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return [" ".join(p) for p in out if len(p) >= min_words and _texty(p)]


def _texty(words: list) -> bool:
    """At least half the words carry a letter (drops hex dumps, tables of numbers, ascii art)."""
    return sum(1 for w in words if _ALPHA.search(w)) * 2 >= len(words)


def _files(roots: list) -> list:
    files = []
    for root in roots:
        root = Path(root)
        if root.is_file():
            files.append(root)
        elif root.is_dir():
            files.extend(p for p in sorted(root.rglob("*"))
                         if p.is_file() and not p.is_symlink() and "site-packages" not in p.parts
                         and _is_text_file(p))
    return files


def _held_out(path: Path, every: int) -> bool:
    return int(hashlib.sha1(str(path).encode()).hexdigest()[:8], 16) % every == 0


def collect_passages(roots=None, config: CorpusConfig = CorpusConfig(), progress: bool = True):
    """-> (corpus passages, held-out passages): two lists of str, deduplicated, disjoint."""
    from tqdm.auto import tqdm

    files = _files(default_roots() if roots is None else roots)
    seen, corpus, held = set(), [], []
    for path in tqdm(files, desc="reading text", unit="file", disable=not progress, mininterval=1.0):
        target = held if _held_out(path, config.holdout_every) else corpus
        for p in split_passages(file_text(path, config.max_file_bytes), config.min_words, config.max_words):
            key = hashlib.blake2b(p.encode(), digest_size=12).digest()
            if key not in seen:
                seen.add(key)
                target.append(p)
    return corpus, held
