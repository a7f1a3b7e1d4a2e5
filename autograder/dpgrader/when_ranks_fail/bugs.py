"""Planted bugs for 14_when_ranks_fail: each must lose the listed cells with a message saying why.

Realistic mistakes, at least four per exercise: a checkpoint without torch's random state, without
Python's or the generator's, without the sampler, the schedule or the step, or with every rank's random
states under one key (DCP then keeps one rank's copy for all); a sampler that restarts from the epoch's
start, counts its position per rank, replays the same order every epoch, serves a short last batch, or
does not refuse a batch that does not split, and a checkpoint whose optimizer pieces are saved rank by rank
(not resharded); a restart that takes a checkpoint cut short, compares steps as text, starts from
scratch, takes the oldest checkpoint or saves on rank 0 only; a heartbeat that blames the stalest record,
the rank that beat least often, rank 0, or skips the ranks that never beat, or names the waiting rank's
place; a fingerprint that is a float sum, a check only rank 0 computes, a skip decided per rank, the flags
reduced with MIN, the odd one out judged against rank 0; a timer around the whole step, a barrier inside
it, the fastest rank named, a step time averaged, an idle fraction against the fastest rank. A bug lists
the cell that shows it (the basic one where both would say the same: grading stays affordable), and the
cells it must keep passing.
"""

from dpgrader.planted import Bug, solution_code

ASSIGNMENT = "14_when_ranks_fail"

# exercises 2 and 3 run the learner's save_checkpoint / load_checkpoint: their bugs are planted next to the
# solved exercise 1
SOLVED_CHECKPOINT = {"exact_checkpoint": solution_code(ASSIGNMENT, "exact_checkpoint")}


def _patched(exercise, patch):
    code = solution_code(ASSIGNMENT, exercise)
    for old, new in patch:
        assert code.count(old) == 1, f"{exercise}: {old!r} occurs {code.count(old)} times"
        code = code.replace(old, new)
    return code


def _sampler_bug(name, patch, loses, keeps=(), cells=None, source=None):
    return Bug("elastic_sampler", name, patch=patch, source=source, cells=dict(SOLVED_CHECKPOINT, **(cells or {})),
               loses=loses, keeps=list(keeps))


def _restart_bug(name, patch, loses, keeps=()):
    return Bug("restart_from_checkpoint", name, patch=patch, cells=dict(SOLVED_CHECKPOINT), loses=loses,
               keeps=list(keeps))


BUGS = [
    # -- save_checkpoint / load_checkpoint --------------------------------------------------------------
    Bug("exact_checkpoint", "torch_random_state_not_saved",
        patch=[('        f"random/rank{dist.get_rank()}": {"torch": torch.get_rng_state(),\n'
                '                                          "generator"',
                '        f"random/rank{dist.get_rank()}": {"generator"'),
               ("    torch.set_rng_state(streams[\"torch\"])\n", "")],
        loses={"test_exact_checkpoint_basic": "torch's random state"}),
    Bug("exact_checkpoint", "python_random_not_saved",
        patch=[(',\n                                          "python": random.getstate()},', "},"),
               ("    random.setstate(streams[\"python\"])\n", "")],
        loses={"test_exact_checkpoint_basic": "Python's random"}),
    Bug("exact_checkpoint", "random_states_under_one_key",
        patch=[('        f"random/rank{dist.get_rank()}": {', '        "random": {'),
               ('    streams = state[f"random/rank{dist.get_rank()}"]', '    streams = state["random"]')],
        loses={"test_exact_checkpoint_basic": "needs a key of its own"}),
    Bug("exact_checkpoint", "sampler_not_saved",
        patch=[('        "sampler": trainer.sampler.state_dict(),\n', ""),
               ('    trainer.sampler.load_state_dict(state["sampler"])\n', "")],
        loses={"test_exact_checkpoint_basic": "the sampler started again"}),
    Bug("exact_checkpoint", "schedule_not_saved",
        patch=[('        "scheduler": trainer.scheduler.state_dict(),\n', ""),
               ('    trainer.scheduler.load_state_dict(state["scheduler"])\n', "")],
        loses={"test_exact_checkpoint_basic": "schedule started over"}),
    Bug("exact_checkpoint", "step_not_restored",
        patch=[('    trainer.step = state["step"]\n', "")],
        loses={"test_exact_checkpoint_basic": "restore it"}),

    # -- ElasticSampler (next to the solved checkpoint) ---------------------------------------------------
    _sampler_bug("restarts_from_the_epoch_start",
                 patch=[('        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])',
                         '        self.epoch, self.consumed = int(state["epoch"]), 0')],
                 loses={"test_elastic_sampler_stream": "repeated"}),
    _sampler_bug("position_counted_per_rank",
                 patch=[('        return {"epoch": self.epoch, "consumed": self.consumed}',
                         '        return {"epoch": self.epoch, "position": self.consumed // self.world_size}'),
                        ('        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])',
                         '        self.epoch, self.consumed = int(state["epoch"]), '
                         'int(state["position"]) * self.world_size')],
                 loses={"test_elastic_sampler_stream": "not how far one rank got"}),
    _sampler_bug("the_same_order_every_epoch",
                 patch=[("        order = epoch_order(self.samples, self.seed, self.epoch)",
                         "        order = epoch_order(self.samples, self.seed, 0)")],
                 loses={"test_elastic_sampler_stream": "but the data order continues"}),
    _sampler_bug("a_short_last_batch",
                 patch=[("        if self.consumed + self.global_batch > self.samples:",
                         "        if self.consumed >= self.samples:")],
                 loses={"test_elastic_sampler_resume": "samples; each should take"},
                 keeps=["test_elastic_sampler_stream"]),
    _sampler_bug("no_check_of_the_split",
                 patch=[("        if global_batch % world_size:\n", "        if False:\n")],
                 loses={"test_elastic_sampler_stream": "expected a ValueError"}),
    _sampler_bug("optimizer_pieces_saved_rank_by_rank",
                 patch=[], source=solution_code(ASSIGNMENT, "elastic_sampler"),
                 cells={"exact_checkpoint": _patched("exact_checkpoint", [
                     ('        "optimizer": trainer.optimizer.state_dict(),  # AdamW\'s moments: DTensors, each '
                      'rank writes its piece\n',
                      '        f"optimizer/rank{dist.get_rank()}": {\n'
                      '            name: value.to_local() if hasattr(value, "to_local") else value\n'
                      '            for name, value in trainer.optimizer.state_dict().items()},\n'),
                     ('    trainer.optimizer.load_state_dict(state["optimizer"])',
                      '    trainer.optimizer.load_state_dict(state[f"optimizer/rank{dist.get_rank()}"])')])},
                 loses={"test_elastic_sampler_resume": "must be resharded"},
                 keeps=["test_elastic_sampler_stream"]),

    # -- train_job / latest_checkpoint (next to the solved checkpoint) -------------------------------------
    _restart_bug("takes_a_checkpoint_cut_short",
                 patch=[('                if name.startswith("step-") and os.path.isfile(os.path.join('
                         'checkpoint_dir, name, ".metadata"))]',
                         '                if name.startswith("step-")]')],
                 loses={"test_restart_from_checkpoint_cases": "step-000010"}),
    _restart_bug("steps_compared_as_text",
                 patch=[('f"step-{trainer.step:06d}"', 'f"step-{trainer.step}"'),
                        ('    return os.path.join(checkpoint_dir, max(complete, key=lambda name: '
                         'int(name[len("step-"):])))',
                         '    return os.path.join(checkpoint_dir, max(complete))')],
                 loses={"test_restart_from_checkpoint_killed": "step-000002"}),
    _restart_bug("starts_again_from_scratch",
                 patch=[("    if latest is not None:\n        load_checkpoint(latest, trainer)\n"
                         "        resumed_from = trainer.step\n", "")],
                 loses={"test_restart_from_checkpoint_killed": "started again from scratch"}),
    _restart_bug("takes_the_oldest_checkpoint",
                 patch=[('    return os.path.join(checkpoint_dir, max(complete, key=lambda name: '
                         'int(name[len("step-"):])))',
                         '    return os.path.join(checkpoint_dir, min(complete, key=lambda name: '
                         'int(name[len("step-"):])))')],
                 loses={"test_restart_from_checkpoint_cases": "step-000002"}),
    _restart_bug("saves_on_rank_zero_only",
                 patch=[("        if trainer.step % interval == 0 or trainer.step == steps:\n",
                         "        if (trainer.step % interval == 0 or trainer.step == steps) and dist.get_rank() == 0:\n")],
                 loses={"test_restart_from_checkpoint_killed": "every rank calls dcp.save"}),

    # -- Heartbeat -----------------------------------------------------------------------------------------
    Bug("heartbeat", "blames_the_stalest_record",
        patch=[('            json.dump({"step": step, "where": where}, f)',
                '            json.dump({"step": step, "where": where, "time": time.time()}, f)'),
               ('            places.append(((record["step"], PHASES.index(record["where"])), rank, record["step"], '
                'record["where"]))',
                '            places.append(((record["time"],), rank, record["step"], record["where"]))')],
        # not test_heartbeat_basic: there the stuck rank's last beat is usually, not always, the oldest
        loses={"test_heartbeat_cases": "not how recently or how often"}),
    Bug("heartbeat", "blames_the_rank_that_beat_least",
        patch=[("        self.folder, self.rank, self.world_size = folder, dist.get_rank(), dist.get_world_size()",
                "        self.folder, self.rank, self.world_size = folder, dist.get_rank(), dist.get_world_size()\n"
                "        self.beats = 0"),
               ('            json.dump({"step": step, "where": where}, f)',
                '            self.beats += 1\n            json.dump({"step": step, "where": where, "beats": self.beats}, f)'),
               ('            places.append(((record["step"], PHASES.index(record["where"])), rank, record["step"], '
                'record["where"]))',
                '            places.append(((record["beats"],), rank, record["step"], record["where"]))')],
        loses={"test_heartbeat_cases": "not how recently or how often"},
        keeps=["test_heartbeat_basic"]),
    Bug("heartbeat", "blames_rank_zero",
        patch=[("        _, rank, step, where = min(places)",
                "        _, rank, step, where = min(places)\n        rank = 0")],
        loses={"test_heartbeat_basic": "blamed rank 0"}),
    Bug("heartbeat", "names_its_own_place",
        patch=[("        _, rank, step, where = min(places)",
                "        _, rank, _, _ = min(places)\n"
                "        _, _, step, where = next(p for p in places if p[1] == self.rank)")],
        loses={"test_heartbeat_basic": "not where the others waited"}),
    Bug("heartbeat", "ranks_without_a_record_ignored",
        patch=[('                places.append(((-1, -1), rank, None, "before its first heartbeat"))\n', "")],
        loses={"test_heartbeat_cases": "stuck before its first heartbeat"},
        keeps=["test_heartbeat_basic"]),

    # -- diverged_ranks / grads_finite_everywhere -----------------------------------------------------------
    Bug("cross_rank_checks", "a_float_sum_for_a_fingerprint",
        patch=[("    fingerprint = torch.stack([(bits & 0xFFFFFFFF).sum(), (bits >> 32).sum()])  # exact: no overflow",
                "    fingerprint = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).sum().reshape(1)")],
        loses={"test_cross_rank_checks_cases": "never found"},
        keeps=["test_cross_rank_checks_basic"]),
    Bug("cross_rank_checks", "only_rank_zero_checks",
        patch=[("    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)  # max(f) and -min(f) in one all-reduce\n"
                "    if torch.equal(extremes[:2], -extremes[2:]):\n"
                "        return []\n"
                "    everyone = [torch.empty_like(fingerprint) for _ in range(dist.get_world_size())]\n"
                "    dist.all_gather(everyone, fingerprint)\n",
                "    dist.reduce(extremes, 0, op=dist.ReduceOp.MAX)  # rank 0 learns the extremes\n"
                "    everyone = ([torch.empty_like(fingerprint) for _ in range(dist.get_world_size())]\n"
                "                if dist.get_rank() == 0 else None)\n"
                "    dist.gather(fingerprint, everyone, dst=0)\n"
                "    if dist.get_rank() != 0 or torch.equal(extremes[:2], -extremes[2:]):\n"
                "        return []\n")],
        loses={"test_cross_rank_checks_basic": "must reach the same verdict"}),
    Bug("cross_rank_checks", "skip_decided_per_rank",
        patch=[("    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # one rank's bad gradient makes every rank skip\n", "")],
        loses={"test_cross_rank_checks_basic": "decided to skip"}),
    Bug("cross_rank_checks", "flags_reduced_with_min",
        patch=[("    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # one rank's bad gradient makes every rank skip",
                "    dist.all_reduce(flag, op=dist.ReduceOp.MIN)")],
        loses={"test_cross_rank_checks_basic": "a non-finite gradient on one rank"}),
    Bug("cross_rank_checks", "judged_against_rank_zero",
        patch=[("    return [rank for rank, f in enumerate(everyone) if tuple(f.tolist()) != counts[0][0]]",
                "    return [rank for rank, f in enumerate(everyone) if not torch.equal(f, everyone[0])]"),
               ("    if len(counts) > 1 and counts[0][1] == counts[1][1]:", "    if False:")],
        loses={"test_cross_rank_checks_cases": "must name [0, 1]"},
        keeps=["test_cross_rank_checks_basic"]),

    # -- time_steps ----------------------------------------------------------------------------------------
    Bug("straggler_report", "the_whole_step_timed",
        patch=[("        trainer.local_step()  # this rank's own work: no other rank in it\n"
                "        compute.append(time.perf_counter() - started)\n"
                "        trainer.sync_step()  # the all-reduce, where the fast ranks wait\n",
                "        trainer.local_step()\n        trainer.sync_step()\n"
                "        compute.append(time.perf_counter() - started)\n")],
        loses={"test_straggler_report_basic": "includes waiting for the slowest rank"}),
    Bug("straggler_report", "a_barrier_in_the_timed_region",
        patch=[("        trainer.local_step()  # this rank's own work: no other rank in it\n",
                "        trainer.local_step()\n        dist.barrier()\n")],
        loses={"test_straggler_report_basic": "includes waiting for the slowest rank"}),
    Bug("straggler_report", "the_fastest_rank_named",
        patch=[('"slowest": int(times.median(dim=1).values.argmax())',
                '"slowest": int(times.median(dim=1).values.argmin())')],
        loses={"test_straggler_report_basic": "that is the fastest rank"}),
    Bug("straggler_report", "a_step_time_averaged",
        patch=[("    step_time = times.max(dim=0).values\n", "    step_time = times.mean(dim=0)\n"),
               ("            \"idle\": 1 - times.mean(dim=0) / step_time}",
                "            \"idle\": 1 - times.mean(dim=0) / times.max(dim=0).values}")],
        loses={"test_straggler_report_basic": "(it is their mean)"}),
    Bug("straggler_report", "idle_against_the_fastest_rank",
        patch=[("            \"idle\": 1 - times.mean(dim=0) / step_time}",
                "            \"idle\": 1 - times.min(dim=0).values / step_time}")],
        loses={"test_straggler_report_basic": "1 - min / max"}),
]
