"""Turn what the ranks left behind into one error that names the rank to blame.

Used by every notebook through launch (LaunchError); 00, 03 and 05 catch it to show a failure.

When one rank raises, its peers fail a few milliseconds later with
"Connection closed by peer"; when a rank spins, its peers time out waiting for
it. Both peers are victims. The culprit is the rank whose failure is not a
consequence of another's: the earliest genuine error or crash, else a rank that
was still running outside communication while the others waited, else (all
waiting on each other) a deadlock, reported with where every rank was stuck.

Source lines: a rank's stack dump names files and lines, and the text of the line is looked up by
`source(path, line)`. In a notebook that is linecache (the ranks are the learner's own processes on
the learner's own machine). While grading, a rank's dump is text written by learner code, and a
path in it may name any file (/etc/shadow, the solutions): the grader passes a `source` that answers
only for the learner's own cells (`<cell N>`, from the notebook it holds) and never opens a file.
"""

import os
import re
import signal
import sysconfig
from contextlib import contextmanager

VICTIM = re.compile(r"closed by peer|Connection reset|Broken pipe|ECONNRESET|Connection refused"
                    r"|Socket closed|connection closed", re.I)


SIZE_MISMATCH = "Received data size doesn't match expected size"  # gloo's pair.cc, before it aborts
WAITED = re.compile(r"Timed out|timeout|timed out|Timeout", re.I)


class LaunchError(RuntimeError):
    """A launch failed. `rank` is the rank to blame, `ranks` every rank involved,
    `kind` one of "raised", "exited", "deadlock", "deadline"."""

    def __init__(self, message, rank, kind, ranks=()):
        super().__init__(message)
        self.rank, self.kind, self.ranks = rank, kind, sorted(set(ranks) | {rank})


@contextmanager
def unless_not_written(*names):
    """In a demo cell: print "naive_pipeline_step is not written yet" instead of a traceback when
    an exercise still raises NotImplementedError, here or inside the ranks of a launch (where it
    arrives as a LaunchError). Any other error goes through. Used by notebook 07's demos.

        with unless_not_written("gpipe_step"):
            plot_timeline(stage_timelines(run_pipeline(gpipe_step, case, exercise="gpipe_step"), case))
    """
    try:
        yield
    except (NotImplementedError, LaunchError, AssertionError) as error:
        # launch_run (dpcourse.comm.cases) words a rank's exception as an AssertionError
        if not isinstance(error, NotImplementedError) and "raised NotImplementedError" not in str(error):
            raise
        print(f"{' or '.join(names)} {'is' if len(names) == 1 else 'are'} not written yet")


def linecache_source(path, line):
    """The text of line `line` of file `path` (linecache): for ranks this process started itself."""
    import linecache

    return linecache.getline(path, int(line))


_source = linecache_source  # how source lines are found while one failure is described


def describe_failure(ranks, stopped, deadline, group_timeout, source=None):
    """Build the LaunchError for a launch that failed or ran out of time; `stopped` are the ranks
    the launcher had to stop (still running, no report). `source(path, line)`: the text of a line
    a rank's stack names (see the module docstring); linecache when None."""
    global _source
    _source = source or linecache_source
    try:
        return _describe(ranks, stopped, deadline, group_timeout)
    finally:
        _source = linecache_source


def _describe(ranks, stopped, deadline, group_timeout):
    world = len(ranks)
    failed = [r for r in ranks if r not in stopped and _is_failure(r)]
    genuine = [r for r in failed if _kind(r) not in ("victim", "waited")]
    waited = [r for r in failed if _kind(r) == "waited"]
    running = [r for r in stopped if _in_user_code(_stack(r)) and not _in_communication(_stack(r))]
    returned = [r for r in ranks if r.report is not None and r.report[0] == "ok"]
    others = lambda culprit: [r for r in ranks if r is not culprit]  # noqa: E731

    if genuine:
        culprit = min(genuine, key=_when)
        head = _headline(culprit, world) + _same_error_elsewhere(culprit, genuine)
        kind = "raised" if culprit.report else "exited"
    elif running and len(running) == len(stopped) and not failed:
        culprit = running[0]
        head = (f"{'rank' if len(running) == 1 else 'ranks'} {_names(running)} of {world} did not "
                f"finish within the {deadline:g} s deadline, none of them waiting on another: an "
                f"endless loop, or far too much work? rank {culprit.rank} was running {_where(culprit)}")
        kind = "deadline"
    elif running:
        culprit = running[0]
        head = (f"rank {culprit.rank} of {world} never reached the communication its peers were "
                f"waiting for: it was still running {_where(culprit)}"
                + (f" when rank {waited[0].rank} gave up after {group_timeout:g} s" if waited
                   else f" at the {deadline:g} s deadline"))
        kind = "deadline" if not waited else "deadlock"
    elif waited and returned:
        culprit = min(waited, key=_when)
        one = len(returned) == 1
        head = (f"rank {culprit.rank} of {world} gave up after {group_timeout:g} s in {_op(culprit)}, "
                f"waiting for {'rank' if one else 'ranks'} {_names(returned)}, which had already "
                f"returned: this call has no partner on {'that rank' if one else 'those ranks'}")
        kind = "deadlock"
    elif waited or stopped:
        stuck = sorted(failed + list(stopped), key=lambda r: r.rank)
        culprit = stuck[0]
        ops = ", ".join(f"rank {r.rank} in {_op(r)}" for r in stuck)
        head = (f"deadlock: ranks {_names(stuck)} of {world} were all waiting for each other "
                f"({ops}): each is blocked in a call that no peer matches")
        kind = "deadlock"
    else:  # only "connection closed" errors: a peer went away
        culprit = min(failed, key=_when)
        head = (f"rank {culprit.rank} of {world} lost its connection to a peer: "
                f"{culprit.report[2]}: {culprit.report[3]}")
        kind = "raised"
    body = [head, "", *_details(culprit)]
    for r in others(culprit):
        line = _one_line(r, stopped)
        if line:
            body.append(f"  rank {r.rank}: {line}")
    return LaunchError("\n".join(body).rstrip(), culprit.rank, kind,
                       ranks=[r.rank for r in failed + list(stopped)])


class _Reported:
    """A rank's failure as the rank reported it (dpcourse.comm.cases), in the shape of a launcher Rank."""

    def __init__(self, rank, type_name, message, traceback_text):
        self.rank, self.report = rank, ("error", 0.0, type_name, message, traceback_text)
        self.diag, self.output_tail, self.exit_status = b"", [], None


def reported_failure(world, failures, stopped=()):
    """The LaunchError for ranks whose code raised and that reported it instead of dying (the case
    runner's ranks, dpcourse.comm.cases), worded as `launch` words a rank that raised; the LOWEST
    failing rank is blamed, whatever the order the ranks failed in. failures: [(rank, exception type
    name, message, traceback text)]; stopped: ranks the launch stopped before they reported."""
    reported = sorted((_Reported(*f) for f in failures), key=lambda r: r.rank)
    culprit = reported[0]
    head = _headline(culprit, world) + _same_error_elsewhere(culprit, reported)
    body = [head, "", *_details(culprit)]
    for r in reported[1:]:
        body.append(f"  rank {r.rank}: {_one_line(r, ())}")
    body += [f"  rank {rank}: stopped when rank {culprit.rank} failed" for rank in stopped]
    return LaunchError("\n".join(body).rstrip(), culprit.rank, "raised",
                       ranks=[r.rank for r in reported] + list(stopped))


def _is_failure(r):
    if r.report is not None:
        return r.report[0] == "error"
    return r.exit_status is not None


def _kind(r):
    if r.report is None:
        return "exited"
    message = f"{r.report[2]}: {r.report[3]}"
    if VICTIM.search(message):
        return "victim"
    if WAITED.search(message) and r.report[2] in ("RuntimeError", "DistBackendError", "DistError"):
        return "waited"
    return "raised"


def _same_error_elsewhere(culprit, genuine):
    same = [r for r in genuine if r is not culprit and r.report and culprit.report
            and r.report[2:4] == culprit.report[2:4]]
    hint = ""
    if culprit.report and culprit.report[2] == "NotImplementedError":
        hint = " -- not written yet: replace `raise NotImplementedError()` with your code"
    return (f" (so did rank{'s' if len(same) > 1 else ''} {_names(sorted(same, key=lambda r: r.rank))})"
            if same else "") + hint


def _when(r):
    return r.report[1] if r.report else r.exit_time


def _headline(r, world):
    if r.report:
        return f"rank {r.rank} of {world} raised {r.report[2]}: {r.report[3]}"
    status = r.exit_status
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        hint = "" if sig != signal.SIGKILL else (
            " -- a SIGKILL comes from outside the rank, most often for using too much memory (Linux's "
            "out-of-memory killer, or the memory limit of a graded notebook)")
        if any(SIZE_MISMATCH in line for line in r.output_tail or ()):
            hint = (" -- gloo received a message of another size than the buffer posted for it, and stopped "
                    "the process: the ranks' sizes do not match (for all_to_all_single, rank i's "
                    "output_split_sizes[j] must be rank j's input_split_sizes[i])")
        return f"rank {r.rank} of {world} was killed by signal {sig} ({signal.Signals(sig).name}){hint}"
    return (f"rank {r.rank} of {world} exited with code {os.WEXITSTATUS(status)} before returning "
            f"(os._exit, sys.exit in a C extension, or a crash)")


def _details(r):
    if r.report and r.report[4]:
        return [f"Traceback of rank {r.rank} (most recent call last):",
                *_trim_traceback(r.report[4]), ""]
    if r.diag:
        return [f"Where rank {r.rank} was (most recent call last):", *_stack_lines(r), ""]
    if r.output_tail:
        return [f"Last output of rank {r.rank}:", *("    " + t for t in r.output_tail[-10:]), ""]
    return []


def _one_line(r, stopped):
    if r in stopped:
        return f"stopped while running {_where(r)}"
    if r.report and r.report[0] == "error":
        return f"{r.report[2]}: {r.report[3].splitlines()[0] if r.report[3] else ''}" + (
            "  (a consequence of the failure above)" if _kind(r) == "victim" else "")
    if r.report is None and r.exit_status is not None:
        return _headline(r, 0).split(" of 0 ", 1)[1]
    return ""


def _op(r):
    """The torch.distributed call a rank was blocked in, from its traceback or its stack."""
    if r.report:
        calls = re.findall(r'torch/distributed/distributed_c10d\.py", line \d+, in (\w+)', r.report[4])
    else:
        # the stack is innermost first: its first frame in distributed_c10d.py is the call
        calls = [f["func"] for f in _stack(r) if f["path"].endswith("distributed_c10d.py")][:1]
    return calls[-1] if calls else "a wait"


def _names(rs):
    names = [str(r.rank) for r in rs]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def _trim_traceback(text):
    """Drop the launcher's frames, the hidden checks' (grader-side) frames and torch's decorators: the
    learner's code is what matters, and hidden test code must not show in feedback. The frames left
    name files as the learner knows them: `torch/distributed/distributed_c10d.py`,
    `dpcourse/topics/sequence/runs.py`, never the machine's absolute paths (a rank's text: shown, not
    opened)."""
    out, skipping = [], False
    for line in text.rstrip().splitlines():
        if line.startswith("  File "):
            skipping = any(p in line for p in ("dpcourse/runtime/inside_rank.py",
                                                "dpcourse/grading/",  # the grader's, not in a notebook
                                                "dpcourse/runtime/launcher.py", "dpcourse/checks/ranks.py",
                                                "dpcourse/comm/cases.py", "dpcourse/comm/p2p.py",
                                                "torch/distributed/c10d_logger.py", "torch/_compile.py",
                                                "torch/_dynamo/eval_frame.py", "dpgrader/"))
            line = FILE_LINE.sub(lambda m: f'  File "{relative(m[1])}"', line)
        elif not line.startswith("    "):
            skipping = False
        if not skipping and not line.startswith("Traceback (most recent call last)"):
            out.append(line)
    return _with_cell_lines(out)


FILE_LINE = re.compile(r'^  File "([^"]+)"')


def relative(path):
    """A file as a learner knows it: torch's and other packages' from their package (site-packages/...
    dropped), the course's from `dpcourse/`, the standard library's from its folder; any other path, and
    a learner's cell (`<cell 3>`), as it is."""
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    if "/dpcourse/" in path:
        return path[path.rindex("/dpcourse/") + 1:]
    stdlib = sysconfig.get_paths()["stdlib"].rstrip("/") + "/"
    return path[len(stdlib):] if path.startswith(stdlib) else path


CELL_FRAME = re.compile(r'^  File "(?P<path><cell \d+>)", line (?P<line>\d+)')


def _with_cell_lines(lines):
    """A traceback's frames in the learner's cells (`<cell N>`) with their line of code, which the
    rank could not print (the cells are not files); `_source` gives it (the grader's from the notebook)."""
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        frame = CELL_FRAME.match(line)
        if frame and not (i + 1 < len(lines) and lines[i + 1].startswith("    ")):
            text = (_source(frame["path"], frame["line"]) or "").strip()
            if text:
                out.append(f"    {text}")
    return out


STACK_FRAMES = 30  # innermost frames of a stuck rank shown (its dump is text the rank wrote)
BOTTOM_FILES = ("dpcourse/runtime/inside_rank.py", "dpcourse/grading/zygote.py")  # where a rank starts
FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _stack(r):
    """The frames of the rank's main thread, innermost first, above the launcher's own."""
    sections = re.split(r"\n(?=(?:Current thread|Thread) 0x)", r.diag.decode(errors="replace"))
    for section in sections:
        frames = [m.groupdict() for m in FRAME.finditer(section)]
        for i, f in enumerate(frames):
            if f["path"].endswith(BOTTOM_FILES):
                return frames[:i]
    return []


def _in_user_code(frames):
    """True if the stack holds a frame of the function being run (not only library frames):
    a rank caught while formatting its own error report is not "running"."""
    stdlib = sysconfig.get_paths()["stdlib"]
    return any(not (f["path"].startswith(("<frozen", stdlib)) or "site-packages" in f["path"]
                    or "/dpcourse/" in f["path"]) for f in frames)


def blocked_in_communication(r):
    """True when a rank's stack dump shows it waiting in a communication call (the launcher stops waiting
    for its report once a peer has failed)."""
    frames = _stack(r)
    return bool(frames) and _in_communication(frames)


def _in_communication(frames):
    for f in frames:
        if "torch/distributed/" in f["path"] or "dpcourse/grading/routed.py" in f["path"]:
            return True
        if re.search(r"\.wait\(|\bbarrier\(", _source(f["path"], f["line"]) or ""):
            return True
    return False


def _where(r):
    frames = _stack(r)
    if not frames:
        return "(its stack could not be read)"
    inner = frames[0]
    user = next((f for f in frames if "site-packages" not in f["path"]), inner)
    text = f"in {inner['func']} ({_short(inner['path'])}:{inner['line']})"
    if user is not inner:
        text += f", called from {user['func']} ({_short(user['path'])}:{user['line']})"
    return text


def _stack_lines(r):
    lines = []
    for f in reversed(_stack(r)):
        lines.append(f'  File "{relative(f["path"])}", line {f["line"]}, in {f["func"]}')
        source = (_source(f["path"], f["line"]) or "").strip()
        if source:
            lines.append(f"    {source}")
    return lines[-2 * STACK_FRAMES:]


def _short(path):
    return relative(path)
