"""What remains of the old per-chapter runner: `launch_run` for notebooks 10 and 11 (moved onto the
case runner, dpcourse.comm.cases, with those chapters)."""

from dpcourse.comm.recorder import CommOp
from dpcourse.runtime.failures import LaunchError
from dpcourse.runtime.launcher import launch, observed_traffic
from dpcourse.runtime.timeouts import TIMEOUTS


def plain_ops(ops):
    """CommOp records as plain lists, as a graded rank may return them (launch_run turns them back)."""
    return [o.row() for o in ops]


def launch_run(run, world_size, learner, *args, explain=None, group_timeout=TIMEOUTS["test_group"], **kwargs):
    """launch(run, world_size, learner, *args, **kwargs) for a test cell (notebooks 10 and 11).

    Each result's "ops" (plain lists, see plain_ops) becomes the rank's whole communication in the
    run as the grader's router saw it when graded (launcher.observed_traffic), else as the rank's
    own recorder saw it, as CommOp records. A LaunchError becomes an AssertionError whose first
    line says which rank failed, and how, followed by `explain(error)` (a diagnosis, or "").
    """
    try:
        results = launch(run, world_size, learner, *args, group_timeout=group_timeout, **kwargs)
    except LaunchError as error:
        name = getattr(learner, "name", None) or getattr(learner, "__name__", "your code")
        first, _, rest = str(error).partition("\n")
        hint = explain(error) if explain is not None else ""
        raise AssertionError(f"{name} on {world_size} rank(s): {first}{hint}\n{rest}") from None
    traffic = observed_traffic()
    for rank, result in enumerate(results):
        if isinstance(result, dict) and "ops" in result:
            recorded = [CommOp.from_row(fields) for fields in result["ops"]]
            result["ops"] = list(traffic[rank]) if traffic is not None else recorded
    return results
