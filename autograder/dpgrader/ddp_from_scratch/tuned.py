"""The reference bucketed, overlapped DDP of 05_ddp_from_scratch (grader side: it is the solution).

Same contract as the exercise's `BucketedDDP`, tuned the way torch's C++ Reducer is:
  * buckets of parameters in reverse registration order, closed once they hold
    >= bucket_cap bytes (torch's `_compute_bucket_assignment_by_size` rule);
  * one preallocated flat buffer per bucket: a gradient is copied into its slot,
    divided by N in the same pass, by its post-accumulate-grad hook (no torch.cat);
  * a full bucket's all-reduce is launched asynchronously,
    buckets strictly in index order (so every rank issues the same collectives
    in the same order, whatever order its hooks fire in);
  * `finish_gradient_sync()` waits bucket by bucket and copies results back.
Used by tests/bench/bench_ddp.py to compare against torch's DistributedDataParallel,
and by the unit tests to show the hidden checks pass a correct implementation.
"""

import torch
import torch.distributed as dist
from torch import nn


def bucket_assignment(params, bucket_cap):
    """Parameters in reverse order, grouped greedily; a bucket closes once it holds >= bucket_cap bytes."""
    buckets, bucket, size = [], [], 0
    for p in reversed(list(params)):
        bucket.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_cap:
            buckets.append(bucket)
            bucket, size = [], 0
    if bucket:
        buckets.append(bucket)
    return buckets


class ReferenceDDP(nn.Module):
    def __init__(self, module, bucket_cap=25 * 2 ** 20):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.names = {p: name for name, p in module.named_parameters()}
        self.buckets = bucket_assignment([p for p in module.parameters() if p.requires_grad], bucket_cap)
        self.buffers_, self.slot = [], {}
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                self.slot[p] = (i, offset, p.numel())
                offset += p.numel()
            self.buffers_.append(torch.empty(offset, dtype=bucket[0].dtype, device=bucket[0].device))
        self._reset()
        for p in self.slot:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _reset(self):
        self.pending = [len(b) for b in self.buckets]
        self.works = [None] * len(self.buckets)
        self.next_bucket = 0
        self.ready = set()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, param):
        i, offset, n = self.slot[param]
        self.ready.add(param)
        # copy and divide in one pass, as torch's Reducer does (at::mul_out into the bucket view)
        torch.mul(param.grad.reshape(-1), 1.0 / self.world_size, out=self.buffers_[i][offset:offset + n])
        self.pending[i] -= 1
        while self.next_bucket < len(self.buckets) and self.pending[self.next_bucket] == 0:
            j = self.next_bucket
            self.works[j] = dist.all_reduce(self.buffers_[j], async_op=True)
            self.next_bucket += 1

    def finish_gradient_sync(self):
        launched = [w for w in self.works if w is not None]
        if len(launched) < len(self.buckets):
            missing = [self.names[p] for p in self.slot if p not in self.ready]
            for work in launched:
                work.wait()
            self._reset()
            raise RuntimeError(f"parameters that got no gradient in this backward: {missing}. "
                               f"ReferenceDDP needs every trainable parameter to be used in forward "
                               f"(freeze unused ones with requires_grad_(False))")
        for bucket, flat, work in zip(self.buckets, self.buffers_, self.works, strict=True):
            work.wait()
            for p in bucket:
                _, offset, n = self.slot[p]
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        self._reset()


# exercise key -> its tuned version here (autograder/exercises.json lists it; a test imports each)
TUNED = {
    "bucketed_ddp": "ReferenceDDP",
}
