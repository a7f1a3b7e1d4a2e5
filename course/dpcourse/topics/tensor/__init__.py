"""Tensor parallelism (notebooks 08 and 09): each weight matrix split over the ranks of a group.

  models    the unsharded reference modules (a Linear, a transformer MLP, causal self-attention),
            built from a seed, that every rank and every test cell rebuild identically
  shards    which slice of a full weight a rank holds (column- and row-parallel layouts)
  runs      run a learner's operator or module on ranks under the recorder; plain results back
  checks    verdicts for test cells: values against the unsharded float64 module, collectives
  layers    the course's own tensor-parallel layers on a DeviceMesh (DTensor placements), which
            notebook 09 builds its hybrid data x tensor parallelism on
  realapi   torch's `parallelize_module` (ColwiseParallel / RowwiseParallel) on the same model
  costs     bytes per layer of tensor and data parallelism, formulas next to measurements
  pictures  which slice of each weight lives on which rank, coloured by rank
  bench     step times of two tensor-parallel MLPs, interleaved in one run
"""
