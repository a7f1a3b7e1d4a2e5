"""Judge a submission's test cells in a process where the learner's code never runs.

    python -m dpgrader.judge SOURCE.ipynb SUBMISSION.ipynb... [--no-sandbox] [--only ID,ID] [--out F]
    python -m dpgrader.judge --serve [--no-sandbox]     # jobs on stdin (see `serve`)

writes one JSON object to --out (stdout by default):
{grade_id: {"passed", "output", "ename", "evalue", "seconds"}}.

How: this process reads the instructor's notebook (SOURCE, from solutions/: test cells with
their hidden parts) and the learner's (SUBMISSION). It runs the instructor's code cells in its
own namespace, in notebook order -- setup cells as they are, each graded test cell under a
capture of its output -- with the learner's names bound to stand-ins (`LearnerProxy`). Every
`launch` runs in sandboxed ranks (`RankPool`) that execute the learner's program; checks,
expected values and the verdict stay here. So nothing the learner's code does -- patching
modules or builtins, IPython hooks, emptying cells, objects that compare equal to anything --
can reach a verdict: it only ever sees plain values coming back.

Cells tagged `demo` are skipped (no test cell may depend on them).
"""

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import time
import traceback

import cloudpickle

import dpgrader
from dpgrader.judge.learner import (
    LearnerProxy,
    defined_names,
    is_demo,
    is_graded_test,
    nbgrader_meta,
    program_cells,
    read_notebook,
    restore_locked,
    solution_names,
)
from dpgrader.judge.ranks import BudgetSpent, GraderFailure, RankPool
from dpgrader.judge.zygotes import PRESTART, shared_scratch

OUTPUT_CHARS = 20_000  # of one test cell's output kept for feedback


def _pickle_hidden_checks_by_value():
    """Functions of the hidden checks travel to the ranks by value: the sandboxes cannot import dpgrader.

    Registering the package covers every submodule, imported now or later (cloudpickle looks up a
    module's parents), so no module is imported for it: walking them all imported nbgrader's
    server extensions through dpgrader.feedback, several seconds per judged notebook.
    """
    cloudpickle.register_pickle_by_value(dpgrader)


def judge(source, submission, sandboxed=True, only=None, pool=None, budget=None, budget_why=""):
    """{grade_id: verdict} for the graded test cells of `source`, judged against `submission`.

    `pool`: sandboxes to reuse (several submissions judged in one process); the learner's
    program travels with each launch, and every rank is forked fresh, so nothing carries over
    (as root each submission has a pid namespace, cgroup and user ids of its own, ended here).
    `budget`: seconds all the submission's launches and calls may take together; the cells that
    come after it is spent fail, saying so (`budget_why`: how the budget was set).
    """
    own_pool = pool is None
    submission = restore_locked(submission, source)
    if own_pool:
        pool = RankPool(sandboxed=sandboxed, prestart=PRESTART, scratch=shared_scratch())
    pool.set_program(program_cells(submission))
    pool.set_budget(budget, budget_why)
    _pickle_hidden_checks_by_value()
    namespace = {"__name__": "__main__"}
    for name in defined_names(submission, source) | solution_names(source):
        namespace[name] = LearnerProxy(name)
    verdicts, skipped = {}, []
    try:
        with pool.installed():
            for cell in source.cells:
                if cell.cell_type != "code" or is_demo(cell) or nbgrader_meta(cell).get("solution"):
                    continue
                if is_graded_test(cell):
                    grade_id = nbgrader_meta(cell)["grade_id"]
                    if only is None or grade_id in only:
                        verdicts[grade_id] = _run_test_cell(cell.source, namespace, pool)
                else:
                    problem = _run_setup_cell(cell.source, namespace, pool)
                    if problem:
                        skipped.append({"cell": cell.source[:80], "why": problem})
        reached = pool.end_submission()
    finally:
        if own_pool:
            pool.close()
            shutil.rmtree(pool.scratch, ignore_errors=True)
    if skipped:
        verdicts["_setup_cells_cut_short"] = skipped
    if any(reached.values()):
        verdicts["_limits_reached"] = reached  # its own processes hit its own limits (autograde.py reads it)
    if getattr(pool, "budget_spent", False):
        verdicts["_budget_spent"] = True  # the grader refused launches past the budget (autograde.py)
    if pool.starved:
        verdicts["_starved"] = list(pool.starved)  # the machine ran short (outside signals; autograde.py)
    return verdicts


def _run_setup_cell(source, namespace, pool):
    """An instructor cell that is neither a test nor a demo: imports and definitions the tests use.

    Such a cell never needs to run ranks; one that does is a demo that lacks its tag, and is cut
    short at its first launch (tests may not depend on it: docs/authoring.md).
    """
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            with pool.refusing("a cell that is not a test"):
                exec(compile(source, "<setup cell>", "exec"), namespace)  # noqa: S102 - instructor code
        except Exception as exc:  # noqa: BLE001 - recorded for maintainers, never a verdict
            return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def _run_test_cell(source, namespace, pool):
    """One test cell's verdict. Checks deferred by the cell (launcher.check_after_cell: how results
    were reached) run after its own code passed, so a wrong result keeps its own message."""
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    verdict = {"passed": True, "ename": None, "evalue": None}
    pool.deferred = []
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exec(compile(source, "<test cell>", "exec"), namespace)  # noqa: S102 - instructor code
            while pool.deferred:
                pool.deferred.pop(0)()
        except GraderFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - the verdict
            if isinstance(exc.__context__, GraderFailure) or isinstance(exc.__cause__, GraderFailure):
                raise exc.__cause__ or exc.__context__ from None
            verdict.update(passed=False, ename=type(exc).__name__, evalue=str(exc))
            own = type(exc).__module__.startswith("dpgrader")
            if own and not isinstance(exc, (AssertionError, BudgetSpent)):
                verdict["evalue"] += "\n" + traceback.format_exc(limit=3)
    if verdict["passed"] and err.getvalue().strip():
        verdict.update(
            passed=False,
            ename="Stderr",
            evalue="the test wrote to stderr, which nbgrader scores 0:\n" + err.getvalue()[:2000],
        )
    verdict["output"] = out.getvalue()[:OUTPUT_CHARS]
    verdict["seconds"] = round(time.monotonic() - start, 3)
    return verdict


def judge_next(pool, source, submission, only=None, budget=None, budget_why=""):
    """Judge one more submission with a pool that judged others before: its verdicts, and the
    shared scratch folder emptied after it (nothing its ranks left there reaches the next)."""
    verdicts = judge(source, read_notebook(submission), pool=pool, only=None if only is None else set(only),
                     budget=budget, budget_why=budget_why)
    _empty(pool.scratch)
    return verdicts


def serve(sandboxed):
    """Judge submissions as they are asked for, one JSON line each on stdin
    ({"source", "submission"}), answering one JSON line each ({"submission", "verdicts"}) on what
    was stdout; anything else printed goes to stderr. dpgrader.judge.process.JudgeWorker drives it."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    pool = RankPool(sandboxed=sandboxed, prestart=PRESTART, scratch=shared_scratch())
    try:
        for line in sys.stdin:
            job = json.loads(line)
            verdicts = judge_next(pool, read_notebook(job["source"]), job["submission"],
                                  budget=job.get("budget"), budget_why=job.get("budget_why", ""))
            replies.write(json.dumps({"submission": job["submission"], "verdicts": verdicts}) + "\n")
            replies.flush()
    finally:
        pool.close()
        shutil.rmtree(pool.scratch, ignore_errors=True)
    return 0


def main(argv=None):
    if argv is None and sys.argv[1:] in (["--serve"], ["--serve", "--no-sandbox"]):
        return serve(sandboxed="--no-sandbox" not in sys.argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source")
    parser.add_argument("submissions", nargs="*", help="one notebook, or several judged in turn")
    parser.add_argument(
        "--spec",
        help='a JSON list of {"submission": path, "only": [grade ids] or '
        "null}: several notebooks, each judged on its own cells",
    )
    parser.add_argument("--no-sandbox", action="store_true")
    parser.add_argument("--only", help="comma-separated grade ids")
    parser.add_argument("--out", help="write the verdicts here (default: stdout)")
    args = parser.parse_args(argv)
    source = read_notebook(args.source)
    only = set(args.only.split(",")) if args.only else None
    if len(args.submissions) == 1 and not args.spec:
        verdicts = judge(source, read_notebook(args.submissions[0]), not args.no_sandbox, only)
    else:  # {submission path: verdicts}, one set of sandboxes for all
        jobs = [
            {"submission": path, "only": None if only is None else sorted(only)} for path in args.submissions
        ]
        if args.spec:
            with open(args.spec) as f:
                jobs += json.load(f)
        pool = RankPool(sandboxed=not args.no_sandbox, prestart=PRESTART, scratch=shared_scratch())
        try:
            verdicts = {job["submission"]: judge_next(pool, source, job["submission"], job["only"])
                        for job in jobs}
        finally:
            pool.close()
            shutil.rmtree(pool.scratch, ignore_errors=True)
    text = json.dumps(verdicts)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _empty(folder):
    for entry in os.scandir(folder):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


if __name__ == "__main__":
    sys.exit(main())
