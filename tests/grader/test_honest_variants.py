"""Correct answers written otherwise than the solution get full marks, as the grader judges them: the
grader's measurements (memory, messages, work) must not depend on how a right answer is written.

Each variant is a way learners and libraries write an exercise of notebook 12 that its text allows:
ring attention with separate isend and irecv, an index_copy merge and the send request kept past its
wait (which holds its block until the next step's request replaces it, with gloo as with the grader);
ring attention merged as torch's `_SDPAMerger` does (a sigmoid and a log-sigmoid). Each is judged on its
exercise's test cells, hidden parts included, and must pass every one of them. Run on a loaded machine
too (`make test-under-load`): the memory they are judged on is counted in tensors' lifetimes, not time.
"""

import re
import sys
import types

import cloudpickle
import nbformat
import pytest

from grading import exercise_tests, solution_path, write_variant
from judging import judge_jobs
from markers import exercise

ASSIGNMENT = "12_sequence_and_experts"
pytestmark = pytest.mark.slow

ISEND_IRECV_INDEX_COPY = '''def ring_attention(q, k, v, positions, causal=False):
    """Separate isend and irecv, an index_copy merge; the send request is kept after its wait()."""
    n, me = dist.get_world_size(), dist.get_rank()
    mine = positions[me]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    block = torch.stack((k, v))
    send = None
    for step in range(n):
        source = (me - step) % n
        if step < n - 1:
            arriving = torch.empty((2, *k.shape[:-2], len(positions[(source - 1) % n]), k.shape[-1]),
                                   dtype=k.dtype, device=k.device)
            recv = dist.irecv(arriving, (me - 1) % n)
            send = dist.isend(block, (me + 1) % n)
        keys = positions[source]
        rows = torch.arange(len(mine))
        if causal:
            rows = rows[mine >= keys.min()]
            cols = (keys <= mine.max()).nonzero().flatten()
            kb, vb, kp = block[0].index_select(-2, cols), block[1].index_select(-2, cols), keys[cols]
        else:
            kb, vb, kp = block[0], block[1], keys
        if len(rows) and len(kp):
            block_out, block_lse = attention_block(q.index_select(-2, rows), kb, vb, mine[rows], kp, causal)
            old = lse.index_select(-1, rows)
            new = torch.logaddexp(old, block_lse)
            merged = (out.index_select(-2, rows) * torch.exp(old - new).unsqueeze(-1)
                      + block_out * torch.exp(block_lse - new).unsqueeze(-1))
            out = out.index_copy(-2, rows, merged)
            lse = lse.index_copy(-1, rows, new)
        if step < n - 1:
            recv.wait()
            send.wait()
            block = arriving
    return out
'''

SIGMOID_MERGE = '''def ring_attention(q, k, v, positions, causal=False):
    """Merged the way torch's _SDPAMerger._merge_one does: with a sigmoid and a log-sigmoid."""
    n, me = dist.get_world_size(), dist.get_rank()
    mine = positions[me]
    out = lse = None
    kv = torch.stack((k, v))
    for step in range(n):
        source = (me - step) % n
        if step < n - 1:
            arriving = torch.empty((2, *k.shape[:-2], len(positions[(source - 1) % n]), k.shape[-1]),
                                   dtype=k.dtype, device=k.device)
            requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (me + 1) % n),
                                               dist.P2POp(dist.irecv, arriving, (me - 1) % n)])
        keys = positions[source]
        rows, cols = torch.arange(len(mine)), torch.arange(len(keys))
        if causal:
            rows, cols = rows[mine >= keys.min()], cols[keys <= mine.max()]
        if len(rows) and len(cols):
            block_out, block_lse = attention_block(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                                   mine[rows], keys[cols], causal)
            if out is None:  # step 0, the rank's own block: every query sees at least its own key
                out, lse = block_out, block_lse
            else:
                o, m = out[..., rows, :], lse[..., rows]
                out[..., rows, :] = o - torch.sigmoid(block_lse - m).unsqueeze(-1) * (o - block_out)
                lse[..., rows] = m - F.logsigmoid(m - block_lse)
        if step < n - 1:
            for request in requests:
                request.wait()
            kv = arriving
    return out
'''

# name -> (exercise key, {grade id: source})
HONEST = {
    "ring_isend_irecv_index_copy_send_request_kept": ("ring_attention",
                                                      {"ring_attention": ISEND_IRECV_INDEX_COPY}),
    "ring_sigmoid_merge": ("ring_attention", {"ring_attention": SIGMOID_MERGE}),
}


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    root, tests = tmp_path_factory.mktemp("honest"), exercise_tests(ASSIGNMENT)
    jobs = {name: (write_variant(ASSIGNMENT, cells, root / name), tests[key])
            for name, (key, cells) in HONEST.items()}
    return judge_jobs(ASSIGNMENT, jobs, root)


def notebook_function(source, name):
    """`name` from `source` run after the notebook's own attention_block cell, as a module whose functions
    travel to ranks by value: the variant as a learner's kernel would run it."""
    cells = nbformat.read(solution_path(ASSIGNMENT), as_version=4).cells
    helper = next(c.source for c in cells
                  if c.cell_type == "code" and c.source.startswith("def attention_block"))
    module = types.ModuleType(f"honest_{name}")
    sys.modules[module.__name__] = module
    exec("import math\nimport torch\nimport torch.distributed as dist\nimport torch.nn.functional as F\n"
         + helper + "\n" + source, module.__dict__)
    cloudpickle.register_pickle_by_value(module)
    return getattr(module, name)


PEAKS = re.compile(r"peak bytes allocated, 1 rank: (\d+)\s+6 ranks: \[([\d, ]+)\]")


def gloo_peaks(ring_attention):
    """The visible memory test's measurement (1 rank, then 6, the same block per rank), under gloo."""
    from dpcourse.topics.sequence.runs import run_attention_cases

    blocks = [dict(shape=(1, 1, 12 * n, 24), seeds=(13, 14, 15), positions="contiguous", causal=False)
              for n in (1, 6)]
    alone, ring = (run_attention_cases(ring_attention, n, [case], exercise="ring_attention", p2p_only=True)[0]
                   for n, case in zip((1, 6), blocks, strict=True))
    return alone[0].peak, [r.peak for r in ring]


@exercise("ring_attention")
@pytest.mark.parametrize("name", sorted(HONEST))
def test_a_correct_ring_holds_under_the_grader_what_it_holds_under_gloo(judged, name):
    """The grader's memory is the learner's: the peaks the graded cell printed are those of the same code
    run under gloo, byte for byte (the router once added a block of its own to a send, and held a dropped
    request's block while its reply thread ran)."""
    key, cells = HONEST[name]
    work = next(c for c in judged[name]["cells"] if c["grade_id"] == "test_ring_attention_work")
    printed = PEAKS.search(work["output"])
    assert printed, work["output"][-500:]
    graded = (int(printed[1]), [int(p) for p in printed[2].split(",")])
    assert graded == gloo_peaks(notebook_function(cells["ring_attention"], "ring_attention"))


@exercise("ring_attention")
@pytest.mark.parametrize("name", sorted(HONEST))
def test_a_correct_answer_written_otherwise_gets_full_marks(judged, name):
    key, _ = HONEST[name]
    tests = exercise_tests(ASSIGNMENT)[key]
    cells = {c["grade_id"]: c for c in judged[name]["cells"] if c["grade_id"] in tests}
    assert sorted(cells) == sorted(tests), cells
    short = {g: c["message"][:600] for g, c in cells.items() if c["points"] != c["max_points"]}
    assert not short, f"{name} lost points: {short}"
