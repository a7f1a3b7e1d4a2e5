"""Judge a pipeline step: the same loss and gradients as one process, the right messages, the memory it held.

    calls = run_pipeline(gpipe_step, case, exercise="gpipe_step")
    expect_pipeline_step(calls, case, "gpipe_step on 3 stages, 4 micro-batches")
    expect_pipeline_traffic(calls, case, "gpipe_step on 3 stages, 4 micro-batches")
    expect_held(calls, case, "gpipe_step", [4, 4, 4])
    expect_order(calls, case, "gpipe_step", [[("F", 0), ..., ("B", 3)]] * 3)
    expect_released(calls, case, "run_schedule")      # nothing of a finished micro-batch kept
    expect_schedule(one_f_one_b(2, 3, 0), parse_order("F0 F1 B0 F2 B1 B2"), "one_f_one_b(2, 3, 0)")

Why these: splitting a model over stages and streaming micro-batches changes where
each layer runs and in which order, never the arithmetic. So the yardstick is one process
running the whole model on the whole batch, in float64 (differences ~1e-16, where a missing
1/m or a gradient applied to the wrong micro-batch is off by far more). Messages are what
define a pipeline -- one activation forward and one gradient back per micro-batch and
neighbour, nothing to anyone else -- and are judged from the recorder's records. Memory is
what tells GPipe (m micro-batches held) from 1F1B (at most p - s), and is judged from what
autograd really kept, and what the stage's code kept of a finished micro-batch (runner.StageWatch).

Every message names the stage, its rank, and where it can the micro-batch. Used by
notebooks 07 and 09 and by the hidden checks of notebook 07.

Trust: gradients and losses are values the ranks return, and while grading the messages are
counted by the grader's router, outside the ranks. The timeline and the activations held are
observed by hooks inside the learner's process, so code written against the checker could
forge them (README, "What grading trusts"); they catch honest mistakes, not forgery.
"""

from dpcourse.checks.core import TOLERANCES, describe, number, ratio_hint
from dpcourse.topics.pipeline.runner import by_stage, message_kind
from dpcourse.topics.pipeline.schedules import format_order

ATOL, RTOL = TOLERANCES["float64 exact"]  # a correct pipeline is off by ~1e-16


def reference_step(case):
    """(loss, {name: gradient or None}) of one process running the whole model on the whole batch."""
    model = case.make_model()
    model.zero_grad(set_to_none=True)
    loss = case.loss_fn(model(case.batch), case.targets)
    loss.backward()
    return loss.item(), {name: None if p.grad is None else p.grad.detach().clone()
                         for name, p in model.named_parameters()}


def _who(case, rank):
    return f"stage {case.stage_of(rank)} (rank {rank})"


def _scale_hint(case, got, expected):
    """A sentence when the result is m (or 1/m) times the expected one: the loss / m rule."""
    m = case.micro
    if m <= 1 or abs(expected) < 1e-300:
        return ""
    ratio = got / expected
    if abs(ratio - m) < 1e-6 * m:
        return f" ({m}x the expected value: divide each micro-batch's loss by m = {m} before its backward)"
    if abs(ratio - 1 / m) < 1e-6:
        return f" (1/{m} of the expected value: divide each micro-batch's loss by m = {m} once, not twice)"
    return ""


def expect_pipeline_step(calls, case, what):
    """The last stage returns the loss of the whole batch, and every stage holds its parameters'
    gradients of that loss, as one process computing everything (float64, tight tolerance)."""
    loss, grads = reference_step(case)
    staged = by_stage(calls, case)
    last = staged[-1]
    result = last.result
    try:
        got = float(result)
    except (TypeError, ValueError, RuntimeError):
        raise AssertionError(f"{what}: {_who(case, last.rank)} returned {describe(result)[:120]}: the "
                             f"last stage must return the loss of the step (a number)") from None
    if abs(got - loss) > ATOL + RTOL * abs(loss):
        raise AssertionError(f"{what}: {_who(case, last.rank)} returned the loss {number(got)}, expected "
                             f"{number(loss)} (the mean over the whole batch){_scale_hint(case, got, loss)}")
    for call in staged[:-1]:
        if call.result is not None:
            raise AssertionError(f"{what}: {_who(case, call.rank)} returned {describe(call.result)[:120]}: "
                                 f"every stage but the last must return None (only the last stage "
                                 f"computes the loss)")
    for call in staged:
        for name, g in call.observed["grads"].items():
            expected = grads[name]
            where = f"{what}: {_who(case, call.rank)}: the gradient of {name}"
            if g is None and expected is not None:
                raise AssertionError(f"{where} is None: no backward reached this stage's layers (did the "
                                     f"gradient from the next stage arrive, and did the received activation "
                                     f"get requires_grad_() so the previous stage gets its gradient?)")
            if g is None:
                continue
            if g.shape != expected.shape or not (g.double() - expected).abs().le(
                    ATOL + RTOL * expected.abs()).all():
                hint = ratio_hint(g, expected) if g.shape == expected.shape else ""
                ratio = hint and float((g.double().flatten() @ expected.flatten())
                                       / (expected.flatten() @ expected.flatten()))
                scale = _scale_hint(case, ratio, 1.0) if hint else ""
                raise AssertionError(f"{where} is {describe(g)}, expected {describe(expected)}"
                                     f"{scale or hint}: it should equal the single-process gradient")


def expected_messages(case, stage_index):
    """{(op, kind): (count, bytes each)} this stage must send and receive in one step."""
    m, rows, widths = case.micro, case.rows, case.widths
    size = case.batch.element_size()
    out = {}
    if stage_index < case.n_stages - 1:
        nbytes = rows * widths[stage_index + 1] * size
        out[("send", "activation")] = (m, nbytes)
        out[("recv", "gradient")] = (m, nbytes)
    if stage_index > 0:
        nbytes = rows * widths[stage_index] * size
        out[("recv", "activation")] = (m, nbytes)
        out[("send", "gradient")] = (m, nbytes)
    return out


def expect_pipeline_traffic(calls, case, what):
    """Each stage talks only to its neighbours: one activation forward and one gradient back per
    micro-batch and neighbour, each exactly one micro-batch's rows, and nothing else."""
    m = case.micro
    for index, call in enumerate(by_stage(calls, case)):
        who = f"{what}: {_who(case, call.rank)}"
        prev = f"rank {case.ranks[index - 1]}" if index > 0 else None
        nxt = f"rank {case.ranks[index + 1]}" if index < case.n_stages - 1 else None
        neighbours = " and ".join(n for n in (prev, nxt) if n) or "nobody"
        seen = {}
        for op in call.ops:
            if op.op not in ("send", "recv"):
                raise AssertionError(f"{who} called {op.op}: a pipeline stage only sends and receives")
            kind = message_kind(case, index, op)
            if kind is None:
                peer = op.world_peer
                stage = f"stage {case.stage_of(peer)}" if peer in case.ranks else "no stage"
                direction = "to" if op.op == "send" else "from"
                raise AssertionError(f"{who} called {op.op} {direction} rank {peer} ({stage}): a stage talks "
                                     f"only to its neighbours, here {neighbours}")
            seen.setdefault((op.op, kind), []).append(op.nbytes)
        for (op, kind), (count, nbytes) in expected_messages(case, index).items():
            sizes = seen.pop((op, kind), [])
            peer = case.ranks[index + 1] if (op, kind) in (("send", "activation"), ("recv", "gradient")) \
                else case.ranks[index - 1]
            verb = {"send": "sent", "recv": "received"}[op]
            direction = "to" if op == "send" else "from"
            width = nbytes // case.rows // case.batch.element_size()
            per = f"one {kind} per micro-batch, {case.rows} row(s) x {width} values = {nbytes} bytes each"
            if len(sizes) != count:
                raise AssertionError(f"{who} {verb} {len(sizes)} {kind}(s) {direction} stage "
                                     f"{case.stage_of(peer)}, expected {count} ({per}; m = {m})")
            wrong = [(k, s) for k, s in enumerate(sizes) if s != nbytes]
            if wrong:
                k, s = wrong[0]
                raise AssertionError(f"{who}: its {kind} message {k + 1} {direction} stage "
                                     f"{case.stage_of(peer)} (micro-batch {k}) was {s} bytes, expected "
                                     f"{nbytes} ({per})")
        if seen:
            (op, kind), sizes = next(iter(seen.items()))
            raise AssertionError(f"{who} should not {op} any {kind}: it did {len(sizes)} time(s)")


def expect_held(calls, case, what, expected, at_most=False, rule=""):
    """Each stage's peak number of micro-batches with activations alive equals (or is at most)
    expected[stage]; `rule` explains the expected number in the message."""
    for index, call in enumerate(by_stage(calls, case)):
        got = call.observed["peak_held"]
        want = expected[index]
        if (got > want) if at_most else (got != want):
            bound = "at most " if at_most else ""
            raise AssertionError(f"{what}: {_who(case, call.rank)} held the activations of {got} "
                                 f"micro-batch(es) at once, expected {bound}{want}{rule}")


def first_difference(got, want):
    """'step 4 is B2 where B0 was expected': where two orders of ("F", i) / ("B", i) part ways."""
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                 min(len(got), len(want)))
    return (f"step {first + 1} is {format_order(got[first:first + 1]) or 'missing'} where "
            f"{format_order(want[first:first + 1]) or 'nothing'} was expected")


def expect_order(calls, case, what, expected, rule=""):
    """Each stage ran its forwards and backwards in exactly the order expected[stage]."""
    for index, call in enumerate(by_stage(calls, case)):
        got = [(kind, k) for kind, k, *_ in call.observed["events"]]
        want = [tuple(action) for action in expected[index]]
        if got != want:
            raise AssertionError(f"{what}: {_who(case, call.rank)} ran {format_order(got)}, expected "
                                 f"{format_order(want)}: {first_difference(got, want)}{rule}")


def expect_schedule(got, expected, call, rule=""):
    """A schedule function's result (a list of ("F", i) / ("B", i)) equals `expected`; the message
    writes both the way the text does (F0 F1 B0 ...) and points at the first difference."""
    actions = None
    if isinstance(got, (list, tuple)):
        try:
            actions = [(kind, int(i)) for kind, i in got]
        except (TypeError, ValueError):
            actions = None
    if actions is None or any(kind not in ("F", "B") for kind, _ in actions) or any(
            not isinstance(i, int) or isinstance(i, bool) for _, i in got):
        raise AssertionError(f"{call} returned {describe(got)[:200]}: expected a list of (\"F\", i) and "
                             f"(\"B\", i) pairs, e.g. [(\"F\", 0), (\"B\", 0)]")
    want = [tuple(action) for action in expected]
    if actions != want:
        raise AssertionError(f"{call} returned {format_order(actions)}, expected {format_order(want)}: "
                             f"{first_difference(actions, want)}{rule}")


def expect_released(calls, case, what, rule=""):
    """Once a micro-batch's backward has run, the stage keeps neither its input nor its output: when the
    next backward starts, their memory is gone (runner.StageWatch follows each storage)."""
    for call in by_stage(calls, case):
        lingering = call.observed.get("lingering") or []
        if not lingering:
            continue
        at, j, alive, named = lingering[0]
        kept = " and its ".join(alive)
        if named:
            cause = (f"your code still refers to its {' and '.join(named)} tensor: remove a micro-batch's "
                     f"entries once its backward has run (inputs.pop(i), outputs.pop(i))")
        else:
            cause = ("no name of yours holds it, but something shares its memory: the request of a "
                     "dist.isend not waited for yet keeps the tensor it sends (wait for a send before "
                     "you post the next one in the same direction), as does a .detach() kept aside")
        raise AssertionError(f"{what}: {_who(case, call.rank)}: when the backward of micro-batch {at} "
                             f"started, micro-batch {j}, whose backward had already run, still had its "
                             f"{kept} alive -- {cause}{rule}")
