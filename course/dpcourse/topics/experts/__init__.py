"""Mixture of experts and expert parallelism (notebook 12): experts spread over the ranks of a group.

  models    the single-process layer (router, top-k with a capacity, Switch Transformer's
            load-balancing loss) written out with loops, and a dense MLP of the same FLOPs
  runs      run a learner's expert-parallel layer on ranks, forward and backward; plain results back
  checks    verdicts for test cells: routing rules, values and gradients against one process, and
            the all-to-alls of each direction
  pictures  the load of each expert and the dropped tokens of a router on a skewed input
(the bytes of expert parallelism's all-to-alls per step are in topics.sequence.costs, next to the
other ways to split a long-context model)
"""
