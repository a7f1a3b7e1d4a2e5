"""The plumbing of fully sharded data parallelism: a module's parameters as one flat vector whose
memory can be freed and refilled, and a recorder of when that happens.

    unit = FlatUnit(model.fc1, "fc1")   # fc1.weight and fc1.bias become views of unit.full
    shard = unit.buffer[a:b].clone()     # your slice of the flat vector
    unit.free()                          # the full vector gives its memory back (0 bytes)
    ...
    unit.alloc()                         # memory again (contents undefined) and fresh views:
    dist.all_gather(..., )               # fill unit.buffer, then run fc1
    unit.full.grad                       # after backward: fc1's gradient, as one flat vector

Why a library class: ZeRO-3 (notebook 10's MiniFSDP) is about *when* to gather, free and
reduce. Doing it on top of torch needs three tricks that teach nothing about ZeRO, and
FlatUnit does them:
  * the parameters become views of one leaf tensor `full` (requires_grad), so autograd
    accumulates the unit's whole gradient into `full.grad`, one flat vector, and its
    `register_post_accumulate_grad_hook` fires once per backward, when that gradient is
    complete (FSDP1's FlatParameter does the same);
  * freeing keeps the tensor and drops its memory (`untyped_storage().resize_(0)`), and
    alloc gives it back: the views that autograd saved for backward see the refilled
    memory (FSDP2 frees and reallocates its all-gather output the same way). Writes go
    through `full.data` (`buffer`), which autograd's version counter does not track;
  * `alloc()` makes fresh views each time. Called in a forward pre-hook, the view nodes
    are created just before the unit's own operations, so in backward autograd reaches
    the unit's AccumulateGrad (and your reduce-scatter hook) right after the unit's
    gradients are computed, not at the end of backward.

Every alloc and free is reported to the active UnitRecorders: a test counts how many
units are unsharded at once from that log, without trusting the code under test.
Using a freed unit's parameters fails: autograd refuses a saved tensor whose memory is gone
("... out of bounds for storage of size 0"), and other reads can crash the process. Gather first.

`padded(t, size)` is the other piece of plumbing: all_gather needs the same size on every
rank (gloo refuses uneven sizes), so shards travel padded to ⌈S/N⌉ elements.
"""

import time

import torch

_RECORDERS = []


def padded(t, size):
    """A 1-D copy of `t` with zeros appended up to `size` elements (all_gather needs equal sizes)."""
    out = t.new_zeros(size)
    out[:t.numel()] = t.reshape(-1)
    return out


def _in_backward():
    return torch._C._current_graph_task_id() != -1


class FlatUnit:
    """The trainable parameters of `module` (recursively) as views of one flat leaf tensor `full`.

    Frozen parameters (requires_grad=False) stay ordinary parameters of their modules.
    The unit starts unsharded (its memory allocated, holding the module's values).
    """

    def __init__(self, module, name=None):
        self.module = module
        self.name = name if name is not None else type(module).__name__
        self.slots = []  # (owner module, attribute name, shape), in module.parameters() order
        params = []
        for owner in module.modules():
            for attr, p in list(owner._parameters.items()):
                if p is not None and p.requires_grad:
                    self.slots.append((owner, attr, p.shape))
                    params.append(p)
        if not params:
            raise ValueError(f"{self.name} has no trainable parameters: nothing to shard")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"{self.name}: one flat vector needs one dtype and one device, got "
                             f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}")
        self.numel = sum(p.numel() for p in params)
        with torch.no_grad():
            values = torch.cat([p.detach().reshape(-1) for p in params])
        self.full = values.requires_grad_(True)  # a leaf: autograd accumulates into full.grad
        for owner, attr, _ in self.slots:
            del owner._parameters[attr]
        self._set_views()
        _report(self, "create")

    @property
    def buffer(self):
        """The flat values to read or write (full.data: writes are invisible to autograd)."""
        return self.full.data

    @property
    def unsharded(self):
        """True while the full vector holds memory (between alloc and free)."""
        return self.full.data.untyped_storage().nbytes() > 0

    @property
    def nbytes(self):
        """Bytes of the full flat vector when unsharded."""
        return self.numel * self.full.element_size()

    def alloc(self):
        """Give the full vector its memory back (contents undefined: fill `buffer`) and point the
        module's parameters at fresh views of it. Returns `buffer`."""
        storage = self.full.data.untyped_storage()
        if storage.nbytes() < self.nbytes:
            storage.resize_(self.nbytes)
        self._set_views()
        _report(self, "alloc")
        return self.buffer

    def free(self):
        """Drop the full vector's memory (0 bytes); the shard you keep elsewhere is what remains."""
        self.full.data.untyped_storage().resize_(0)
        _report(self, "free")

    def _set_views(self):
        offset = 0
        for owner, attr, shape in self.slots:
            n = shape.numel()
            setattr(owner, attr, self.full[offset:offset + n].view(shape))
            offset += n

    def __repr__(self):
        state = "unsharded" if self.unsharded else "freed"
        return f"FlatUnit({self.name}, {self.numel} elements, {state})"


def _report(unit, what):
    for recorder in _RECORDERS:
        recorder.events.append((what, unit.name, _in_backward(), time.perf_counter()))


class UnitRecorder:
    """Inside a rank: log every FlatUnit create/alloc/free while active.

        with UnitRecorder() as units:
            ...
        units.events   # [("alloc", "fc1", in_backward, time), ...]: plain tuples, for a test to judge
    """

    def __init__(self):
        self.events = []

    def __enter__(self):
        _RECORDERS.append(self)
        return self

    def __exit__(self, *exc):
        _RECORDERS.remove(self)
        return False

    def mark(self, label):
        """Add a marker (e.g. "step 1") between events, so a test can cut the log into steps."""
        self.events.append(("mark", label, _in_backward(), time.perf_counter()))


def unsharded_over_time(events):
    """[(event, sorted units unsharded right after it)] from a UnitRecorder log, from its first mark on.

    Construction is left out: the model existed whole before it was wrapped. A test marks the
    log once the wrapper is built; the count starts there (the mark itself counts).
    """
    now, timeline, counting = set(), [], False
    for what, name, in_backward, _ in events:
        if what in ("create", "alloc"):
            now.add(name)
        elif what == "free":
            now.discard(name)
        counting = counting or what == "mark"
        if counting:
            timeline.append(((what, name, in_backward), sorted(now)))
    return timeline


def most_unsharded(events):
    """(the largest number of units unsharded at once after the first mark, those units, the event)."""
    best = (0, [], None)
    for event, units in unsharded_over_time(events):
        if len(units) > best[0]:
            best = (len(units), units, event)
    return best
