"""Notebook 13, the capstone: a small GPT (dpcourse.toys.gpt) trained on 8 ranks in data x pipeline x tensor
parallelism composed from torch's production APIs, against one process (dpcourse.reference.lm).

  runs      the rank side of every case (mesh, block, pipeline, fsdp, train, checkpoint): each rank is sent
            only its part; build_3d composes the learner's pieces in torchtitan's order
  checks    verdicts against init_device_mesh's layout and the unsharded float64 model / one process
  costs     the planner: memory per rank and time per step of a layout (alpha-beta), and its calibration here
  pictures  the mesh with bytes per group, one step's timeline per rank, the layouts' loss curves

What runs, measured 2026-12-02 with torch 2.13.0+cpu on the 2-core machine (8 ranks forked, load 3-10), the
GPT of 2-4 blocks, every layout's losses against one float64 process:

  * init_device_mesh((dp, pp, tp)), 8 ranks: works on gloo (0.02-0.2 s) and routed (new groups are routed
    groups). It does NOT check dp*pp*tp == world: (3, 1, 2) on 8 ranks builds a mesh of ranks 0-5.
  * parallelize_module with Colwise/Rowwise/SequenceParallel/PrepareModuleInput: works, error 4e-16; routed
    too (DTensor's functional collectives find the group by RoutedGroup.group_name).
  * fully_shard on mesh["dp"], also over tensor-parallel DTensors (2-D): works, gloo and routed
    (all_gather_single / reduce_scatter_single).
  * PipelineStage + Schedule1F1B on mesh["pp"], TP and FSDP inside the stage: works, gloo and routed
    (send/recv); n_micro >= n_stages or Schedule1F1B's constructor raises (pipelining/schedules.py).
  * all three: (2,2,2), (1,2,4), (2,1,4), (8,1,1), (4,2,1), (4,1,2), (1,2,1), (2,2,1), (1,1,4): <= 9e-16.
  * torch.distributed.checkpoint, saved in (2,2,2), loaded in (4,1,2): works on gloo; routed when the
    folder is a launch argument under the judge's shared scratch (the only writable place sandboxed ranks
    share: dpgrader/judge/ranks.py _shared_folders, which does not look inside per_rank arguments).
  * DTensor's RNG (a sharded tensor's dropout mask = the whole tensor's): NOT on a CPU mesh,
    OffsetBasedRNGTracker raises for cpu (torch/distributed/tensor/_random.py); toys.gpt.ShardedDropout
    draws the whole tensor's mask from the default generator and keeps its piece (the course's version).

Costs, here: the first step of a tensor-parallel layout takes 1-6 s on 8 ranks (DTensor's sharding
propagation runs a FakeTensor of every new operator schema, _sharding_prop.propagate_op_sharding_non_cached,
~0.5 s CPU per rank; pipelining's first step also runs a metadata-inference forward and backward), a later
step 0.3-1 s; a CommRecorder (a dispatch mode) over a whole case adds ~30%, so runs.Phases records only the
phases it reports while not graded, and only counts the routed group's own reports while graded. Known prints
(FSDP2's "returned a view tensor" UserWarning, the redistribute log line of a 2-D gradient norm) are silenced
in the ranks (topics.tensor.realapi.quiet_dtensor, which runs uses).
"""
