"""The course's PowerSGD communication hook, tuned (grader side: it is the solution of notebook 11's
`powersgd_hook`, same contract, same results).

Same algorithm as the exercise (rank r = min(matrix_rank, n, m) for each n×m matrix whose factors are
smaller, (n + m)·r < n·m; error feedback per parameter; warm start; first Q from
torch.Generator().manual_seed(seed); P summed, Q averaged; every collective issued from backward's
thread, in bucket order), tuned the way torch's powerSGD_hook is:
  * per bucket layout (its parameters, in bucket order), the split is computed once, and P, Q and the
    error live in preallocated flat tensors: each matrix's P and Q are views, written by
    `torch.matmul(..., out=view)`; the all-reduces take the flat tensors as they are (no torch.cat);
  * the error is added to, and later computed from, the whole bucket buffer in one operation each;
  * P is orthonormalised in place by Gram-Schmidt for r <= 2 (two passes over a thin matrix), by
    QR above, as torch does.
When DDP rebuilds its buckets (after the first step), the new layout takes over each parameter's
error and Q from the old one, so the state is per parameter, as the exercise asks.
Used by tests/bench/bench_powersgd.py against torch's powerSGD_hook, and by the grader's tests to
show that the hidden checks pass a correct implementation.
"""

import torch
import torch.distributed as dist


def compressible(shape, matrix_rank):
    """(n + m)·r < n·m for the n × m view of a tensor of >= 2 dimensions (costs.compressible)."""
    if len(shape) < 2:
        return False
    n = shape[0]
    m = 1
    for d in shape[1:]:
        m *= d
    r = min(matrix_rank, n, m)
    return (n + m) * r < n * m


class TunedPowerSGDState:
    """State of `tuned_powersgd_hook`: per-parameter error and Q (as views into per-layout memory)."""

    def __init__(self, matrix_rank=1, seed=0):
        self.matrix_rank, self.seed = matrix_rank, seed
        self.errors = {}  # parameter -> view of its error in the current layout's flat error
        self.qs = {}  # parameter -> view of its Q in the current layout's flat Q memory
        self.layouts = {}  # tuple of parameter ids, in bucket order -> _Layout

    def layout(self, bucket):
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        if key not in self.layouts:
            self.layouts[key] = _Layout(self, params, bucket.buffer())
        return self.layouts[key]


class _Layout:
    """One bucket's split, flat P / Q / error memory and views, built once."""

    def __init__(self, state, params, buffer):
        r_max = state.matrix_rank
        self.matrices, plain, offset, p_size, q_size = [], [], 0, 0, 0
        shapes = []
        for p in params:
            numel = p.numel()
            shape = tuple(p.shape)
            if compressible(shape, r_max):
                n, m = shape[0], numel // shape[0]
                r = min(r_max, n, m)
                shapes.append((p, offset, n, m, r, p_size, q_size))
                p_size += n * r
                q_size += m * r
            else:
                plain.append(torch.arange(offset, offset + numel, device=buffer.device))
            offset += numel
        self.plain_index = torch.cat(plain) if plain else None
        self.p_flat = torch.empty(p_size, dtype=buffer.dtype, device=buffer.device)
        self.q_flat = torch.empty(q_size, dtype=buffer.dtype, device=buffer.device)
        self.error = torch.zeros_like(buffer)
        position = 0
        for p in params:  # take over each parameter's error from an earlier layout
            if p in state.errors:
                self.error[position:position + p.numel()].copy_(state.errors[p].reshape(-1))
            state.errors[p] = self.error[position:position + p.numel()].view(p.shape)
            position += p.numel()
        for p, start, n, m, r, p_at, q_at in shapes:
            P = self.p_flat[p_at:p_at + n * r].view(n, r)
            Q = self.q_flat[q_at:q_at + m * r].view(m, r)
            if p in state.qs:
                Q.copy_(state.qs[p])
            else:
                first = torch.Generator().manual_seed(state.seed)
                Q.copy_(torch.randn(m, r, generator=first, dtype=buffer.dtype))
            state.qs[p] = Q
            self.matrices.append((start, n, m, P, Q))


def _orthonormalise(P):
    """P's columns made orthonormal in place (the same column space as QR's Q, up to signs)."""
    if P.shape[1] <= 2:
        for i in range(P.shape[1]):
            col = P[:, i:i + 1]
            col /= torch.linalg.vector_norm(col)
            if i + 1 < P.shape[1]:
                rest = P[:, i + 1:]
                rest -= col @ (col.T @ rest)
    else:
        P.copy_(torch.linalg.qr(P).Q)


def tuned_powersgd_hook(state, bucket):
    """DDP communication hook: rank-r PowerSGD with error feedback and warm start (see the module)."""
    world_size = dist.get_world_size()
    layout = state.layout(bucket)
    buffer = bucket.buffer()
    buffer += layout.error
    wanted = buffer.clone()
    work = None
    if layout.plain_index is not None:
        plain = buffer.index_select(0, layout.plain_index)
        work = dist.all_reduce(plain, async_op=True)
    if layout.matrices:
        views = [(buffer[start:start + n * m].view(n, m), P, Q) for start, n, m, P, Q in layout.matrices]
        for M, P, Q in views:
            torch.matmul(M, Q, out=P)
        dist.all_reduce(layout.p_flat)
        for _, P, _ in views:
            _orthonormalise(P)
        for M, P, Q in views:
            torch.matmul(M.T, P, out=Q)
        dist.all_reduce(layout.q_flat)
        layout.q_flat /= world_size
        for M, P, Q in views:
            torch.matmul(P, Q.T, out=M)

    def finish(fut):
        if fut is not None:
            buffer.index_copy_(0, layout.plain_index, fut.value()[0] / world_size)
        torch.sub(wanted, buffer, out=layout.error)
        return buffer

    if work is None:
        done = torch.futures.Future()
        done.set_result(finish(None))
        return done
    return work.get_future().then(finish)


# exercise key -> its tuned version here (autograder/exercises.json lists it; a test imports each)
TUNED = {
    "powersgd_hook": "tuned_powersgd_hook",
}
