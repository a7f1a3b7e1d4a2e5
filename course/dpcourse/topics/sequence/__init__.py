"""Sequence and context parallelism (notebook 12): one sequence split over the ranks of a group.

  models    the unsharded references: a transformer MLP block (sequence first), attention written
            out in float64 with a causal mask on global positions, and the two splits of a sequence
            (contiguous, and the load-balanced head-and-tail split)
  measure   what a rank holds, keeps and computes: peak memory of a call, bytes a LayerNorm keeps for
            backward, FLOPs before each message (torch's FlopCounterMode)
  runs      run a learner's sequence-parallel block or context-parallel attention on ranks; plain
            results, records and measurements back
  checks    verdicts for test cells: values against one process, messages, memory and work
  costs     activation memory per layer and bytes per step of TP + SP, ring attention and Ulysses,
            and a planner that picks among them for a long-context model on a cluster
  pictures  the ring of K/V blocks step by step, the causal work per rank, the bytes table
"""
