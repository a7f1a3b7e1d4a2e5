"""Planted bugs for 05_ddp_from_scratch: each must lose the listed cells with a message saying why.

Exercises are independent (each test builds what it needs), so every variant plants one bug in each
of the six exercises: 4 notebooks, 4 bugs per exercise. Covered, among others: no initial broadcast,
sum instead of average, a parameter skipped, a sampler without epoch, all ranks on the same data,
waiting on buckets too late (after backward), too early (blocking hooks) or never.
"""

VARIANTS = {
    # Planted bugs, one per exercise: no initial broadcast; a sampler that ignores the epoch; gradients
    # summed, not averaged; buckets launched only after backward (waiting too late: no overlap); no_sync()
    # that still communicates; a DistributedOptimizer that sums.
    'no_broadcast__no_epoch__sum__buckets_too_late': {
        "cells": {
            'broadcast_model': '''
def broadcast_model(model):
    """Overwrite, in place, every parameter and buffer of `model` with rank 0's values."""
    pass  # every rank keeps the model it built
''',
            'shard_sampler': '''
class ShardSampler:
    """Rank `rank`'s share of range(n), like torch.utils.data.DistributedSampler (see the policy above)."""

    def __init__(self, n, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.n, self.num_replicas, self.rank = n, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.num_samples = n // num_replicas if drop_last else -(-n // num_replicas)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.num_samples

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        total = self.num_samples * self.num_replicas
        if self.drop_last:
            order = order[:total]
        else:
            while len(order) < total:
                order += order[:total - len(order)]
        return iter(order[self.rank:total:self.num_replicas])
''',
            'average_gradients': '''
def average_gradients(model):
    """Replace every parameter's .grad by its average over all ranks (parameters without .grad skipped)."""
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
''',
            'bucketed_ddp': '''
class BucketedDDP(nn.Module):
    """DDP with gradient buckets of >= bucket_cap bytes, all-reduced asynchronously from gradient hooks."""

    def __init__(self, module, bucket_cap=25 * 2**20):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.names = {p: name for name, p in module.named_parameters()}
        self.buckets, bucket, size = [], [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_cap:
                self.buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            self.buckets.append(bucket)
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self._reset()
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _reset(self):
        self.ready = [set() for _ in self.buckets]       # parameters whose gradient arrived, per bucket
        self.in_flight = [None] * len(self.buckets)      # (work, flat tensor) per launched bucket

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, param):
        """Called by autograd once param.grad holds this backward's gradient."""
        i = self.bucket_of[param]
        self.ready[i].add(param)
        # launched later, in finish_gradient_sync

    def finish_gradient_sync(self):
        """Wait for every bucket, write the averaged gradients into .grad, get ready for the next step."""
        missing = [self.names[p] for i, b in enumerate(self.buckets) for p in b if p not in self.ready[i]]
        for i, bucket in enumerate(self.buckets):
            if len(self.ready[i]) == len(bucket):
                flat = torch.cat([p.grad.reshape(-1) for p in bucket]) / self.world_size
                self.in_flight[i] = (dist.all_reduce(flat, async_op=True), flat)
        for i, launched in enumerate(self.in_flight):
            if launched is None:
                continue
            work, flat = launched
            work.wait()
            offset = 0
            for p in self.buckets[i]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self._reset()
        if missing:
            raise RuntimeError(f"parameters {missing} got no gradient in this backward, so their buckets "
                               f"were never reduced: use them in forward, or freeze them "
                               f"(requires_grad_(False)) before wrapping the model")
''',
            'accumulating_ddp': '''
class AccumulatingDDP(HookDDP):
    """HookDDP whose hooks skip communication inside `with model.no_sync():`."""

    def __init__(self, module):
        super().__init__(module)
        self.require_sync = True

    def reduce_gradient(self, param):
        super().reduce_gradient(param)

    @contextmanager
    def no_sync(self):
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous
''',
            'distributed_optimizer': '''
class DistributedOptimizer:
    """Wrap an optimizer: step() averages the gradients over ranks in fused buffers, then steps."""

    def __init__(self, optimizer, fusion_threshold=64 * 2**20):
        self.optimizer = optimizer
        self.fusion_threshold = fusion_threshold

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        buffers, current, size = [], [], 0
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if current and size + nbytes > self.fusion_threshold:
                buffers.append(current)
                current, size = [], 0
            current.append(g)
            size += nbytes
        if current:
            buffers.append(current)
        for fused in buffers:
            flat = torch.cat([g.reshape(-1) for g in fused])
            dist.all_reduce(flat)
            offset = 0
            for g in fused:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self.optimizer.step()
''',
        },
        "loses": {
            'test_broadcast_model_basic':
                "rank 1: after broadcast_model, every parameter should be rank 0's: fc0.weight",
            'test_broadcast_model_buffers': "every parameter and buffer should be rank 0's",
            'test_shard_sampler_epochs_and_policy': 'set_epoch must change the shuffle',
            'test_average_gradients_basic': 'is 2 times the average over ranks: all_reduce sums',
            'test_average_gradients_frozen_layer': 'is 3 times the average over ranks',
            'test_bucketed_ddp_overlap': 'after backward ended: nothing overlaps with backward',
            'test_accumulating_ddp_basic': 'no communication inside no_sync()',
            'test_accumulating_ddp_restores': 'all-reduces during a backward inside no_sync()',
            'test_distributed_optimizer_basic': 'is 2 times the average over ranks',
            'test_distributed_optimizer_groups': 'is 3 times the average over ranks',
        },
        "keeps": ["test_shard_sampler_basic", "test_bucketed_ddp_basic"],
    },
    # Planted bugs: buffers not broadcast; every rank gets the same indices; bias gradients never all-
    # reduced (a parameter skipped); finish_gradient_sync that never waits for its buckets; no_sync() that
    # never turns synchronisation back on; one all-reduce per gradient (no tensor fusion).
    'no_buffers__same_data__bias_skipped__never_waits': {
        "cells": {
            'broadcast_model': '''
def broadcast_model(model):
    """Overwrite, in place, every parameter and buffer of `model` with rank 0's values."""
    with torch.no_grad():
        for tensor in model.parameters():
            dist.broadcast(tensor, src=0)
''',
            'shard_sampler': '''
class ShardSampler:
    """Rank `rank`'s share of range(n), like torch.utils.data.DistributedSampler (see the policy above)."""

    def __init__(self, n, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.n, self.num_replicas, self.rank = n, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.num_samples = n // num_replicas if drop_last else -(-n // num_replicas)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.num_samples

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        total = self.num_samples * self.num_replicas
        if self.drop_last:
            order = order[:total]
        else:
            while len(order) < total:
                order += order[:total - len(order)]
        return iter(order[0:total:self.num_replicas])
''',
            'average_gradients': '''
def average_gradients(model):
    """Replace every parameter's .grad by its average over all ranks (parameters without .grad skipped)."""
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None and p.ndim > 1:
            dist.all_reduce(p.grad)
            p.grad /= world_size
''',
            'bucketed_ddp': '''
class BucketedDDP(nn.Module):
    """DDP with gradient buckets of >= bucket_cap bytes, all-reduced asynchronously from gradient hooks."""

    def __init__(self, module, bucket_cap=25 * 2**20):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.names = {p: name for name, p in module.named_parameters()}
        self.buckets, bucket, size = [], [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_cap:
                self.buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            self.buckets.append(bucket)
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self._reset()
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _reset(self):
        self.ready = [set() for _ in self.buckets]       # parameters whose gradient arrived, per bucket
        self.in_flight = [None] * len(self.buckets)      # (work, flat tensor) per launched bucket

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, param):
        """Called by autograd once param.grad holds this backward's gradient."""
        i = self.bucket_of[param]
        self.ready[i].add(param)
        if len(self.ready[i]) == len(self.buckets[i]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]]) / self.world_size
            self.in_flight[i] = (dist.all_reduce(flat, async_op=True), flat)

    def finish_gradient_sync(self):
        """Wait for every bucket, write the averaged gradients into .grad, get ready for the next step."""
        missing = [self.names[p] for i, b in enumerate(self.buckets) for p in b if p not in self.ready[i]]
        for i, launched in enumerate(self.in_flight):
            if launched is None:
                continue
            work, flat = launched
            offset = 0
            for p in self.buckets[i]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self._reset()
        if missing:
            raise RuntimeError(f"parameters {missing} got no gradient in this backward, so their buckets "
                               f"were never reduced: use them in forward, or freeze them "
                               f"(requires_grad_(False)) before wrapping the model")
''',
            'accumulating_ddp': '''
class AccumulatingDDP(HookDDP):
    """HookDDP whose hooks skip communication inside `with model.no_sync():`."""

    def __init__(self, module):
        super().__init__(module)
        self.require_sync = True

    def reduce_gradient(self, param):
        if self.require_sync:
            super().reduce_gradient(param)

    @contextmanager
    def no_sync(self):
        self.require_sync = False
        yield
''',
            'distributed_optimizer': '''
class DistributedOptimizer:
    """Wrap an optimizer: step() averages the gradients over ranks in fused buffers, then steps."""

    def __init__(self, optimizer, fusion_threshold=64 * 2**20):
        self.optimizer = optimizer
        self.fusion_threshold = fusion_threshold

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        buffers, current, size = [], [], 0
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if current:  # no fusion: one all-reduce per gradient
                buffers.append(current)
                current, size = [], 0
            current.append(g)
            size += nbytes
        if current:
            buffers.append(current)
        for fused in buffers:
            flat = torch.cat([g.reshape(-1) for g in fused])
            dist.all_reduce(flat)
            flat /= dist.get_world_size()
            offset = 0
            for g in fused:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self.optimizer.step()
''',
        },
        "loses": {
            'test_broadcast_model_buffers': 'bn.running_mean',
            'test_shard_sampler_basic': 'gives [[0, 4, 8], [0, 4, 8], [0, 4, 8], [0, 4, 8]]',
            'test_shard_sampler_epochs_and_policy': 'every sample once, expected',
            'test_average_gradients_basic':
                "fc0.bias is still this rank's local gradient: it was not all-reduced",
            'test_average_gradients_frozen_layer': 'it was not all-reduced',
            'test_bucketed_ddp_overlap': 'the all-reduce had not finished (or was not waited for)',
            'test_accumulating_ddp_basic': 'no communication inside no_sync()',
            'test_accumulating_ddp_restores': 'after an exception inside',
            'test_distributed_optimizer_basic': 'issued [10, 10, 10] all-reduces',
            'test_distributed_optimizer_groups': 'issued 10 all-reduces in step 0, expected 5',
        },
        "keeps": ["test_broadcast_model_basic"],
    },
    # Planted bugs: parameters averaged instead of broadcast from rank 0; no padding (unequal shard
    # lengths); a crash on parameters without gradient; blocking all-reduces inside the hooks (waiting too
    # early: backward stalls); no_sync() that is not restored after an exception; the optimizer steps
    # before the gradients are reduced.
    'averaged_start__no_padding__no_grad_crash__blocking_hooks': {
        "cells": {
            'broadcast_model': '''
def broadcast_model(model):
    """Overwrite, in place, every parameter and buffer of `model` with rank 0's values."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.all_reduce(tensor)
            tensor /= dist.get_world_size()
''',
            'shard_sampler': '''
class ShardSampler:
    """Rank `rank`'s share of range(n), like torch.utils.data.DistributedSampler (see the policy above)."""

    def __init__(self, n, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.n, self.num_replicas, self.rank = n, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.num_samples = n // num_replicas if drop_last else -(-n // num_replicas)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.num_samples

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        total = self.num_samples * self.num_replicas
        if self.drop_last:
            order = order[:total]
        return iter(order[self.rank::self.num_replicas])
''',
            'average_gradients': '''
def average_gradients(model):
    """Replace every parameter's .grad by its average over all ranks (parameters without .grad skipped)."""
    world_size = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size
''',
            'bucketed_ddp': '''
class BucketedDDP(nn.Module):
    """DDP with gradient buckets of >= bucket_cap bytes, all-reduced asynchronously from gradient hooks."""

    def __init__(self, module, bucket_cap=25 * 2**20):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.names = {p: name for name, p in module.named_parameters()}
        self.buckets, bucket, size = [], [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_cap:
                self.buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            self.buckets.append(bucket)
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self._reset()
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _reset(self):
        self.ready = [set() for _ in self.buckets]       # parameters whose gradient arrived, per bucket
        self.in_flight = [None] * len(self.buckets)      # (work, flat tensor) per launched bucket

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, param):
        """Called by autograd once param.grad holds this backward's gradient."""
        i = self.bucket_of[param]
        self.ready[i].add(param)
        if len(self.ready[i]) == len(self.buckets[i]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]]) / self.world_size
            work = dist.all_reduce(flat, async_op=True)
            work.wait()  # waits right here, inside backward
            self.in_flight[i] = (work, flat)

    def finish_gradient_sync(self):
        """Wait for every bucket, write the averaged gradients into .grad, get ready for the next step."""
        missing = [self.names[p] for i, b in enumerate(self.buckets) for p in b if p not in self.ready[i]]
        for i, launched in enumerate(self.in_flight):
            if launched is None:
                continue
            work, flat = launched
            work.wait()
            offset = 0
            for p in self.buckets[i]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self._reset()
        if missing:
            raise RuntimeError(f"parameters {missing} got no gradient in this backward, so their buckets "
                               f"were never reduced: use them in forward, or freeze them "
                               f"(requires_grad_(False)) before wrapping the model")
''',
            'accumulating_ddp': '''
class AccumulatingDDP(HookDDP):
    """HookDDP whose hooks skip communication inside `with model.no_sync():`."""

    def __init__(self, module):
        super().__init__(module)
        self.require_sync = True

    def reduce_gradient(self, param):
        if self.require_sync:
            super().reduce_gradient(param)

    @contextmanager
    def no_sync(self):
        previous, self.require_sync = self.require_sync, False
        yield
        self.require_sync = previous
''',
            'distributed_optimizer': '''
class DistributedOptimizer:
    """Wrap an optimizer: step() averages the gradients over ranks in fused buffers, then steps."""

    def __init__(self, optimizer, fusion_threshold=64 * 2**20):
        self.optimizer = optimizer
        self.fusion_threshold = fusion_threshold

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self):
        self.optimizer.step()
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        buffers, current, size = [], [], 0
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if current and size + nbytes > self.fusion_threshold:
                buffers.append(current)
                current, size = [], 0
            current.append(g)
            size += nbytes
        if current:
            buffers.append(current)
        for fused in buffers:
            flat = torch.cat([g.reshape(-1) for g in fused])
            dist.all_reduce(flat)
            flat /= dist.get_world_size()
            offset = 0
            for g in fused:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
''',
        },
        "loses": {
            'test_broadcast_model_basic': "rank 0: after broadcast_model, every parameter should be rank 0's",
            'test_broadcast_model_buffers': "can't be cast",
            'test_shard_sampler_basic': '[2, 6], [3, 7]]',
            'test_shard_sampler_epochs_and_policy': 'len() says 3 but iterating gives 2 indices',
            'test_average_gradients_frozen_layer': 'NoneType',
            'test_bucketed_ddp_overlap': 'the hooks wait for each all-reduce, so backward stalls',
            'test_accumulating_ddp_restores': 'after an exception inside',
            'test_distributed_optimizer_basic': "rank 1's parameters differ from rank 0's",
            'test_distributed_optimizer_groups': "parameters differ from rank 0's",
        },
        "keeps": ["test_average_gradients_basic", "test_bucketed_ddp_basic", "test_accumulating_ddp_basic"],
    },
    # Planted bugs: the first parameter skipped by the broadcast; a shuffle seeded per rank (samples
    # missed and doubled); parameters all-reduced instead of gradients; bucket_cap ignored (one all-reduce
    # per parameter); a nested no_sync() that turns synchronisation back on; the second parameter group
    # never reduced.
    'param_skipped__rank_seeds__weights_reduced__no_buckets': {
        "cells": {
            'broadcast_model': '''
def broadcast_model(model):
    """Overwrite, in place, every parameter and buffer of `model` with rank 0's values."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()][1:]:
            dist.broadcast(tensor, src=0)
''',
            'shard_sampler': '''
class ShardSampler:
    """Rank `rank`'s share of range(n), like torch.utils.data.DistributedSampler (see the policy above)."""

    def __init__(self, n, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.n, self.num_replicas, self.rank = n, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.num_samples = n // num_replicas if drop_last else -(-n // num_replicas)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.num_samples

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch + self.rank)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        total = self.num_samples * self.num_replicas
        if self.drop_last:
            order = order[:total]
        else:
            while len(order) < total:
                order += order[:total - len(order)]
        return iter(order[self.rank:total:self.num_replicas])
''',
            'average_gradients': '''
def average_gradients(model):
    """Replace every parameter's .grad by its average over all ranks (parameters without .grad skipped)."""
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            with torch.no_grad():
                dist.all_reduce(p)
                p /= world_size
''',
            'bucketed_ddp': '''
class BucketedDDP(nn.Module):
    """DDP with gradient buckets of >= bucket_cap bytes, all-reduced asynchronously from gradient hooks."""

    def __init__(self, module, bucket_cap=25 * 2**20):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.names = {p: name for name, p in module.named_parameters()}
        self.buckets, bucket, size = [], [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= 0:  # bucket_cap ignored: one parameter per bucket
                self.buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            self.buckets.append(bucket)
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self._reset()
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _reset(self):
        self.ready = [set() for _ in self.buckets]       # parameters whose gradient arrived, per bucket
        self.in_flight = [None] * len(self.buckets)      # (work, flat tensor) per launched bucket

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, param):
        """Called by autograd once param.grad holds this backward's gradient."""
        i = self.bucket_of[param]
        self.ready[i].add(param)
        if len(self.ready[i]) == len(self.buckets[i]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]]) / self.world_size
            self.in_flight[i] = (dist.all_reduce(flat, async_op=True), flat)

    def finish_gradient_sync(self):
        """Wait for every bucket, write the averaged gradients into .grad, get ready for the next step."""
        missing = [self.names[p] for i, b in enumerate(self.buckets) for p in b if p not in self.ready[i]]
        for i, launched in enumerate(self.in_flight):
            if launched is None:
                continue
            work, flat = launched
            work.wait()
            offset = 0
            for p in self.buckets[i]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self._reset()
        if missing:
            raise RuntimeError(f"parameters {missing} got no gradient in this backward, so their buckets "
                               f"were never reduced: use them in forward, or freeze them "
                               f"(requires_grad_(False)) before wrapping the model")
''',
            'accumulating_ddp': '''
class AccumulatingDDP(HookDDP):
    """HookDDP whose hooks skip communication inside `with model.no_sync():`."""

    def __init__(self, module):
        super().__init__(module)
        self.require_sync = True

    def reduce_gradient(self, param):
        if self.require_sync:
            super().reduce_gradient(param)

    @contextmanager
    def no_sync(self):
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True
''',
            'distributed_optimizer': '''
class DistributedOptimizer:
    """Wrap an optimizer: step() averages the gradients over ranks in fused buffers, then steps."""

    def __init__(self, optimizer, fusion_threshold=64 * 2**20):
        self.optimizer = optimizer
        self.fusion_threshold = fusion_threshold

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self):
        grads = [p.grad for p in self.param_groups[0]["params"] if p.grad is not None]
        buffers, current, size = [], [], 0
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if current and size + nbytes > self.fusion_threshold:
                buffers.append(current)
                current, size = [], 0
            current.append(g)
            size += nbytes
        if current:
            buffers.append(current)
        for fused in buffers:
            flat = torch.cat([g.reshape(-1) for g in fused])
            dist.all_reduce(flat)
            flat /= dist.get_world_size()
            offset = 0
            for g in fused:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self.optimizer.step()
''',
        },
        "loses": {
            'test_broadcast_model_basic': 'fc0.weight',
            'test_broadcast_model_buffers': 'fc0.weight',
            'test_shard_sampler_basic': 'rank 1: ShardSampler(10, 4, seed=0) gives',
            'test_shard_sampler_epochs_and_policy': 'every sample once, expected',
            'test_average_gradients_basic': 'it was not all-reduced',
            'test_average_gradients_frozen_layer': 'it was not all-reduced',
            'test_bucketed_ddp_basic': 'issued [10, 10, 10] all-reduces',
            'test_bucketed_ddp_overlap': 'issued 10 all-reduces in step 0, expected 4',
            'test_accumulating_ddp_restores': 'restore the previous value, not True',
            'test_distributed_optimizer_groups': "fc0.bias is still this rank's local gradient",
        },
        "keeps": ["test_accumulating_ddp_basic", "test_distributed_optimizer_basic"],
    },
}
