"""Planted bugs for 05_ddp_from_scratch: each must lose the listed cells with a message saying why.

Exercises are independent (each test builds what it needs), so every graded variant plants one bug
in each of the six exercises: 4 notebooks, 4 bugs per exercise. Covered, among others: no initial
broadcast, sum instead of average, a parameter skipped, a sampler without epoch, all ranks on the
same data, waiting on buckets too late (after backward), too early (blocking hooks) or never.
"""

from dpgrader.planted import Bug, Variant

BROADCAST = "        for tensor in [*model.parameters(), *model.buffers()]:\n"
SEED = "            g.manual_seed(self.seed + self.epoch)\n"
REDUCE = ("            dist.all_reduce(p.grad)\n"
          "            p.grad /= world_size\n")
LAUNCH = "            self.in_flight[i] = (dist.all_reduce(flat, async_op=True), flat)\n"
NO_SYNC = ("        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False\n"
           "        try:\n"
           "            yield\n"
           "        finally:\n"
           "            self.require_backward_grad_sync = previous\n")

BUGS = [
    Variant("no_broadcast__no_epoch__sum__buckets_too_late", [
        Bug("broadcast_model", "no_broadcast",
            patch=[("    with torch.no_grad():\n" + BROADCAST + "            dist.broadcast(tensor, src=0)\n",
                    "    pass  # every rank keeps the model it built\n")],
            loses={"test_broadcast_model_basic":
                   "rank 1: after broadcast_model, every parameter should be rank 0's: fc0.weight",
                   "test_broadcast_model_buffers": "every parameter and buffer should be rank 0's"}),
        Bug("shard_sampler", "shuffle_ignores_the_epoch",
            patch=[(SEED, "            g.manual_seed(self.seed)\n")],
            loses={"test_shard_sampler_epochs_and_policy": "set_epoch must change the shuffle"},
            keeps=["test_shard_sampler_basic"]),
        Bug("average_gradients", "gradients_summed_not_averaged",
            patch=[("            p.grad /= world_size\n", "")],
            loses={"test_average_gradients_basic": "is 2 times the average over ranks: all_reduce sums",
                   "test_average_gradients_frozen_layer": "is 3 times the average over ranks"}),
        Bug("bucketed_ddp", "buckets_launched_after_backward",  # waiting too late: nothing overlaps
            patch=[("        if len(self.ready[i]) == len(self.buckets[i]):\n"
                    "            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]]) / self.world_size\n"
                    + LAUNCH, "        # launched later, in finish_gradient_sync\n"),
                   ("        for i, launched in enumerate(self.in_flight):\n",
                    "        for i, bucket in enumerate(self.buckets):\n"
                    "            if len(self.ready[i]) == len(bucket):\n"
                    "                flat = torch.cat([p.grad.reshape(-1) for p in bucket]) / self.world_size\n"
                    "                self.in_flight[i] = (dist.all_reduce(flat, async_op=True), flat)\n"
                    "        for i, launched in enumerate(self.in_flight):\n")],
            loses={"test_bucketed_ddp_overlap": "after backward ended: nothing overlaps with backward"},
            keeps=["test_bucketed_ddp_basic"]),
        Bug("accumulating_ddp", "no_sync_still_communicates",
            patch=[("        if self.sync_this_backward:\n"
                    "            super().reduce_gradient(param)\n", "        super().reduce_gradient(param)\n")],
            loses={"test_accumulating_ddp_basic": "no communication inside no_sync()",
                   "test_accumulating_ddp_restores":
                   "AccumulatingDDP, forward inside no_sync(), backward outside: the backward synchronised"}),
        Bug("distributed_optimizer", "optimizer_sums_instead_of_averaging",
            patch=[("            flat /= dist.get_world_size()\n", "")],
            loses={"test_distributed_optimizer_basic": "is 2 times the average over ranks",
                   "test_distributed_optimizer_groups": "is 3 times the average over ranks"}),
    ]),
    Variant("no_buffers__same_data__bias_skipped__never_waits", [
        Bug("broadcast_model", "buffers_not_broadcast",
            patch=[(BROADCAST, "        for tensor in model.parameters():\n")],
            loses={"test_broadcast_model_buffers": "bn.running_mean"},
            keeps=["test_broadcast_model_basic"]),
        Bug("shard_sampler", "same_indices_on_every_rank",
            patch=[("        return iter(order[self.rank:total:self.num_replicas])\n",
                    "        return iter(order[0:total:self.num_replicas])\n")],
            loses={"test_shard_sampler_basic": "gives [[0, 4, 8], [0, 4, 8], [0, 4, 8], [0, 4, 8]]",
                   "test_shard_sampler_epochs_and_policy": "every sample once, expected"}),
        Bug("average_gradients", "bias_gradients_skipped",
            patch=[("        if p.grad is not None:\n", "        if p.grad is not None and p.ndim > 1:\n")],
            loses={"test_average_gradients_basic":
                   "fc0.bias is still this rank's local gradient: it was not all-reduced",
                   "test_average_gradients_frozen_layer": "it was not all-reduced"}),
        Bug("bucketed_ddp", "never_waits_for_its_buckets",
            patch=[("            work.wait()\n", "")],
            loses={"test_bucketed_ddp_overlap": "the all-reduce had not finished (or was not waited for)"}),
        Bug("accumulating_ddp", "no_sync_never_restores",
            patch=[(NO_SYNC, "        self.require_backward_grad_sync = False\n"
                             "        yield\n")],
            loses={"test_accumulating_ddp_basic": "no communication inside no_sync()",
                   "test_accumulating_ddp_restores": "after an exception inside"}),
        Bug("distributed_optimizer", "no_tensor_fusion",
            patch=[("            if current and size + nbytes > self.fusion_threshold:\n",
                    "            if current:  # no fusion: one all-reduce per gradient\n")],
            loses={"test_distributed_optimizer_basic": "issued [10, 10, 10] all-reduces",
                   "test_distributed_optimizer_groups": "issued 10 all-reduces in step 0, expected 5"}),
    ]),
    Variant("averaged_start__no_padding__no_grad_crash__blocking_hooks", [
        Bug("broadcast_model", "parameters_averaged_not_broadcast",
            patch=[("            dist.broadcast(tensor, src=0)\n",
                    "            dist.all_reduce(tensor)\n"
                    "            tensor /= dist.get_world_size()\n")],
            loses={"test_broadcast_model_basic": "rank 0: after broadcast_model, every parameter should be rank 0's",
                   "test_broadcast_model_buffers": "can't be cast"}),
        Bug("shard_sampler", "no_padding",
            patch=[("        else:\n"
                    "            while len(order) < total:\n"
                    "                order += order[:total - len(order)]\n"
                    "        return iter(order[self.rank:total:self.num_replicas])\n",
                    "        return iter(order[self.rank::self.num_replicas])\n")],
            loses={"test_shard_sampler_basic": "[2, 6], [3, 7]]",
                   "test_shard_sampler_epochs_and_policy": "len() says 3 but iterating gives 2 indices"}),
        Bug("average_gradients", "crashes_on_parameters_without_gradient",
            patch=[("        if p.grad is not None:\n" + REDUCE,
                    "        dist.all_reduce(p.grad)\n"
                    "        p.grad /= world_size\n")],
            loses={"test_average_gradients_frozen_layer": "NoneType"},
            keeps=["test_average_gradients_basic"]),
        Bug("bucketed_ddp", "blocking_all_reduce_in_the_hooks",  # waiting too early: backward stalls
            patch=[(LAUNCH, "            work = dist.all_reduce(flat, async_op=True)\n"
                            "            work.wait()  # waits right here, inside backward\n"
                            "            self.in_flight[i] = (work, flat)\n")],
            loses={"test_bucketed_ddp_overlap": "the hooks wait for each all-reduce, so backward stalls"},
            keeps=["test_bucketed_ddp_basic"]),
        Bug("accumulating_ddp", "not_restored_after_an_exception",
            patch=[("        try:\n"
                    "            yield\n"
                    "        finally:\n"
                    "            self.require_backward_grad_sync = previous\n",
                    "        yield\n"
                    "        self.require_backward_grad_sync = previous\n")],
            loses={"test_accumulating_ddp_restores": "after an exception inside"},
            keeps=["test_accumulating_ddp_basic"]),
        Bug("distributed_optimizer", "steps_before_averaging",
            patch=[("                offset += g.numel()\n        self.optimizer.step()\n",
                    "                offset += g.numel()\n"),
                   ("    def step(self):\n",
                    "    def step(self):\n"
                    "        self.optimizer.step()  # before the gradients are averaged\n")],
            loses={"test_distributed_optimizer_basic": "rank 1's parameters differ from rank 0's",
                   "test_distributed_optimizer_groups": "parameters differ from rank 0's"}),
    ]),
    Variant("param_skipped__rank_seeds__weights_reduced__no_buckets", [
        Bug("broadcast_model", "first_parameter_skipped",
            patch=[(BROADCAST, "        for tensor in [*model.parameters(), *model.buffers()][1:]:\n")],
            loses={"test_broadcast_model_basic": "fc0.weight", "test_broadcast_model_buffers": "fc0.weight"}),
        Bug("shard_sampler", "shuffle_seeded_per_rank",
            patch=[(SEED, "            g.manual_seed(self.seed + self.epoch + self.rank)\n")],
            loses={"test_shard_sampler_basic": "rank 1: ShardSampler(10, 4, seed=0) gives",
                   "test_shard_sampler_epochs_and_policy": "every sample once, expected"}),
        Bug("average_gradients", "parameters_reduced_instead_of_gradients",
            patch=[(REDUCE, "            with torch.no_grad():\n"
                            "                dist.all_reduce(p)\n"
                            "                p /= world_size\n")],
            loses={"test_average_gradients_basic": "it was not all-reduced",
                   "test_average_gradients_frozen_layer": "it was not all-reduced"}),
        Bug("bucketed_ddp", "bucket_cap_ignored",
            patch=[("            if size >= bucket_cap:\n",
                    "            if size >= 0:  # bucket_cap ignored: one parameter per bucket\n")],
            loses={"test_bucketed_ddp_basic": "issued [10, 10, 10] all-reduces",
                   "test_bucketed_ddp_overlap": "issued 10 all-reduces in step 0, expected 4"}),
        Bug("accumulating_ddp", "nested_no_sync_turns_sync_back_on",
            patch=[("        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False\n",
                    "        self.require_backward_grad_sync = False\n"),
                   ("            self.require_backward_grad_sync = previous\n",
                    "            self.require_backward_grad_sync = True\n")],
            loses={"test_accumulating_ddp_restores": "restore the previous value, not True"},
            keeps=["test_accumulating_ddp_basic"]),
        Bug("distributed_optimizer", "second_parameter_group_never_reduced",
            patch=[('        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]\n',
                    '        grads = [p.grad for p in self.param_groups[0]["params"] if p.grad is not None]\n')],
            loses={"test_distributed_optimizer_groups": "fc0.bias is still this rank's local gradient"},
            keeps=["test_distributed_optimizer_basic"]),
    ]),
    Bug("shard_sampler", "pads_only_once",  # fine while the pad is shorter than the data
        patch=[("            while len(order) < total:\n", "            if len(order) < total:\n")],
        loses={"test_shard_sampler_epochs_and_policy":
               "ShardSampler(2, num_replicas=5, rank=4): len() says 1 but iterating gives 0 indices"},
        keeps=["test_shard_sampler_basic"]),
    Bug("shard_sampler", "len_counts_only_real_samples",  # len() forgets the padding
        patch=[("        return self.num_samples\n",
                "        return len(range(self.rank, self.n, self.num_replicas))\n")],
        loses={"test_shard_sampler_epochs_and_policy":
               "ShardSampler(10, num_replicas=4, rank=2): len() says 2 but iterating gives 3 indices"},
        keeps=["test_shard_sampler_basic"]),
    Bug("accumulating_ddp", "decides_in_the_hooks",  # the flag read at backward time, not recorded in forward
        patch=[("        if self.sync_this_backward:\n", "        if self.require_backward_grad_sync:\n")],
        loses={"test_accumulating_ddp_restores":
               "AccumulatingDDP, forward outside no_sync(), backward inside: the backward did not synchronise"},
        keeps=["test_accumulating_ddp_basic"]),
    Bug("bucketed_ddp", "ready_counters_never_reset",  # step 0 is right, then no bucket ever fills again
        patch=[("        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}\n",
                "        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}\n"
                "        self.counts = [0] * len(self.buckets)  # counted up in every backward, never reset\n"),
               ("        if len(self.ready[i]) == len(self.buckets[i]):\n",
                "        self.counts[i] += 1\n"
                "        if self.counts[i] == len(self.buckets[i]):\n")],
        loses={"test_bucketed_ddp_basic": "issued [4, 0, 0] all-reduces in steps 0, 1, 2, expected 4 per step "
                                          "(buckets of 2448, 2176, 2176 and 1152 bytes); step 0 was right"}),
]
