#!/usr/bin/env python
"""Regenerate every table in README.md and docs/ that restates code or recorded data.

    python scripts/gen_docs.py            # rewrite the generated blocks in place
    python scripts/gen_docs.py --check    # exit 1, naming the files, if any block is out of date

A generated block sits between two marker comments, ``<!-- NAME -->`` and ``<!-- /NAME -->``;
everything between them is replaced, everything outside is left alone.  The blocks:

* ``options-table`` — every option of ``optimizer.Muon``, from the declarations in
  ``optimizer/settings/declarations.py`` (``GROUP_OPTIONS`` and the fields of ``MuonSettings``);
* ``config-matrix`` — one row per ``configs/*.toml``, read with ``examples.config.load_config``
  (ranks, mesh, attention) and the file's own header comment (what it is);
* ``module-map`` — every module of ``torch-ext/optimizer`` with its docstring's first sentence
  (``scripts/house.py``), in docs/architecture.md;
* ``main-job-table``, ``main-job-hardware``, ``lr-sweep-table``, ``lr-sweep-dion2-table`` — the
  recorded main job and learning-rate sweeps (``examples/results/``, through
  ``examples.report.recorded_blocks``).

tests/docs/test_generated_docs.py fails when a committed file differs from what this script
writes, so adding an option to settings/declarations.py (or a config) without rerunning it fails CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import sys
from collections.abc import Callable, Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(ROOT, "torch-ext"), ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

DOC_FILES = ("README.md", "docs/*.md")
CONFIG_GLOB = "configs/*.toml"
RESULTS_DIR = "examples/results"


# ---------------------------------------------------------------------------- markers


def marker_names(text: str) -> list[str]:
    """Names of the marked blocks in a Markdown text, in order."""
    return re.findall(r"<!-- ([a-z0-9-]+) -->", text)


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the content between ``<!-- name -->`` and ``<!-- /name -->`` set to ``body``
    (every occurrence of the pair)."""
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"no {start} ... {end} block")
    return pattern.sub(lambda _: f"{start}\n{body.rstrip()}\n{end}", text)


# ---------------------------------------------------------------------------- the option table


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(value) -> str:
    return f"`{value!r}`"


def _scope(kinds: tuple[str, ...]) -> str:
    names = {"muon": "Muon", "dion2": "Dion2", "adamw": "AdamW", "lion": "Lion"}
    return "per group (" + ", ".join(names[k] for k in kinds) + ")"


def options_table(settings=None) -> str:
    """The option reference: one row per constructor keyword (torch.optim.Muon's positional ones
    first, in its order), then the options a group can set only itself."""
    if settings is None:
        from optimizer import settings
    by_keyword = {o.ctor_keyword: o for o in settings.GROUP_OPTIONS if o.constructor}
    fields = {f.name: f for f in dataclasses.fields(settings.MuonSettings)}
    alias_docs = {}  # keywords with no declaration of their own (torch's adjust_lr_fn): constructor_doc says
    for line in settings.constructor_doc().splitlines():
        m = re.match(r"\s+(\w+): (.*)", line)
        if m:
            alias_docs[m.group(1)] = m.group(2)
    rows = []
    for keyword, default in settings.constructor_keywords().items():
        if keyword in by_keyword:
            o = by_keyword[keyword]
            where = _scope(o.kinds) + ("" if o.ctor_keyword == o.name else f"; the group key is `{o.name}`")
            meaning = o.doc
            if o.has_torch_default:
                meaning += f" (torch-style input defaults to {_code(o.torch_default)})"
            notes = ["a group holds it only when it is not at its default"] if o.optional else []
            if o.kept_on_load:
                notes.append("`load_state_dict` keeps the loading optimizer's value: how this machine runs or stores")
            if notes:
                meaning += f" ({'; '.join(notes)})"
        elif keyword in fields:
            where, meaning = "global (`opt.settings`)", fields[keyword].metadata["declared"].doc
        elif keyword in alias_docs:
            where, meaning = "constructor only", alias_docs[keyword]
        else:
            raise ValueError(f"gen_docs: constructor keyword {keyword!r} has no declaration or doc in settings/declarations.py")
        position = settings.TORCH_POSITIONAL.index(keyword) + 1 if keyword in settings.TORCH_POSITIONAL else None
        name = f"`{keyword}`" + (f" (positional {position})" if position else "")
        rows.append((name, _code(default), where, meaning))
    for o in settings.GROUP_OPTIONS:
        if not o.constructor:
            rows.append((f"`{o.name}`", _code(o.default), _scope(o.kinds) + ", set in the group only", o.doc))
    lines = ["| option | default | where | meaning |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the config matrix


def header_sentence(path: str) -> str:
    """The first sentence of a config file's leading comment (the run command left out)."""
    words = []
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            text = line[1:].strip()
            if text.startswith(("torchrun ", "python ")):
                continue
            words.append(text)
    prose = " ".join(words)
    return re.split(r"(?<=\.)\s", prose, maxsplit=1)[0] if prose else ""


def config_matrix() -> str:
    from examples.config import load_config

    lines = ["| config | ranks | mesh | attention; optimizer if not Muon | what it is (from the file's header) |",
             "|---|---|---|---|---|"]
    for path in sorted(glob.glob(os.path.join(ROOT, CONFIG_GLOB))):
        cfg = load_config(path)
        mesh = " × ".join(f"{d} {getattr(cfg.mesh, d)}" for d in cfg.mesh.dim_names) or "–"
        attention = cfg.model.attention + (f", row blocks `{cfg.muon.row_blocks}`" if cfg.muon.row_blocks != "none"
                                           else "")
        options = cfg.muon.group_options()  # Dion2 / NorDion2 on the Muon group
        if options:
            kind = "NorDion2" if options.get("normuon_beta2") is not None else "Dion2"
            attention += f"; {kind} " + ", ".join(f"`{k} = {v}`" for k, v in options.items())
        name = os.path.splitext(os.path.basename(path))[0]
        cells = (f"`{name}`", str(cfg.world_size), mesh, attention, header_sentence(path))
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- all of them


def generators() -> dict[str, Callable[[], str]]:
    def recorded(name: str) -> Callable[[], str]:
        def block() -> str:
            from examples.report import recorded_blocks
            return recorded_blocks(os.path.join(ROOT, RESULTS_DIR))[name]
        return block

    def module_map() -> str:
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
        from house import module_map as the_map
        return the_map()

    out: dict[str, Callable[[], str]] = {"options-table": options_table, "config-matrix": config_matrix,
                                         "module-map": module_map}
    out.update({name: recorded(name) for name in ("main-job-table", "main-job-hardware", "lr-sweep-table",
                                                  "lr-sweep-dion2-table")})
    return out


def doc_paths() -> list[str]:
    """README.md and docs/*.md, relative to the repository."""
    found = []
    for pattern in DOC_FILES:
        found += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    return found


def generate(blocks: Mapping[str, Callable[[], str]] | None = None) -> dict[str, str]:
    """``{path: text}`` for every doc file, each generated block filled in.  Every block must appear
    in some file (a marker deleted by mistake would otherwise leave a table unchecked)."""
    blocks = generators() if blocks is None else blocks
    bodies: dict[str, str] = {}
    out, seen = {}, set()
    for path in doc_paths():
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        for name in marker_names(text):
            if name in blocks:
                if name not in bodies:
                    bodies[name] = blocks[name]()
                text = replace_block(text, name, bodies[name])
                seen.add(name)
        out[path] = text
    missing = sorted(set(blocks) - seen)
    if missing:
        raise ValueError(f"gen_docs: no doc file has the block(s) {missing}: put <!-- NAME --> <!-- /NAME --> back")
    return out


def stale(blocks: Mapping[str, Callable[[], str]] | None = None) -> list[str]:
    """The doc files whose committed text differs from what :func:`generate` writes."""
    out = []
    for path, text in generate(blocks).items():
        with open(os.path.join(ROOT, path)) as f:
            if f.read() != text:
                out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is out of date")
    args = parser.parse_args(argv)
    if args.check:
        out_of_date = stale()
        for path in out_of_date:
            print(f"{path}: generated blocks are out of date; run python scripts/gen_docs.py")
        return 1 if out_of_date else 0
    for path, text in generate().items():
        full = os.path.join(ROOT, path)
        with open(full) as f:
            changed = f.read() != text
        if changed:
            with open(full, "w") as f:
                f.write(text)
            print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
