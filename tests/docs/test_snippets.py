"""Every Python block in README.md and docs/ that is marked runnable runs, as written, on CPU.

One test per block (its id is ``file:line`` of the opening fence, so ``pytest tests/docs -v``
lists every block it ran); markers are explained in ``doc_files.py``.  A block runs in a fresh
forked process (``ranks=N``: N forked ranks joined by gloo, as ``tests/harness.py`` starts them),
in an empty working directory, with one thread per process.  A block that raises fails its test,
with the block's own line numbers in the traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback

import pytest
import torch

import doc_files
from harness import run_ranks
from torchtitan_support import unsupported_reason

TIMEOUT_S = 180


def _blocks() -> list[doc_files.Block]:
    return [b for path in doc_files.doc_paths() for b in doc_files.python_blocks(path, doc_files.read(path))]


BLOCKS = _blocks()
RUNNABLE = [b for b in BLOCKS if doc_files.marker(b).run]


def _compile(block: doc_files.Block):
    # the block's lines keep their numbers in the file, so a traceback points at the doc
    return compile("\n" * block.line + block.code, block.path, "exec")


def _exec(block: doc_files.Block, workdir: str) -> None:
    os.chdir(workdir)
    torch.set_num_threads(1)
    exec(_compile(block), {"__name__": "__main__"})


def _single(block, workdir, results) -> None:
    try:
        _exec(block, workdir)
        results.put(None)
    except BaseException:  # noqa: BLE001 - every failure goes back to the test
        results.put(traceback.format_exc())
    finally:
        results.close()
        results.join_thread()
        os._exit(0)


def run_single(block: doc_files.Block, workdir: str) -> None:
    """Run a block in a forked process, so that nothing it sets (threads, globals, a process group)
    reaches the test process."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    proc = ctx.Process(target=_single, args=(block, workdir, results), daemon=True)
    proc.start()
    try:
        error = results.get(timeout=TIMEOUT_S)
    except queue.Empty:
        error = f"{block.id}: did not finish within {TIMEOUT_S} s"
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    if error:
        pytest.fail(f"{block.id} raised:\n{error}", pytrace=False)


def _rank(rank: int, world_size: int, block: doc_files.Block, workdir: str) -> None:
    import torch.distributed as dist

    # The harness has joined the ranks already (what torchrun + the block's init_process_group do);
    # the block's own calls to join and to leave are no-ops here, the harness leaves after it.
    dist.init_process_group = lambda *args, **kwargs: None
    dist.destroy_process_group = lambda *args, **kwargs: None
    _exec(block, os.path.join(workdir, f"rank{rank}"))


def run_ranks_of(block: doc_files.Block, ranks: int, workdir: str) -> None:
    for r in range(ranks):
        os.makedirs(os.path.join(workdir, f"rank{r}"))
    run_ranks(_rank, ranks, block, workdir, timeout=TIMEOUT_S)


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_runnable_block_runs(block, tmp_path):
    mark = doc_files.marker(block)
    for module in mark.requires:
        pytest.importorskip(module, reason=f"{block.id} needs {module}")
        if module == "torchtitan" and unsupported_reason():
            pytest.skip(f"{block.id}: {unsupported_reason()}")
    if mark.ranks == 1:
        run_single(block, str(tmp_path))
    else:
        run_ranks_of(block, mark.ranks, str(tmp_path))


def test_every_python_block_says_whether_it_runs():
    problems = [f"{b.id}: {p}" for b in BLOCKS for p in doc_files.marker(b).problems]
    assert not problems, "\n".join(problems)
    # the README's quick start is among the blocks that run (issue 31: it works on CPU as written)
    readme = [b for b in RUNNABLE if b.path == "README.md"]
    assert len(readme) >= 2, [b.id for b in RUNNABLE]
    print(f"{len(RUNNABLE)} runnable blocks ({sum(doc_files.marker(b).ranks > 1 for b in RUNNABLE)} on forked ranks), "
          f"{len(BLOCKS) - len(RUNNABLE)} marked no-run: "
          + "; ".join(f"{b.id} ({doc_files.marker(b).reason})" for b in BLOCKS if not doc_files.marker(b).run))


def test_the_marker_rules():
    def block(info):
        return doc_files.Block("x.md", 1, info, "pass\n")

    assert doc_files.marker(block("python run")) == doc_files.Marker(True)
    assert doc_files.marker(block("python run ranks=4 requires=transformers,peft")) == \
        doc_files.Marker(True, 4, ("transformers", "peft"))
    assert doc_files.marker(block("python no-run: needs CUDA")).reason == "needs CUDA"
    assert doc_files.marker(block("python no-run")).problems  # a reason is required
    assert doc_files.marker(block("python")).problems  # unmarked
    assert doc_files.marker(block("python run rank=2")).problems  # a typo is not ignored


def test_a_broken_block_fails_with_its_line(tmp_path):
    """The runner reports a block's error (a wrong API call) with the doc's own line numbers."""
    code = "import optimizer\n\nopt = optimizer.Muon([torch.nn.Parameter(torch.ones(2, 2))], lr=0.1)\n" \
           "optimizer.no_such_function()\n"
    broken = doc_files.Block("README.md", 40, "python run", "import torch\n" + code)
    with pytest.raises(pytest.fail.Exception, match=r'(?s)README.md", line 45.*no_such_function'):
        run_single(broken, str(tmp_path))
    with pytest.raises(Exception, match="no_such_function"):
        run_ranks_of(broken, 2, str(tmp_path / "ranks"))
