"""The class report: where a class stands after grading, on one page.

    python autograder/class_report.py    # `make report`, after `make autograde`: autograder/class_report.html
                                         # (open it in the formgrader's JupyterLab: autograder/ of the course)

Per exercise (autograder/exercises.json: its test cells and points), in course order: the class's score
distribution as a small histogram, and its most common failures grouped by cause, each with how many
students it stopped. Per student: where they stopped (the first exercise, in course order, of what they
submitted that does not score full points, and why), or that everything they submitted passes. And the
grading itself: how many submissions were judged, the judge's time per submission, and which
submissions were not graded, with the reason.

What it is written from: the gradebook (nbgrader's scores per test cell, the class list, who submitted
what) and the judge's verdicts, kept by `make autograde` in autograder/class_record.json (`record_run`:
each run adds or replaces the verdicts of the submissions it judged, so a later `make autograde
STUDENT=...` keeps everyone else's). Never from a submission's own output: a notebook's cells and their
outputs are what its author wrote, and could say anything. The judge's messages may quote what a
learner's code raised or returned; they are escaped, and cut at MESSAGE_CHARS.
"""

import collections
import datetime
import html
import json
import os
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RECORD = "class_record.json"
REPORT = "class_report.html"
MESSAGE_CHARS = 300
TOP_CAUSES = 5


def course_root():
    return Path(os.environ.get("DPCOURSE_COURSE_ROOT", REPO))


def gradebook_url(root):
    return os.environ.get("DPCOURSE_DB_URL") or f"sqlite:///{root / 'autograder' / 'gradebook.db'}"


# ---- what `make autograde` keeps for the report ------------------------------------------------------

def record_run(root, subs, results, verdicts_dir):
    """Keep, in autograder/class_record.json, what this grading run found of each submission it judged:
    the judge's verdict on each test cell (passed, its message, seconds), or why it was not graded.
    Called by autograde.py once its run is over; entries of submissions not judged this time stay."""
    from dpgrader.judge.process import verdicts_path

    path = Path(root) / "autograder" / RECORD
    record = load_record(root)
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for student, assignment, notebook in subs:
        result = results.get((student, assignment), {})
        entry = {"notebook": notebook.stem, "judged_at": when}
        if result.get("error"):
            entry["error"] = str(result["error"]).strip()[:2000]
        else:
            try:
                saved = verdicts_path(verdicts_dir, student, assignment, notebook.stem)
                verdicts = json.loads(saved.read_text())
            except (OSError, ValueError):
                verdicts = {}
            entry["cells"] = {grade_id: {"passed": bool(v.get("passed")),
                                         "message": message_of(v), "seconds": v.get("seconds")}
                              for grade_id, v in verdicts.items()
                              if not grade_id.startswith("_") and isinstance(v, dict)}
            entry["limits_reached"] = verdicts.get("_limits_reached") or {}
        record["submissions"][f"{student}/{assignment}"] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record, indent=1, sort_keys=True))
    temporary.replace(path)


def message_of(verdict):
    if verdict.get("passed"):
        return "passed"
    return f"{verdict.get('ename')}: {verdict.get('evalue')}".strip()[:2000]


def load_record(root):
    try:
        record = json.loads((Path(root) / "autograder" / RECORD).read_text())
    except (OSError, ValueError):
        record = {}
    record.setdefault("submissions", {})
    return record


# ---- grouping failures by cause -----------------------------------------------------------------------

NUMBER = re.compile(r"(?<![A-Za-z_])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
TENSOR = re.compile(r"tensor\(\[.*?\](?:, [^)]*)?\)", re.S)
ALSO = re.compile(r"\s*\(so did [^)]*\)")


def cause_of(message):
    """What a failure message says with its particulars taken out (which rank, which values, which
    tensor): the same mistake made by two students reads the same. Its first line only."""
    line = (message or "").strip().splitlines()[0] if (message or "").strip() else "(no message)"
    line = ALSO.sub("", line)
    line = TENSOR.sub("tensor(…)", line)
    line = NUMBER.sub("#", line)
    return re.sub(r"\s+", " ", line).strip()[:MESSAGE_CHARS]


# ---- the class, from the gradebook and the record -----------------------------------------------------

def exercises():
    """[(assignment, key, tests, kind)] in course order, from autograder/exercises.json."""
    index = json.loads((HERE / "exercises.json").read_text())
    return [(e["assignment"], e["solution"], e["tests"] or [e["solution"]], e["kind"]) for e in index]


def failed_messages(record, student, assignment, tests):
    """The judge's messages on the failed cells among `tests` of a submission, in the cells' order."""
    verdicts = record["submissions"].get(f"{student}/{assignment}", {}).get("cells", {})
    return [verdicts[t]["message"] for t in tests if t in verdicts and not verdicts[t]["passed"]]


def gather(root):
    """Everything the report shows, as plain data (the test reads it; render() draws it)."""
    from nbgrader.api import Gradebook, MissingEntry

    record = load_record(root)
    known = exercises()
    scores = collections.defaultdict(dict)  # (assignment, key) -> {student: (points, max)}
    submitted, cell_scores = {}, {}
    with Gradebook(gradebook_url(root)) as gb:
        students = sorted(s.id for s in gb.students)
        assignments = {a.name for a in gb.assignments}
        for assignment in sorted(assignments):
            for student in students:
                try:
                    submission = gb.find_submission(assignment, student)
                except MissingEntry:  # never submitted (nbgrader's CSV shows 0)
                    continue
                submitted[(student, assignment)] = submission.timestamp
                for notebook in submission.notebooks:
                    for grade in notebook.grades:
                        cell_scores[(student, assignment, grade.name)] = (grade.score or 0.0, grade.max_score)
    for assignment, key, tests, _ in known:
        if assignment not in assignments:
            continue
        for student in students:
            if (student, assignment) not in submitted:
                continue
            cells = [cell_scores.get((student, assignment, t)) for t in tests]
            if any(c is None for c in cells):
                continue
            scores[(assignment, key)][student] = (sum(c[0] for c in cells), sum(c[1] for c in cells))

    failures = collections.defaultdict(collections.Counter)  # (assignment, key) -> Counter(cause)
    examples, students_with = {}, collections.defaultdict(set)
    for assignment, key, tests, _ in known:
        for student, (points, most) in scores[(assignment, key)].items():
            if points >= most:
                continue
            failed = failed_messages(record, student, assignment, tests)
            cause = cause_of(failed[0]) if failed else "(lost points; no verdict recorded: graded before "
            "`make autograde` kept its verdicts, or marked by hand)"
            failures[(assignment, key)][cause] += 1
            students_with[(assignment, key, cause)].add(student)
            example = failed[0].strip().splitlines()[0] if failed and failed[0].strip() else cause
            examples.setdefault((assignment, key, cause), example[:MESSAGE_CHARS])

    stopped = {}
    order = [(a, k) for a, k, _, _ in known if a in assignments]
    for student in students:
        done = [a for a in sorted(assignments) if (student, a) in submitted]
        if not done:
            stopped[student] = {"where": None, "why": "has not submitted anything"}
            continue
        for assignment, key in order:
            if assignment not in done or student not in scores[(assignment, key)]:
                continue
            points, most = scores[(assignment, key)][student]
            if points < most:
                tests = next(t for a, k, t, _ in known if (a, k) == (assignment, key))
                failed = failed_messages(record, student, assignment, tests)
                why = failed[0].splitlines()[0][:MESSAGE_CHARS] if failed else "lost points"
                stopped[student] = {"where": f"{assignment} / {key}", "points": points, "max": most,
                                    "why": why}
                break
        else:
            stopped[student] = {"where": None,
                                "why": f"every exercise of what they submitted passes ({', '.join(done)})"}

    judged = {k: v for k, v in record["submissions"].items() if "cells" in v}
    times = [sum(c.get("seconds") or 0 for c in v["cells"].values()) for v in judged.values()]
    not_graded = {k: v["error"].splitlines()[0][:MESSAGE_CHARS]
                  for k, v in record["submissions"].items() if v.get("error")}
    collected = {(p.parent.parent.name, p.parent.name) for p in (Path(root) / "autograder" / "submitted")
                 .glob("*/*/*.ipynb")}
    for student, assignment in sorted(collected - set(submitted)):
        not_graded.setdefault(f"{student}/{assignment}",
                              "collected, not in the gradebook: run `make autograde`")
    limits = {k: v["limits_reached"] for k, v in judged.items()
              if any((v.get("limits_reached") or {}).values())}
    return {"students": students, "assignments": sorted(assignments), "order": order, "scores": scores,
            "failures": failures, "examples": examples, "students_with": students_with, "stopped": stopped,
            "judged": len(judged), "times": times, "not_graded": not_graded, "limits": limits,
            "submitted": submitted}


# ---- the page ---------------------------------------------------------------------------------------

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1100px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
.summary span { display: inline-block; margin-right: 22px; } .summary b { font-size: 18px; }
table { border-collapse: collapse; width: 100%; } td, th { padding: 5px 8px; border-bottom: 1px solid #ddd;
vertical-align: top; text-align: left; } th { background: #f4f4f4; font-weight: 600; }
.cause { font-family: ui-monospace, monospace; font-size: 12px; } .count { font-weight: 600; width: 40px; }
.muted { color: #777; } .bad { color: #a40000; }
"""


def histogram(values, most, width=160, height=56):
    """An inline SVG: how many students scored each value from 0 to `most` (at most 12 bars)."""
    steps = max(1, min(12, int(round(most)) if float(most).is_integer() else int(most * 2)))
    size = most / steps if steps else 1
    counts = [0] * (steps + 1)
    for value in values:
        counts[min(steps, int(round(value / size)) if size else 0)] += 1
    top = max(counts) or 1
    bar = width / len(counts)
    rects = []
    for i, n in enumerate(counts):
        h = (height - 24) * n / top  # 12 px for the axis below, 12 for the count above
        colour = "#2e7d32" if i == steps else "#c62828" if i == 0 else "#f9a825"
        label = f"{i * size:g}: {n} student(s)"
        rects.append(f'<rect x="{i * bar + 1:.1f}" y="{height - 12 - h:.1f}" width="{bar - 2:.1f}" '
                     f'height="{h:.1f}" fill="{colour}"><title>{label}</title></rect>')
        if n:
            rects.append(f'<text x="{(i + 0.5) * bar:.1f}" y="{height - 14 - h - 1:.1f}" font-size="9" '
                         f'text-anchor="middle">{n}</text>')
    axis = (f'<text x="0" y="{height - 1}" font-size="9">0</text>'
            f'<text x="{width}" y="{height - 1}" font-size="9" text-anchor="end">{most:g}</text>')
    return (f'<svg width="{width}" height="{height}" role="img" aria-label="scores">{"".join(rects)}'
            f'{axis}</svg>')


def cause_line(data, assignment, key, cause, count):
    """One cause of failure: how many students, one of their messages; the students' names on hover."""
    who = ", ".join(sorted(data["students_with"][(assignment, key, cause)]))
    example = data["examples"][(assignment, key, cause)]
    return (f"<div><span class='count'>{count}</span> <span class='cause' title='{html.escape(who)}'>"
            f"{html.escape(example)}</span></div>")


def render(data, root):
    e = html.escape
    times = data["times"]
    median = f"{statistics.median(times):.1f} s" if times else "–"
    slowest = f"{max(times):.1f} s" if times else "–"
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>Class report</title>"
           f"<style>{STYLE}</style></head><body>",
           f"<h1>Class report</h1><p class='muted'>{e(str(root))} · written "
           f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} from the gradebook and the judge's "
           f"verdicts</p>",
           "<p class='summary'>"
           f"<span><b>{len(data['students'])}</b> students</span>"
           f"<span><b>{len(data['submitted'])}</b> submissions in the gradebook</span>"
           f"<span><b>{data['judged']}</b> judged</span>"
           f"<span>judge time per submission: <b>{median}</b> median, {slowest} at most</span>"
           f"<span class='{'bad' if data['not_graded'] else ''}'><b>{len(data['not_graded'])}</b> not graded"
           f"</span></p>"]
    if data["not_graded"] or data["limits"]:
        out.append("<h2>Not graded, or stopped at their limits</h2><table><tr><th>submission</th><th>why"
                   "</th></tr>")
        for key, why in sorted(data["not_graded"].items()):
            out.append(f"<tr><td>{e(key)}</td><td class='cause bad'>not graded: {e(why)}</td></tr>")
        for key, reached in sorted(data["limits"].items()):
            said = ", ".join(f"its {k} limit, {n} times" for k, n in reached.items() if n)
            out.append(f"<tr><td>{e(key)}</td><td class='cause'>graded; its processes reached {e(said)}"
                       f"</td></tr>")
        out.append("</table>")
    out.append("<h2>Exercises</h2><table><tr><th>exercise</th><th>scores</th><th>full marks</th>"
               "<th>most common failures (students)</th></tr>")
    for assignment, key in data["order"]:
        graded = data["scores"][(assignment, key)]
        if not graded:
            continue
        most = max(m for _, m in graded.values())
        full = sum(1 for p, m in graded.values() if p >= m)
        listed = "".join(cause_line(data, assignment, key, cause, n)
                         for cause, n in data["failures"][(assignment, key)].most_common(TOP_CAUSES))
        out.append(f"<tr><td><b>{e(key)}</b><br><span class='muted'>{e(assignment)}</span></td>"
                   f"<td>{histogram([p for p, _ in graded.values()], most)}</td>"
                   f"<td>{full} of {len(graded)}</td><td>{listed or 'none'}</td></tr>")
    out.append("</table><h2>Students: where each stopped</h2><table><tr><th>student</th><th>stopped at</th>"
               "<th>why</th></tr>")
    for student in data["students"]:
        where = data["stopped"][student]
        place = (f"{e(where['where'])} ({where['points']:g} of {where['max']:g})" if where["where"]
                 else "<span class='muted'>–</span>")
        out.append(f"<tr><td>{e(student)}</td><td>{place}</td><td class='cause'>{e(where['why'])}</td></tr>")
    out.append("</table></body></html>")
    return "\n".join(out)


def main(argv=None):
    root = course_root()
    if not (root / "autograder" / "gradebook.db").exists() and not os.environ.get("DPCOURSE_DB_URL"):
        print(f"no gradebook in {root / 'autograder'}: run `make autograde` first", file=sys.stderr)
        return 1
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    data = gather(root)
    target = root / "autograder" / REPORT
    target.write_text(render(data, root))
    print(f"class report: {target} ({len(data['students'])} students, {data['judged']} submissions "
          f"judged, {len(data['not_graded'])} not graded); open it in JupyterLab (autograder/{REPORT})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
