"""comm.cases, the one case runner: what each rank is sent (its own part, by construction), how a failure is
reported and blamed (the lowest failing rank, whatever the timing), phases, problems raised when a case is
reached, and the one policy for agreeing with the grader's router (its log is the truth)."""

import time

import pytest
import torch
import torch.distributed as dist
from handed import HandedRecorder

from dpcourse import LaunchError
from dpcourse.comm.cases import Case, RankRun, agree_with_router, members_of, run_cases
from dpcourse.comm.recorder import CommOp


def report_part(learner, part, ctx):
    return {"part": part, "shared": ctx.shared}


def test_a_rank_is_sent_its_own_part_and_the_shared_values_only():
    """What the launch hands each rank (as the grader sends it: handed.HandedRecorder) is its RankCase:
    its own part and the shared values, nothing of its peers' parts."""
    parts = [torch.full((3,), float(10 + r)) for r in range(3)]
    with HandedRecorder() as handed:
        (runs,) = run_cases(report_part, None, 3, [Case(parts=parts, shared={"k": 2})], exercise="x")
    for run in runs:
        assert torch.equal(run.part, parts[run.rank]) and run.shared == {"k": 2}
    (launch,) = handed.launches
    for rank, (_, args, _) in enumerate(launch.per_rank):
        (mine,) = args[2]  # rank_loop(per_case, learner, cases, ...): this rank's cases
        assert mine.rank == rank and mine.part is parts[rank] and mine.shared == {"k": 2}
        assert not any(t is parts[other] for t in _tensors(args) for other in range(3) if other != rank)


def _tensors(value, depth=0):
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 6 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item, depth + 1)
    elif depth < 6 and hasattr(value, "__dict__"):
        yield from _tensors(list(vars(value).values()), depth + 1)


def test_for_rank_holds_the_part_of_that_rank_and_nothing_of_the_others():
    case = Case(parts=["peer secret", "b", None], shared=1, groups=[[0, 1]], label="l")
    mine = case.for_rank(1, index=4)
    assert (mine.index, mine.rank, mine.world_size, mine.part, mine.shared, mine.groups, mine.label) == (
        4, 1, 3, "b", 1, [[0, 1]], "l")
    assert "secret" not in repr(mine)
    assert members_of([[0, 1]], 2, 3) is None and members_of(None, 2, 3) == (0, 1, 2)


def phased(learner, part, ctx):
    x = part.clone()
    dist.all_reduce(x, **ctx.group_kwargs)
    ctx.phase("backward")
    dist.all_reduce(x, **ctx.group_kwargs)
    dist.barrier()  # the runner's own kind of call: left out of the records
    dist.all_reduce(x, **ctx.group_kwargs)
    return {"output": x, "group_rank": ctx.group_rank}


def test_phases_cut_the_calls_and_values_read_as_attributes():
    parts = [torch.ones(2) * r for r in range(4)]
    (runs,) = run_cases(phased, None, 4, [Case(parts=parts, groups=[[0, 2], [1, 3]])], exercise="phases",
                        defaults={"extra": None})
    for run in runs:
        assert [o.op for o in run.call] == ["all_reduce"]
        assert [o.op for o in run.backward] == ["all_reduce"] * 2
        assert run.ops == run.call + run.backward and run.group == ((0, 2) if run.rank % 2 == 0 else (1, 3))
        assert run.group_rank == run.values["group_rank"] and run.extra is None
        assert torch.equal(run.output, torch.full((2,), 4.0 * (run.rank % 2 + (run.rank % 2 + 2))))
    with pytest.raises(AttributeError, match="has no 'nothing'"):
        _ = runs[0].nothing


def raises_on(learner, part, ctx):
    if ctx.rank in part["raise"]:
        time.sleep(part["delay"] if ctx.rank == min(part["raise"]) else 0)
        raise ValueError(f"bad data on rank {ctx.rank}")
    x = torch.zeros(1)
    dist.recv(x, src=(ctx.rank + 1) % ctx.world_size)  # waits for a rank that failed: stopped
    return {}


def test_the_lowest_rank_that_raised_is_blamed_even_when_it_raised_last(no_orphans):
    """Rank 2 raises at once, rank 1 0.05 s later (a sixth of the launcher's STOP_GRACE, 0.3 s, in which
    ranks that fail alike report too): rank 1 is blamed every time, where the launcher alone blames the
    first to fail; and nobody waits out the 20 s group timeout for the ranks that failed."""
    case = Case(parts=[{"raise": {1, 2}, "delay": 0.05}] * 3)
    for _ in range(2):
        start = time.monotonic()
        with pytest.raises(LaunchError) as error:
            run_cases(raises_on, None, 3, [case], exercise="x", group_timeout=20)
        assert time.monotonic() - start < 15
        assert error.value.rank == 1 and str(error.value).startswith(
            "rank 1 of 3 raised ValueError: bad data on rank 1"), str(error.value)
        assert "rank 0: stopped when rank 1 failed" in str(error.value)


def waits_in_case(learner, part, ctx):
    if part == "stuck":
        x = torch.zeros(1)
        dist.recv(x, src=(ctx.rank + 1) % ctx.world_size)
    return {"value": part}


def test_a_deadlock_raises_when_its_case_is_reached_and_earlier_cases_come_first(no_orphans):
    cases = [Case(parts=["fine"] * 2, label="first"), Case(parts=["stuck"] * 2, label="second")]
    runs = run_cases(waits_in_case, None, 2, cases, exercise="wait", group_timeout=1)
    assert [run.value for run in runs[0]] == ["fine", "fine"]
    with pytest.raises(AssertionError, match=r"wait \(second\) deadlocked: ranks 0 and 1 of 2 waited 1 s"):
        runs[1]
    with pytest.raises(AssertionError, match="deadlocked"):
        list(runs)


def op(name):
    return CommOp(name, None, 8, 0.0, 0.0, (0, 1))


def routed(name, nbytes):
    record = CommOp(name, None, nbytes, 1.0, 2.0, (0, 1))
    record.payload = [torch.ones(1)]
    return record


def fake_runs(per_case_ops, failed_last=False):
    runs = []
    for i, ops in enumerate(per_case_ops):
        run = RankRun(0, (0, 1), ops=[op(n) for n in ops],
                      failure=("stuck", "x") if failed_last and i == len(per_case_ops) - 1 else None)
        run.phase_starts = [("backward", 1)]
        runs.append([run])
    return runs


def test_the_routers_log_replaces_the_records_when_the_names_agree():
    runs = fake_runs([["all_reduce", "all_gather"], ["barrier", "all_reduce"]])
    traffic = [[routed("all_reduce", 100), routed("barrier", 0), routed("all_gather", 200),
                routed("all_reduce", 300)]]
    agree_with_router(runs, traffic, "x", [False, False])
    assert [o.nbytes for o in runs[0][0].ops] == [100, 200] and [o.nbytes for o in runs[1][0].ops] == [300]
    assert [o.nbytes for o in runs[0][0].phases["backward"]] == [200]


def test_a_call_hidden_from_the_recorder_is_an_error_and_a_failed_case_may_have_one_call_more():
    traffic = [[routed("all_reduce", 1), routed("all_reduce", 1)]]
    with pytest.raises(AssertionError, match="made 2 communication call.* but recorded 1"):
        agree_with_router(fake_runs([["all_reduce"]]), traffic, "x", [False])
    runs = fake_runs([["all_reduce", "all_reduce", "send"]], failed_last=True)  # the router refused it
    agree_with_router(runs, traffic, "x", [True])
    assert [o.op for o in runs[0][0].ops] == ["all_reduce", "all_reduce", "send"]  # refused: as recorded
    with pytest.raises(AssertionError, match="but recorded 3"):
        agree_with_router(fake_runs([["all_reduce", "all_reduce", "send"]]), traffic, "x", [False])


def test_a_case_for_another_world_size_is_refused():
    with pytest.raises(ValueError, match="a case for 2 ranks in a launch of 3"):
        run_cases(phased, None, 3, [Case(parts=[1, 2])], exercise="x")
