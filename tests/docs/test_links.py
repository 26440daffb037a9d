"""Every relative link in README.md and docs/ resolves: the file (or folder) exists in the
repository, and a ``#anchor`` names a heading of the target (GitHub's anchors)."""

from __future__ import annotations

import os

import pytest

import doc_files

# Docs that other work in progress writes (issues 28-32); links to them are allowed before they
# land.  Remove a name here when its file is committed (then its links and anchors are checked).
EXPECTED_SOON: set[str] = set()


def problems_of(path: str, text: str, exists=os.path.exists, anchors_of=None) -> list[str]:
    """What is wrong with the relative links of one doc file (empty: nothing)."""
    anchors_of = anchors_of or (lambda target: doc_files.anchors(doc_files.read(target)))
    out = []
    for line, target in doc_files.links(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        where = f"{path}:{line}: ({target})"
        if resolved.startswith(".."):
            out.append(f"{where} points outside the repository")
            continue
        if not exists(os.path.join(doc_files.ROOT, resolved)):
            if resolved not in EXPECTED_SOON:
                out.append(f"{where} {resolved} does not exist")
            continue
        if anchor and resolved.endswith(".md") and anchor not in anchors_of(resolved):
            out.append(f"{where} {resolved} has no heading with the anchor #{anchor}")
    return out


@pytest.mark.parametrize("path", doc_files.doc_paths())
def test_relative_links_resolve(path):
    problems = problems_of(path, doc_files.read(path))
    assert not problems, "\n".join(problems)


def test_the_readme_maps_every_doc():
    """README maps docs/: every docs/*.md is linked from README.md."""
    linked = {os.path.normpath(t.partition("#")[0]) for _, t in doc_files.links(doc_files.read("README.md"))}
    orphans = [p for p in doc_files.doc_paths() if p.startswith("docs/") and p not in linked]
    assert not orphans, orphans


def test_the_checker_catches_what_it_should():
    text = "\n".join([
        "# A title", "## Two `words` here", "## Two words here",
        "[ok](#a-title) [ok](#two-words-here-1) [bad](#nope)",
        "[missing](no_such_file.md) [soon](docs/kernels.md) [out](../shared/x.md)",
        "`[in code](not_checked.md)`", "```", "[in a block](not_checked_either.md)", "```",
        "[web](https://example.com/x.md) ![img](examples/results/main_job.png)",
    ])
    assert doc_files.anchors(text) == {"a-title", "two-words-here", "two-words-here-1"}
    found = problems_of("README.md", text, anchors_of=lambda target: doc_files.anchors(text))
    assert [p.split(": ", 1)[1].split(")")[0] for p in found] == ["(#nope", "(no_such_file.md", "(../shared/x.md"]


def test_slugs_are_githubs():
    assert doc_files.slug("Coming from `torch.optim.Muon`") == "coming-from-torchoptimmuon"
    assert doc_files.slug("Muon variants: NorMuon, cautious weight decay, low-precision momentum") == \
        "muon-variants-normuon-cautious-weight-decay-low-precision-momentum"
    assert doc_files.slug("GPU validation: `scripts/gpu_check.sh`") == "gpu-validation-scriptsgpu_checksh"
    assert doc_files.slug("One matrix over k ranks (`ns_split`)") == "one-matrix-over-k-ranks-ns_split"
    assert doc_files.slug("Newton–Schulz & [links](x.md)") == "newtonschulz--links"
