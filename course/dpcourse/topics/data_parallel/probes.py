"""Small modules that reveal how a DataParallel-like wrapper runs them.

Used by notebook 02's test cells and hidden checks.

A wrapper around a model can give the right numbers for the wrong reasons: run
the replicas one after another instead of in parallel, stitch the outputs
together in the order the threads finished, drop keyword arguments, lose a
tuple output. Each probe here makes one of those visible:

  * `ParallelProbe` waits at a barrier until every replica has arrived (replicas
    run one after another never all arrive), records which thread ran which rows,
    and can make the first replica finish last;
  * `TwoHeads` returns a tuple, `Keywords` takes keyword arguments (a tensor that
    must be split with the batch and a number that must not), `Fails` raises in
    one replica.

Every probe feeds row i of the batch through the same arithmetic, so the plain
module on the whole batch gives the expected output.
"""

import threading
import time

import torch
from torch import nn


class ParallelProbe(nn.Module):
    """Wraps `module`; every forward records its thread id, the rows it received, start and end
    times and whether grad mode was on.

    parties: if set, each forward waits at a barrier for `parties` concurrent
    forwards (timeout seconds); replicas that do not run concurrently fail with a
    message saying so.
    first_finishes_last: the replica holding row 0 sleeps this many seconds after
    the barrier, so it finishes after the others.
    Rows are identified by column 0 of the input, which must hold the row index.
    """

    def __init__(self, module, parties=None, timeout=2.0, first_finishes_last=0.0):
        super().__init__()
        self.module = module
        self.timeout = timeout
        self.parties = parties
        self.barrier = threading.Barrier(parties, timeout=timeout) if parties else None
        self.first_finishes_last = first_finishes_last
        self.calls = []
        self._lock = threading.Lock()

    def reset(self):
        self.calls = []
        if self.parties:
            self.barrier = threading.Barrier(self.parties, timeout=self.timeout)

    def forward(self, x, *args, **kwargs):
        start = time.perf_counter()
        rows = [int(v) for v in x[:, 0].tolist()] if len(x) else []
        if self.barrier is not None:
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:
                raise AssertionError(
                    f"the replicas did not run in parallel: the replica with rows {rows} waited "
                    f"{self.timeout:g} s for {self.parties} replicas to run at the same time, and they "
                    f"never did (run each replica in its own thread, start them all, then join)"
                ) from None
        if self.first_finishes_last and 0 in rows:
            time.sleep(self.first_finishes_last)
        out = self.module(x, *args, **kwargs)
        with self._lock:
            self.calls.append(dict(thread=threading.get_ident(), rows=rows, start=start,
                                   end=time.perf_counter(), grad_enabled=torch.is_grad_enabled()))
        return out


def indexed_batch(n, features=4, seed=0):
    """A batch whose column 0 is the row index 0..n-1 (what ParallelProbe reads), the rest random."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    x[:, 0] = torch.arange(n, dtype=x.dtype)
    return x


class TwoHeads(nn.Module):
    """Returns a tuple (scores, (embedding, a constant label)): nested outputs to gather."""

    def __init__(self, features=4, seed=0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.body = nn.Linear(features, 8)
            self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.head(h), (h, "label")


class Keywords(nn.Module):
    """forward(x, scale=1.0, offset=None): a number applied to every row, a tensor added row by row."""

    def __init__(self, features=4, seed=0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.linear = nn.Linear(features, 2)

    def forward(self, x, scale=1.0, offset=None):
        out = self.linear(x) * scale
        if offset is not None:
            out = out + offset
        return out


class Fails(nn.Module):
    """Raises ValueError in the replica that holds row `bad_row` (column 0 holds row indices)."""

    def __init__(self, bad_row, features=4):
        super().__init__()
        self.bad_row = bad_row
        self.linear = nn.Linear(features, 1)

    def forward(self, x):
        if (x[:, 0] == self.bad_row).any():
            raise ValueError(f"row {self.bad_row} is corrupt")
        return self.linear(x)
