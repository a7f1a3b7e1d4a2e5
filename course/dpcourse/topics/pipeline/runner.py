"""Run a pipeline step on ranks (one stage per rank), point-to-point only, and watch what each stage did.

    case = PipelineCase(partial(layer_stack, [8, 16, 16, 2]), cuts=[0, 2, 5], batch=X, targets=Y,
                        n_micro=4)
    calls = run_pipeline(gpipe_step, case, exercise="gpipe_step")
    calls[r].result                      # what rank r's step returned (the loss on the last stage)
    calls[r].ops                         # its send/recv calls: peer, bytes, time
    calls[r].observed["grads"]           # its stage's parameter gradients, by the whole model's names
    calls[r].observed["events"]          # [("F", 0, start, end), ..., ("B", 0, start, end), ...]
    calls[r].observed["peak_held"]       # most micro-batches whose activations it held at once

Every rank builds the same model from `make_model`, keeps its stage (`make_stage`) and calls
`step(stage, batch, targets, loss_fn, *extra)`, where extra is (n_micro,) for GPipe-like
steps, (this stage's schedule,) when the case has a schedule, and nothing otherwise. It runs
under the recorder of notebooks 03-04 with p2p_only (a collective, or the process-group
bypass, is refused) and a 3 s receive timeout; the case runner (`dpcourse.comm.cases`) does the
launching and the deadlock diagnosis, and `describe_stage` words it in pipeline terms. Each rank
is sent its own stage's part of the case only (`PipelineCase.for_rank`).

How a stage is watched (StageWatch), so the learner's code needs no instrumenting:
  * forward of micro-batch k: a forward pre-hook and hook on the stage module (the k-th call
    of `stage.module(...)` is micro-batch k);
  * backward of micro-batch k: starts when the gradient of that forward's output arrives (a
    tensor hook on the output), ends with the last gradient it produces (a hook on the
    input, if it requires grad, and post-accumulate hooks on the parameters);
  * activations held: autograd's saved-tensor hooks see every tensor a forward keeps for
    its backward, and a weakref sees it freed when that backward is done (or the graph
    dropped). A micro-batch is "held" while any of its saved tensors is alive. This counts
    what autograd really keeps, so it cannot be lowered by anything short of really
    freeing the graph (by running the backward, or by not building it).
  * kept after its backward: autograd frees what it saved, but the stage's code may keep a
    micro-batch's input and output alive on its own (a dict entry never removed, the request
    of an isend never waited for, a detached copy). The watch follows the *memory* of each
    micro-batch's input (on every stage but the first, whose input is the batch the caller
    keeps anyway, however the stage slices or copies it) and of its output: a weak reference
    to the tensor's storage, which lives as long as any tensor, view, detached alias or
    pending send uses that memory. When a backward starts, every micro-batch whose backward
    already ran must have let go of both ("lingering" otherwise); a weak reference to the
    tensor object itself tells "your code still names it" from "something shares its
    memory". What it cannot see: copies into new memory (`.clone()`, `.tolist()`, numpy
    arrays made with a copy) -- a submission written to hide memory from the check can; an
    honest one that forgets a dict entry or a request cannot.
Which micro-batch a blocked message belongs to is inferred from the message count: stages
forward micro-batches in order 0, 1, ..., and run their backwards in order 0, 1, ... in
every schedule of notebook 07, so a stage's k-th message to (or from) a neighbour in one
direction is micro-batch k's.

Used by notebook 07 (pipeline parallelism) and notebook 09 (hybrid parallelism).
"""

import copy
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from dpcourse.backend import rank_device
from dpcourse.comm.cases import Case, run_cases
from dpcourse.comm.p2p import GROUP_TIMEOUT
from dpcourse.comm.recorder import PeerError
from dpcourse.topics.pipeline.stages import boundary_widths, check_cuts, make_stage
from dpcourse.toys.models import loss_fn as mse_loss


@dataclass
class PipelineCase:
    """One pipeline step to run: the model, where it is cut, the batch, and how it is scheduled.

    make_model: a picklable function returning the whole nn.Sequential (every rank builds it);
    n_micro: None for one batch (naive model parallelism), else the number of micro-batches;
    schedule: None, or this stage's ordered [("F", i), ("B", i), ...]: either a list with one
      schedule per stage, or a function schedule(n_stages, n_micro, stage_index);
    placement: the world rank of each stage (default: stage s on rank s);
    warmup: steps run (and forgotten: gradients zeroed, records restarted) before the recorded one,
      for timelines and timings without first-call costs; tests leave it at 0.
    """

    make_model: Callable
    cuts: list
    batch: torch.Tensor
    targets: torch.Tensor
    n_micro: int | None = None
    schedule: object = None
    placement: list | None = None
    loss_fn: Callable = mse_loss
    label: str = ""
    warmup: int = 0
    _widths: list | None = field(default=None, repr=False)

    @property
    def n_stages(self):
        return len(self.cuts) - 1

    @property
    def ranks(self):
        return list(range(self.n_stages)) if self.placement is None else list(self.placement)

    def stage_of(self, rank):
        return self.ranks.index(rank)

    @property
    def micro(self):
        """The number of micro-batches (1 for one batch)."""
        if self.n_micro is not None:
            return self.n_micro
        if isinstance(self.schedule, list):
            return sum(1 for kind, _ in self.schedule[0] if kind == "F")
        return 1

    @property
    def rows(self):
        """Rows of one micro-batch."""
        return len(self.batch) // self.micro

    @property
    def widths(self):
        """widths[s]: the width of the activation entering stage s (widths[-1]: the model's output)."""
        if self._widths is None:
            all_widths = boundary_widths(self.make_model())
            self._widths = [all_widths[c] for c in self.cuts]
        return self._widths

    def extra_args(self, stage_index):
        """What follows (stage, batch, targets, loss_fn) in the step's arguments."""
        if self.schedule is None:
            return () if self.n_micro is None else (self.n_micro,)
        if callable(self.schedule):
            return (self.schedule(self.n_stages, self.micro, stage_index),)
        return (list(self.schedule[stage_index]),)

    def for_rank(self, rank):
        """What rank `rank` is sent of this case while graded: the weights of its own stage only (every
        other stage's are zeros of the same shapes), the batch's values on the first stage and the
        targets' on the last (zeros of their shapes elsewhere: the other stages read only their row
        counts). A stage then learns what it needs from its neighbours' messages, as on a real cluster,
        and cannot compute another stage's part alone."""
        if rank not in self.ranks:
            return replace(self, make_model=partial(_given, None), batch=torch.zeros_like(self.batch),
                           targets=torch.zeros_like(self.targets), _widths=self.widths)
        index = self.stage_of(rank)
        model = self.make_model()
        with torch.no_grad():
            for position, layer in enumerate(model):
                if not self.cuts[index] <= position < self.cuts[index + 1]:
                    for parameter in layer.parameters():
                        parameter.zero_()
        first, last = index == 0, index == self.n_stages - 1
        return replace(self, make_model=partial(_given, model), _widths=self.widths,
                       batch=self.batch if first else torch.zeros_like(self.batch),
                       targets=self.targets if last else torch.zeros_like(self.targets))

    def validate(self):
        """Clear errors for cases that cannot run (caught before any rank starts)."""
        check_cuts(self.cuts, len(self.make_model()))
        ranks = self.ranks
        if len(ranks) != self.n_stages or len(set(ranks)) != len(ranks) or min(ranks) < 0:
            raise ValueError(f"placement {self.placement} must put the {self.n_stages} stages on "
                             f"{self.n_stages} different ranks")
        if len(self.batch) != len(self.targets):
            raise ValueError(f"batch has {len(self.batch)} rows, targets {len(self.targets)}")
        if self.micro < 1 or len(self.batch) % self.micro:
            raise ValueError(f"a batch of {len(self.batch)} rows does not split into {self.micro} equal "
                             f"micro-batches")
        if isinstance(self.schedule, list) and len(self.schedule) != self.n_stages:
            raise ValueError(f"schedule has {len(self.schedule)} stage lists for {self.n_stages} stages")
        return self


def _given(model):
    """A PipelineCase.for_rank model: a copy of the model it was given (each call builds afresh)."""
    return copy.deepcopy(model)


class StageWatch:
    """Inside a rank: when each forward and backward of a stage ran, and how many micro-batches it held.

    See the module docstring. Entered by the rank side of run_pipeline_cases around the step.
    """

    def __init__(self, stage, given=()):
        self.stage = stage
        self.events = []  # [kind, micro-batch, start, end]
        self.forwards = 0
        self.live = {}  # micro-batch -> its saved tensors still alive
        self.peak = 0
        # memory of the rank's own arguments (the batch, the targets): its slices are no activations
        self.given = {t.untyped_storage().data_ptr() for t in given if isinstance(t, torch.Tensor)}
        self.kept = {}  # (micro-batch, "input" / "output") -> storages of it still alive
        self.names = {}  # (micro-batch, "input" / "output") -> weak reference to the tensor object
        self.backwarded = set()  # micro-batches whose backward has started
        self.lingering = []  # [backward k, micro-batch j, kinds alive, kinds still named] per j, first seen
        self.generation = 0  # restart_watch starts a new one
        self.current_forward = None
        self.current_backward = None
        self.phase = "before its first forward"
        self.handles = []
        self.saved_hooks = None

    def __enter__(self):
        global _ACTIVE
        _ACTIVE = self
        module = self.stage.module
        self.handles = [module.register_forward_pre_hook(self._forward_starts),
                        module.register_forward_hook(self._forward_ends)]
        self.handles += [p.register_post_accumulate_grad_hook(self._parameter_done)
                         for p in module.parameters() if p.requires_grad]
        self.saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.saved_hooks.__enter__()
        return self

    def __exit__(self, *exc):
        global _ACTIVE
        _ACTIVE = None
        self.saved_hooks.__exit__(*exc)
        for handle in self.handles:
            handle.remove()
        return False

    # forward and backward times
    def _forward_starts(self, module, args):
        k = self.forwards
        self.forwards += 1
        self.current_forward = k
        self.phase = f"in the forward of micro-batch {k}"
        self.events.append(["F", k, time.perf_counter(), None])
        for x in args:
            if isinstance(x, torch.Tensor) and not self.stage.is_first:  # stage 0's input is the batch's
                self._follow(k, "input", x)
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(self._backward_progress(k))

    def _forward_ends(self, module, args, output):
        k = self.current_forward
        self.events[-1][3] = time.perf_counter()
        self.phase = f"after the forward of micro-batch {k}"
        if isinstance(output, torch.Tensor):
            self._follow(k, "output", output)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._backward_starts(k))

    # what a micro-batch keeps besides autograd's saved tensors (module docstring)
    def _follow(self, k, kind, tensor):
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in self.given or (k, kind) in self.names:
            return
        self.kept[(k, kind)] = self.kept.get((k, kind), 0) + 1
        weakref.finalize(storage, self._let_go, self.generation, k, kind)
        self.names[(k, kind)] = weakref.ref(tensor)

    def _let_go(self, generation, k, kind):
        if generation == self.generation:  # not a storage of a warm-up step, forgotten since
            self.kept[(k, kind)] -= 1

    def _check_lingering(self, k):
        """At the start of micro-batch k's backward: the finished micro-batches still alive."""
        reported = {j for _, j, _, _ in self.lingering}
        for j in sorted(self.backwarded - {k} - reported):
            alive = [kind for kind in ("input", "output") if self.kept.get((j, kind), 0) > 0]
            if alive:
                named = [kind for kind in alive if self.names[(j, kind)]() is not None]
                self.lingering.append([k, j, alive, named])
        self.backwarded.add(k)

    def _backward_starts(self, k):
        def hook(grad):
            self._check_lingering(k)
            self.current_backward = k
            self.phase = f"in the backward of micro-batch {k}"
            now = time.perf_counter()
            self.events.append(["B", k, now, now])
        return hook

    def _backward_progress(self, k):
        def hook(grad):
            self._backward_end(k)
        return hook

    def _parameter_done(self, parameter):
        if self.current_backward is not None:
            self._backward_end(self.current_backward)

    def _backward_end(self, k):
        for event in reversed(self.events):
            if event[0] == "B" and event[1] == k:
                event[3] = time.perf_counter()
                self.phase = f"after the backward of micro-batch {k}"
                return

    # activations held
    def _pack(self, tensor):
        k = self.current_forward
        holder = _Held(tensor)
        if k is not None:
            self.live[k] = self.live.get(k, 0) + 1
            weakref.finalize(holder, self._freed, k)
            self.peak = max(self.peak, self.held())
        return holder

    @staticmethod
    def _unpack(holder):
        return holder.tensor

    def _freed(self, k):
        self.live[k] -= 1

    def held(self):
        """How many micro-batches have saved tensors alive now."""
        return sum(1 for count in self.live.values() if count > 0)

    # reports
    def where(self):
        return f"stage {self.stage.index} {self.phase}"

    def hint(self, exc):
        """What a common failure means in pipeline terms."""
        text = str(exc)
        if "NoneType" in text and self.events and self.events[-1][0] == "B":
            return (" -- the input's .grad is None: a received activation must get requires_grad_() "
                    "before the forward, so that the backward computes the gradient to send back")
        if _raised_in_send_or_recv(exc):
            advice = ": name them by stage.prev and stage.next, not rank - 1 and rank + 1" \
                if isinstance(exc, PeerError) else ""
            return (f" -- stage {self.stage.index} runs on rank {self.stage.rank}; its neighbours are "
                    f"stage.prev = {self.stage.prev} and stage.next = {self.stage.next} (world ranks)"
                    f"{advice}")
        if "does not require grad" in text:
            return (" -- backward was called on a tensor with no graph: was the forward run under "
                    "torch.no_grad(), or the output detached before its backward?")
        return ""

    def observed(self):
        grads = {name: None if p.grad is None else p.grad.detach().clone()
                 for name, p in self.stage.module.named_parameters()}
        return dict(stage=self.stage.index, grads=grads, events=[tuple(e) for e in self.events],
                    peak_held=self.peak, held_at_end=self.held(), forwards=self.forwards,
                    lingering=[list(item) for item in self.lingering])


def _raised_in_send_or_recv(exc):
    """True when the exception came out of dist.send/recv/isend/irecv (a bad peer, a bad buffer)."""
    return any(frame.name in ("send", "recv", "isend", "irecv") and "distributed_c10d" in frame.filename
               for frame in traceback.extract_tb(exc.__traceback__))


_ACTIVE = None  # the StageWatch of the step running in this rank, if any


def restart_watch():
    """Forget what this rank's StageWatch and recorder saw so far (call between a warm-up step and the
    step to record). torch's schedules need it: their first step also exchanges shapes and votes."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from dpcourse.comm.recorder import CommRecorder

    if _ACTIVE is not None:
        _ACTIVE.events, _ACTIVE.forwards, _ACTIVE.live = [], 0, {}
        _ACTIVE.peak, _ACTIVE.current_forward, _ACTIVE.current_backward = 0, None, None
        _ACTIVE.kept, _ACTIVE.names, _ACTIVE.backwarded, _ACTIVE.lingering = {}, {}, set(), []
        _ACTIVE.generation += 1
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, CommRecorder):
            mode.ops.clear()


class _Held:
    """What autograd stores in place of a saved tensor while a StageWatch counts them."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def stage_case(step, pipeline, ctx):
    """Rank side (the case runner's per-case function): build this rank's stage from its own part of
    the case, run the step under a StageWatch, report what it returned."""
    index = pipeline.stage_of(ctx.rank)
    device = rank_device()
    stage = make_stage(pipeline.make_model(), pipeline.cuts, index, ranks=pipeline.ranks, device=device)
    args = (stage, pipeline.batch.to(device).clone(), pipeline.targets.to(device).clone(),
            pipeline.loss_fn, *pipeline.extra_args(index))
    watch = StageWatch(stage, given=args[1:3])
    ctx.observe, ctx.where, ctx.hint, ctx.not_written = watch.observed, watch.where, watch.hint, ctx.exercise
    with watch:
        result = _after_warmup(step, pipeline.warmup, *args) if pipeline.warmup else step(*args)
    return {"result": result}


def _after_warmup(step, warmup, stage, *args):
    """Run `warmup` steps and forget them, then the step that is recorded."""
    for _ in range(warmup):
        step(stage, *args)
        stage.module.zero_grad(set_to_none=True)
        restart_watch()
    return step(stage, *args)


ADVICE = (
    "In a pipeline, a blocking dist.send waits until the neighbour posts the matching recv. If two "
    "neighbours both send (stage s an activation forward, stage s + 1 a gradient back), neither "
    "receives: send with dist.isend (wait for a request before the next send in its direction, and for "
    "the last ones before returning), and receive "
    "from each neighbour in the order it sends (micro-batch 0, 1, 2, ...).")

NEIGHBOUR_ADVICE = (
    "A stage above called send or recv with a rank that is not one of its neighbours, so the matching "
    "call never comes: this is not a question of blocking sends. Name the neighbours stage.prev and "
    "stage.next: they are the world ranks of the previous and the next stage (here the stages run on "
    "ranks {ranks}, in stage order), not rank - 1 and rank + 1.")


def pipeline_advice(group, pipeline):
    """What a deadlock message advises: the neighbours when a stage named a non-neighbour (a wrong
    peer deadlocks too, and isend would not help), else how sends and receives must be ordered."""
    for call in group:
        if call.rank not in pipeline.ranks:
            continue
        index = pipeline.stage_of(call.rank)
        if any(o.op in ("send", "recv") and message_kind(pipeline, index, o) is None for o in call.ops):
            return NEIGHBOUR_ADVICE.format(ranks=pipeline.ranks)
    return ADVICE


def run_pipeline_cases(step, cases, *, exercise, group_timeout=GROUP_TIMEOUT, deadline=None):
    """Run several PipelineCases in one launch (a launch costs ~0.2-0.5 s); runs[case][rank] (RankRun).

    The launch has as many ranks as the largest placement needs; a rank outside a case's placement
    sits that case out (its run has group None). Runs are in world-rank order (`by_stage` reorders
    them). A deadlock or a collective raises an AssertionError naming stages, ranks and micro-batches
    when its case is reached.
    """
    cases = [case.validate() for case in cases]
    world_size = 1 + max(max(case.ranks) for case in cases)
    if len({bool(case.warmup) for case in cases}) != 1:
        raise ValueError("cases of one launch must all have a warm-up, or none")
    runnable = [as_case(case, world_size) for case in cases]
    return run_cases(stage_case, step, world_size, runnable, exercise=exercise, p2p_only=True,
                     group_timeout=group_timeout, deadline=deadline, describe=describe_stage,
                     advice=pipeline_advice)


def as_case(case, world_size):
    """A PipelineCase as the case runner's Case: each rank in the placement is sent its own stage's part
    (PipelineCase.for_rank), the others sit it out."""
    return Case(parts=[case.for_rank(r) if r in case.ranks else None for r in range(world_size)],
                label=case.label, about=case)


def run_pipeline(step, case, *, exercise, group_timeout=GROUP_TIMEOUT, deadline=None):
    """Run one PipelineCase; return one RankRun per world rank."""
    return run_pipeline_cases(step, [case], exercise=exercise, group_timeout=group_timeout,
                              deadline=deadline)[0]


def by_stage(calls, case):
    """The Calls reordered by stage: by_stage(calls, case)[s] ran stage s."""
    return [calls[rank] for rank in case.ranks]


def message_kind(case, stage_index, op):
    """'activation' or 'gradient' for a send/recv between neighbours, else None (not a neighbour)."""
    ranks = case.ranks
    prev = ranks[stage_index - 1] if stage_index > 0 else None
    nxt = ranks[stage_index + 1] if stage_index < case.n_stages - 1 else None
    peer = op.world_peer
    if peer is not None and peer == nxt:
        return "activation" if op.op == "send" else "gradient"
    if peer is not None and peer == prev:
        return "activation" if op.op == "recv" else "gradient"
    return None


def _stage_name(case, rank):
    return f"stage {case.stage_of(rank)}" if rank in case.ranks else "no stage"


def describe_stage(call, pipeline):
    """One line of a deadlock message: what this stage was waiting for, in micro-batches."""
    index = pipeline.stage_of(call.rank)
    who = f"stage {index} (rank {call.rank})"
    strays = _strays(call, pipeline, index)
    if not call.stuck:
        return (f"{who}: finished its step ({len(call.sends)} send(s), {len(call.ops) - len(call.sends)} "
                f"recv(s)){strays}")
    last = call.ops[-1] if call.ops else None
    if last is None or last.op not in ("send", "recv"):
        return f"{who}: blocked {call.stuck}{strays}"
    kind = message_kind(pipeline, index, last)
    peer = last.world_peer
    if kind is None:
        return (f"{who}: blocked {call.stuck}, but rank {peer} ({_stage_name(pipeline, peer)}) is not a "
                f"neighbour of stage {index}: a stage talks only to stage {index - 1} and stage "
                f"{index + 1}{strays}")
    k = sum(1 for o in call.ops[:-1] if o.op == last.op and o.world_peer == peer)
    verb, direction = ("send", "to") if last.op == "send" else ("receive", "from")
    return (f"{who}: blocked {call.stuck}, waiting to {verb} the {kind} of micro-batch {k} (its message "
            f"{k + 1} {direction} {_stage_name(pipeline, peer)}){strays}")


def _strays(call, pipeline, index):
    """' -- it also sent to rank 3, not a neighbour' for messages to or from non-neighbours."""
    odd = [o for o in call.ops if o.op in ("send", "recv") and message_kind(pipeline, index, o) is None]
    if not odd:
        return ""
    o = odd[0]
    return (f"; it called {o.op} {'to' if o.op == 'send' else 'from'} rank {o.world_peer} "
            f"({_stage_name(pipeline, o.world_peer)}), which is not a neighbour of stage {index}")
