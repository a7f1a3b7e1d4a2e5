"""Measure, inside a rank, what notebook 12's claims are about: memory held, memory saved, work done.

    with PeakMemory() as peak:              # tensors created inside, and still alive
        out = ring_attention(q, k, v, positions)
    peak.peak_bytes                          # the most bytes they held at once
    peak.most_alive[4608]                    # the most storages of 4608 bytes alive at once

    with LayerNormBytes() as saved:          # what LayerNorms keep for backward
        y = module(x)
    saved.nbytes

    with StepRecorder() as rec:              # messages, and the FLOPs done before each of them
        ring_attention(...)
    rec.ops, rec.flops_at, rec.total_flops

Why a module: "no rank ever holds the full K or V", "the LayerNorm keeps 1/t of its
activations" and "every rank does the same work" are claims about what a rank's process does,
not about the values it returns. Each is measured here with torch's own machinery: a
TorchDispatchMode sees every tensor an operator creates (PeakMemory) and every LayerNorm with the
tensors autograd keeps for its backward (LayerNormBytes), and torch's FlopCounterMode counts the
floating-point operations of matrix products and attention (StepRecorder, per message). These
are observations made in the rank, next to the learner's code: a program written against them
could fool them, values and messages (counted by the grader's router) cannot be fooled.
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from dpcourse.comm.recorder import CommRecorder


class PeakMemory(TorchDispatchMode):
    """The peak of the bytes held by tensors created inside the context (inputs do not count).

    A storage shared by several tensors (views) counts once, while any of them lives; a tensor
    stops counting when Python frees it, which is when nothing refers to it any more (a gloo request
    keeps its tensor alive until the request is dropped, and so does the grader's). In-place
    operators create nothing. `most_alive`: for each storage size, the most storages of that size
    alive at once -- what a message can name ("it held 7 tensors of a K/V block's size at once").
    """

    def __init__(self):
        super().__init__()
        self.current = self.peak_bytes = 0
        self.most_alive, self._alive = {}, {}  # storage size -> the most alive at once, alive now
        self._live = {}  # storage address -> [nbytes, live tensor objects]
        self._seen = set()  # ids of tensor objects already tracked

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._track(value)
        return out

    def _track(self, tensor):
        if id(tensor) in self._seen:
            return
        storage = tensor.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return
        self._seen.add(id(tensor))
        entry = self._live.get(address)
        if entry is None:
            self._live[address] = [nbytes, 1]
            self.current += nbytes
            self.peak_bytes = max(self.peak_bytes, self.current)
            self._alive[nbytes] = self._alive.get(nbytes, 0) + 1
            self.most_alive[nbytes] = max(self.most_alive.get(nbytes, 0), self._alive[nbytes])
        else:
            entry[1] += 1
        weakref.finalize(tensor, self._release, address, id(tensor))

    def _release(self, address, ident):
        self._seen.discard(ident)
        entry = self._live.get(address)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[address]
            self.current -= entry[0]
            self._alive[entry[0]] -= 1


class LayerNormBytes(TorchDispatchMode):
    """Bytes a LayerNorm keeps for its backward, counted at every `aten.native_layer_norm` inside the
    context: its input and the mean and reciprocal standard deviation it returns (autograd saves these
    three; the weight and bias are parameters, kept anyway). Every way of writing a LayerNorm -- the
    module, F.layer_norm -- reaches this operator."""

    def __init__(self):
        super().__init__()
        self.nbytes, self.shapes = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.native_layer_norm:
            for tensor in (args[0], out[1], out[2]):
                self.nbytes += tensor.numel() * tensor.element_size()
                self.shapes.append(tuple(tensor.shape))
        return out


class StepRecorder(CommRecorder):
    """A CommRecorder that also notes, at each recorded call, the FLOPs done so far (torch's
    FlopCounterMode: matrix products and attention kernels), so that a ring's work can be drawn
    step by step. Enter it as a context manager, like CommRecorder."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.flops = FlopCounterMode(display=False)
        self.flops_at = []  # FLOPs done before each recorded call, in the order of self.ops

    def __enter__(self):
        self.flops.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        self.flops.__exit__(*exc)
        return result

    @property
    def total_flops(self):
        return self.flops.get_total_flops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.ops)
        done = self.flops.get_total_flops()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.flops_at += [done] * (len(self.ops) - before)
        return out

    def note(self, name, peer, nbytes, group):
        done = self.flops.get_total_flops()
        super().note(name, peer, nbytes, group)
        self.flops_at.append(done)
