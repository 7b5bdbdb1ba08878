"""The evaluation corpus: real texts of different kinds that every Debian machine of this kind holds.

``qjl eval --texts NAME ...`` reads texts by name (or any UTF-8 file by path):

=============  ==========  ==========================================================================
name           kind        source
=============  ==========  ==========================================================================
gpl-3          license     ``/usr/share/common-licenses/GPL-3`` -- the TUNING text (presets were chosen on it)
licenses       license     ``/usr/share/common-licenses/{Apache-2.0,MPL-2.0,GFDL-1.3}``, concatenated
bash-manual    manual      ``/usr/share/man/man1/bash.1.gz``, troff stripped to plain text (:func:`strip_troff`)
dpkg-changelog changelog   ``/usr/share/doc/dpkg/changelog.gz`` (Debian changelog format)
python-source  source      ``argparse.py`` of the running Python's standard library
python-docs    prose       the Python reference topics ``help()`` shows (``pydoc_data.topics``), in key order
=============  ==========  ==========================================================================

Every text except ``gpl-3`` is HELD OUT: never used to choose a preset or tune a parameter.
``held-out`` names those five, ``all`` all six.  Each is long enough for an 8k-token evaluation
(7,680 prompt + 512 scored tokens) with the embedded model's tokenizer.  Texts are read and turned
into plain text deterministically (no external renderer), and :func:`load_text` returns the sha256
of the result so a run directory pins exactly what was read.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["Text", "CORPUS", "TUNING_TEXT", "held_out", "resolve_texts", "load_text", "strip_troff"]

_LICENSES = Path("/usr/share/common-licenses")


@dataclass(frozen=True)
class Text:
    """One named text of the corpus."""

    name: str
    kind: str
    source: str
    read: Callable[[], str]


def _read_file(path: Path) -> str:
    try:
        path = Path(path)
        found = path.is_file()
    except (OSError, ValueError):  # (a name too long for a path, a NUL: the text itself passed by mistake?)
        found = False
    if not found:
        shown = str(path) if len(str(path)) <= 80 else str(path)[:77] + "..."
        raise FileNotFoundError(f"text source {shown!r} is not a file on this machine (name_or_path takes a corpus "
                                f"name, {', '.join(CORPUS)}, or a file's path; not the text itself)")
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return raw.decode("utf-8", errors="replace")


def _licenses() -> str:
    return "\n\n".join(_read_file(_LICENSES / n).strip() for n in ("Apache-2.0", "MPL-2.0", "GFDL-1.3")) + "\n"


def _python_docs() -> str:
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # pragma: no cover - every CPython ships it
        raise FileNotFoundError("the Python standard library has no pydoc_data.topics") from e
    return "\n\n".join(topics[k].strip() for k in sorted(topics)) + "\n"


def _stdlib(name: str) -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / name


CORPUS = {t.name: t for t in [
    Text("gpl-3", "license", str(_LICENSES / "GPL-3"), lambda: _read_file(_LICENSES / "GPL-3")),
    Text("licenses", "license", "common-licenses Apache-2.0 + MPL-2.0 + GFDL-1.3", _licenses),
    Text("bash-manual", "manual", "/usr/share/man/man1/bash.1.gz (troff stripped)",
         lambda: strip_troff(_read_file(Path("/usr/share/man/man1/bash.1.gz")))),
    Text("dpkg-changelog", "changelog", "/usr/share/doc/dpkg/changelog.gz",
         lambda: _read_file(Path("/usr/share/doc/dpkg/changelog.gz"))),
    Text("python-source", "source", str(_stdlib("argparse.py")), lambda: _read_file(_stdlib("argparse.py"))),
    Text("python-docs", "prose", "pydoc_data.topics (Python reference topics)", _python_docs),
]}
TUNING_TEXT = "gpl-3"


def held_out() -> list:
    """Names of the held-out texts (every corpus text but the tuning text)."""
    return [n for n in CORPUS if n != TUNING_TEXT]


def resolve_texts(names) -> list:
    """Expand ``held-out`` / ``all``, keep corpus names and existing file paths; order kept, no repeats.

    Raises ValueError naming what is allowed for anything else (before any model loads).
    """
    if isinstance(names, str) or not names:
        raise TypeError(f"texts must be a non-empty list of names or paths, got {names!r}")
    out = []
    for n in names:
        expanded = held_out() if n == "held-out" else list(CORPUS) if n == "all" else [n]
        for e in expanded:
            if e not in CORPUS and not Path(e).is_file():
                raise ValueError(f"texts: {e!r} is neither a corpus text ({', '.join(CORPUS)}, held-out, all) "
                                 "nor an existing file")
            if e not in out:
                out.append(e)
    return out


def load_text(name_or_path: str) -> tuple:
    """-> (text, meta) where meta = {name, kind, source, role, chars, sha256}."""
    if not isinstance(name_or_path, (str, Path)):
        raise TypeError(f"name_or_path must be a corpus name or a file path (str), got {type(name_or_path).__name__}")
    if name_or_path in CORPUS:
        t = CORPUS[name_or_path]
        text, meta = t.read(), {"name": t.name, "kind": t.kind, "source": t.source,
                                "role": "tuning" if t.name == TUNING_TEXT else "held-out"}
    else:
        path = Path(name_or_path)
        text = _read_file(path)
        meta = {"name": str(path), "kind": "file", "source": str(path.resolve()), "role": "user"}
    meta.update(chars=len(text), sha256=hashlib.sha256(text.encode("utf-8")).hexdigest())
    return text, meta


# -- troff (man pages) to plain text ------------------------------------------------------------------
_NAMED = {"em": "--", "en": "-", "co": "(C)", "aq": "'", "lq": '"', "rq": '"', "dq": '"', "bu": "*",
          "oq": "'", "cq": "'", "ti": "~", "ha": "^", "rs": "\\", "mi": "-", "hy": "-", ">=": ">=", "<=": "<="}
_ESCAPE = re.compile(r"""\\(?:f(?:\(..|\[[^\]]*\]|.)|s[-+]?\d|[hvwlLxo]'[^']*'|\*(?:\(..|\[[^\]]*\]|.)|n(?:\(..|\[[^\]]*\]|.)|
                         \((..)|\[([^\]]*)\]|(.))""", re.X)
_SIMPLE = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "~": " ", "0": " ", "`": "`", "'": "'", ".": ".", '"': ""}
_FONT_ALTERNATING = {"BR", "BI", "IR", "IB", "RB", "RI"}
_INLINE = {"B", "I", "SM", "SB", "FN"}
_PARAGRAPH = {"PP", "LP", "P", "sp", "HP"}


def _unescape(s: str) -> str:
    def sub(m):
        if m.group(1) is not None or m.group(2) is not None:
            return _NAMED.get(m.group(1) or m.group(2), "")
        if m.group(3) is not None:
            return _SIMPLE.get(m.group(3), "")
        return ""  # fonts, sizes, motions, strings, registers
    return _ESCAPE.sub(sub, s)


def _args(rest: str) -> list:
    return [m.group(1) if m.group(1) is not None else m.group(2) for m in re.finditer(r'"([^"]*)"|(\S+)', rest)]


def _condition(cond: str) -> bool:
    """nroff view: ``n`` true, ``t`` false, register/string tests false (their registers are 0)."""
    neg = cond.startswith("!")
    c = cond[1:] if neg else cond
    return (c == "n") != neg if c in ("n", "t") else neg and c.startswith("r")


def strip_troff(src: str) -> str:
    """Plain text of a man page's troff source, deterministically (no groff).

    Comments and macro definitions dropped; conditionals read as nroff would (``n`` true, ``t`` false,
    number registers 0); text filled into paragraphs (``.nf`` ... ``.fi`` kept line by line); headings
    and tags on their own lines; font macros give their words (alternating-font macros joined without
    spaces); escapes map to ASCII or vanish.
    """
    out, cur = [], []
    state = {"fill": True, "tag": False, "ie": False}

    def brk(blank=False):
        if cur:
            out.append(" ".join(cur))
            cur.clear()
        if blank and out and out[-1] != "":
            out.append("")

    def text(s):
        s = _unescape(s).strip()
        if s:
            cur.append(s)
        if not state["fill"] or (state["tag"] and s):
            brk()
            state["tag"] = False

    lines, i = src.splitlines(), 0
    while i < len(lines):
        line, i = lines[i], i + 1
        if line.startswith((".\\\"", "'\\\"", ".\\#")) or line.strip() in (".", "'"):
            continue
        if line.startswith((".de", ".ig")):  # macro definitions and ignored blocks, up to ".."
            while i < len(lines) and lines[i].strip() != "..":
                i += 1
            i += 1
            continue
        m = re.match(r"^[.'](ie|if|el)\s+(.*)$", line)
        if m:
            i = _conditional(m.group(1), m.group(2), lines, i, state)
            continue
        if not line.startswith((".", "'")):
            text(line)
            continue
        name, _, rest = line[1:].partition(" ")
        if name in ("SH", "SS"):
            brk(blank=True)
            out.append(_unescape(" ".join(_args(rest))).strip())
        elif name in _INLINE:
            if rest.strip():  # else the next line is the text
                text(" ".join(_args(rest)))
        elif name in _FONT_ALTERNATING:
            text("".join(_args(rest)))
        elif name in _PARAGRAPH:
            brk(blank=True)
        elif name == "TP":
            brk()
            state["tag"] = True
        elif name == "IP":
            brk()
            if rest.strip():
                cur.append(_unescape(_args(rest)[0]))
                brk()
        elif name in ("br", "nf", "fi"):
            brk()
            state["fill"] = state["fill"] if name == "br" else name == "fi"
    brk()
    return "\n".join(out).strip() + "\n"


def _conditional(req: str, rest: str, lines: list, i: int, state: dict) -> int:
    """Handle ``.if/.ie/.el`` at ``lines[i - 1]``: splice the kept body into ``lines``; -> next index."""
    if req == "el":
        keep, body = not state["ie"], rest
    else:
        cond, _, body = rest.partition(" ")
        keep = _condition(cond)
        if req == "ie":
            state["ie"] = keep
    body = body.lstrip()
    if not body.startswith("\\{"):
        if keep and body.strip():
            lines.insert(i, body)
        return i
    inner, seg = [], body[2:].lstrip("\\")
    while True:  # a multi-line block, up to the line holding \}
        if seg.replace("\\}", "").strip():
            inner.append(seg.replace("\\}", ""))
        if "\\}" in seg or i >= len(lines):
            break
        seg, i = lines[i], i + 1
    if keep:
        lines[i:i] = inner
    return i
