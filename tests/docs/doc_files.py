"""Reading README.md and docs/*.md as the tests need them: fenced code blocks with their markers,
relative links, and the anchors GitHub gives headings.  Pure functions of the text.

A Python block says whether the tests run it, in its info string after ``python``:

* ```` ```python run ```` — run on CPU in a fresh process, in an empty working directory;
* ```` ```python run ranks=N ```` — run on N forked ranks joined by gloo (what ``torchrun
  --nproc-per-node N`` would start; the block's own ``init_process_group`` finds them joined);
* ```` ```python run requires=transformers,accelerate ```` — skipped (with the reason) where a
  module it needs is not installed;
* ```` ```python no-run: REASON ```` — not run; REASON says why (CUDA, many ranks, a launcher).

Every ``python`` block carries one of these, so no example can sit in the docs untested unnoticed.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from gen_docs import doc_paths  # noqa: E402  (one definition of which files are docs)

__all__ = ["ROOT", "Block", "anchors", "doc_paths", "fenced_blocks", "links", "python_blocks", "read", "slug"]

_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")


def read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


@dataclass(frozen=True)
class Block:
    path: str
    line: int  # of the opening fence, 1-based
    info: str  # the info string, e.g. "python run ranks=2"
    code: str

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class Marker:
    run: bool
    ranks: int = 1
    requires: tuple[str, ...] = ()
    reason: str = ""  # why a no-run block is not run
    problems: tuple[str, ...] = field(default=())


def fenced_blocks(path: str, text: str) -> list[Block]:
    """Every fenced code block (``` or ~~~), with the line of its opening fence."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start, body = m.group(2), m.group(3).strip(), i, []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence) and set(lines[i].strip()) == {fence[0]}):
            body.append(lines[i])
            i += 1
        out.append(Block(path, start + 1, info, "\n".join(body) + "\n"))
        i += 1
    return out


def python_blocks(path: str, text: str) -> list[Block]:
    return [b for b in fenced_blocks(path, text) if b.language == "python"]


def marker(block: Block) -> Marker:
    """What a Python block's info string says about running it (``problems`` if it says it badly)."""
    rest = block.info.split(None, 1)[1].strip() if len(block.info.split()) > 1 else ""
    if rest.startswith("no-run"):
        reason = rest.removeprefix("no-run").lstrip(":").strip()
        return Marker(False, reason=reason, problems=() if reason else ("`no-run` needs a reason: `no-run: why`",))
    words = rest.split()
    if not words or words[0] != "run":
        return Marker(False, problems=(f"mark it `python run` or `python no-run: reason` (info string {block.info!r})",))
    ranks, requires, problems = 1, (), []
    for word in words[1:]:
        key, _, value = word.partition("=")
        if key == "ranks" and value.isdigit() and int(value) >= 1:
            ranks = int(value)
        elif key == "requires" and value:
            requires = tuple(value.split(","))
        else:
            problems.append(f"unknown marker word {word!r} (known: ranks=N, requires=a,b)")
    return Marker(True, ranks, requires, problems=tuple(problems))


# ---------------------------------------------------------------------------- links and anchors


def _outside_code(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` for lines outside fenced blocks, inline code spans blanked."""
    out, fence = [], None
    for n, line in enumerate(text.split("\n"), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(2)
            continue
        if fence is not None:
            if line.strip().startswith(fence) and set(line.strip()) == {fence[0]}:
                fence = None
            continue
        out.append((n, re.sub(r"(`+)(.+?)\1", lambda s: " " * len(s.group(0)), line)))
    return out


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(text: str) -> list[tuple[int, str]]:
    """``(line, target)`` of every inline link and image outside code."""
    return [(n, m.group(1)) for n, line in _outside_code(text) for m in _LINK.finditer(line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: inline markup dropped, lower case, punctuation other
    than ``-`` and ``_`` removed, spaces to ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown file's headings (duplicates numbered as GitHub numbers them), and
    explicit ``<a id="...">`` / ``<a name="...">`` anchors."""
    out, counts = set(), {}
    raw_lines = text.split("\n")
    for n, _ in _outside_code(text):
        line = raw_lines[n - 1]
        m = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(2))
            k = counts.get(base, 0)
            counts[base] = k + 1
            out.add(base if k == 0 else f"{base}-{k}")
        out.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
    return out
