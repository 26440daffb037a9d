"""The tables that restate code are generated (``scripts/gen_docs.py``), and the committed docs are
what the generator writes: an option added to settings/declarations.py, or a config added to configs/, without
rerunning ``python scripts/gen_docs.py`` fails here."""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

import doc_files
import gen_docs
from optimizer import MuonSettings, settings
from optimizer.settings import GROUP_OPTIONS, MUON, GroupOption


def declare(monkeypatch, name, value):
    """A declaration changed for this test only: in the module that declares it, and in the package
    that re-exports it (what editing the declaration changes)."""
    monkeypatch.setattr(settings.declarations, name, value)
    monkeypatch.setattr(settings, name, value)


def test_committed_docs_are_what_gen_docs_writes():
    assert gen_docs.stale() == [], "run: python scripts/gen_docs.py"


def test_the_documented_command_checks_and_passes():
    done = subprocess.run([sys.executable, os.path.join(doc_files.ROOT, "scripts", "gen_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _check(value, where, context):
    settings.check_number(where, value, low=0.0)


def test_a_group_option_added_to_settings_fails_until_regenerated(monkeypatch):
    dummy = GroupOption("dummy_beta", (MUON,), 0.25, "a dummy group option", _check)
    declare(monkeypatch, "GROUP_OPTIONS", (*GROUP_OPTIONS, dummy))
    assert gen_docs.stale() == ["docs/api.md"]
    assert "| `dummy_beta` | `0.25` | per group (Muon) | a dummy group option |" in gen_docs.options_table()


def test_an_optimizer_option_added_to_settings_fails_until_regenerated(monkeypatch):
    field = dataclasses.field(default=0.5, metadata={"declared": settings.Declared("a dummy option", _check)})
    with_dummy = dataclasses.make_dataclass("MuonSettings", [("dummy", float, field)], bases=(MuonSettings,),
                                            frozen=True)
    declare(monkeypatch, "MuonSettings", with_dummy)
    assert gen_docs.stale() == ["docs/api.md"]
    assert "| `dummy` | `0.5` | global (`opt.settings`) | a dummy option |" in gen_docs.options_table()


def test_a_config_added_fails_until_regenerated(monkeypatch, tmp_path):
    for path in glob.glob(os.path.join(doc_files.ROOT, gen_docs.CONFIG_GLOB)):
        shutil.copy(path, tmp_path)
    with open(os.path.join(doc_files.ROOT, "configs", "fsdp.toml")) as f:
        text = f.read()
    (tmp_path / "zz_new.toml").write_text("# A config added in this test.\n" + text.split("\n", 2)[2])
    monkeypatch.setattr(gen_docs, "CONFIG_GLOB", str(tmp_path / "*.toml"))
    stale = gen_docs.stale()
    assert "README.md" in stale, stale
    assert "| `zz_new` | 2 | dp_shard 2 | gqa | A config added in this test. |" in gen_docs.config_matrix()


def test_a_deleted_marker_is_an_error(monkeypatch):
    blocks = {**gen_docs.generators(), "no-such-block": lambda: "x"}
    with pytest.raises(ValueError, match="no-such-block"):
        gen_docs.generate(blocks)


def _table_rows(text: str, block: str) -> list[list[str]]:
    body = re.search(rf"<!-- {block} -->\n(.*?)\n<!-- /{block} -->", text, re.S).group(1)
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in body.split("\n")[2:]]


def test_api_md_lists_every_option_with_its_declared_default():
    """Read from the committed docs/api.md, against the declarations themselves."""
    rows = {re.match(r"`(\w+)`", r[0]).group(1): r for r in _table_rows(doc_files.read("docs/api.md"), "options-table")}
    for keyword, default in settings.constructor_keywords().items():
        assert rows[keyword][1] == f"`{default!r}`", keyword
    for o in GROUP_OPTIONS:
        assert rows[o.ctor_keyword if o.constructor else o.name][1] == f"`{o.default!r}`", o.name
    for f in dataclasses.fields(MuonSettings):
        assert rows[f.name][2] == "global (`opt.settings`)", f.name
    assert len(rows) == len(settings.constructor_keywords()) + sum(not o.constructor for o in GROUP_OPTIONS)


def test_the_config_matrix_has_every_config():
    names = sorted(os.path.splitext(os.path.basename(p))[0]
                   for p in glob.glob(os.path.join(doc_files.ROOT, "configs", "*.toml")))
    rows = _table_rows(doc_files.read("README.md"), "config-matrix")
    assert [r[0].strip("`") for r in rows] == names


def test_replace_block_keeps_what_is_outside():
    text = "a\n<!-- t -->\nold\n<!-- /t -->\nb\n<!-- t -->\nold too\n<!-- /t -->\n"
    assert gen_docs.replace_block(text, "t", "new") == "a\n<!-- t -->\nnew\n<!-- /t -->\nb\n<!-- t -->\nnew\n<!-- /t -->\n"
    with pytest.raises(ValueError):
        gen_docs.replace_block("no markers", "t", "x")
