"""Hybrid parallelism (notebook 09): data x tensor and data x pipeline on one grid of ranks.

  grid      the Grid (sizes, coordinates, a process group per axis) and init_device_mesh's layout,
            torch.arange(N).view(dp, pp, tp), which every runner builds its grids from
  models    the residual-MLP model split over tp (the course's DTensor layers) and the Linear stack
            cut into stages, both float64 from a seed
  pipeline  a GPipe step whose messages are differentiable send and receive operators
  runs      run a learner's grid, hybrid steps and planner on ranks; group creation watched
  checks    verdicts: grids against init_device_mesh, training against one process, bytes per group
  traffic   bytes per rank and step on each group: the formulas, and tables of recorded runs
  costs     the alpha-beta cost model of a layout (time, memory) and model and cluster presets
  pictures  the grid drawn from a learner's own groups; the planner widget
  realapi   torch's parallelize_module + fully_shard on a (dp, tp) DeviceMesh next to a learner's step
  bench     step times of layouts interleaved on 4 ranks, and the cost model calibrated here

It builds on two earlier chapters' subjects, as the notebook does: notebook 08's tensor-parallel
layers and models (topics.tensor.layers, topics.tensor.models, and topics.tensor.realapi's
parallelize_module recipe) and notebook 07's pipeline stages (topics.pipeline.stages). It uses none of
their machinery (runs, checks, benches, costs, measurements: tests/library/test_dpcourse_layers.py).
"""
