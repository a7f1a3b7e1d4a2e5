"""Pipeline parallelism (notebooks 07 and 09): a model split into stages, a runner that runs one
stage per rank and watches it, schedules as data, layer costs, and timelines.

  stages.py     Stage, split_model, make_stage, layer_stack, SlowLinear
  runner.py     PipelineCase, run_pipeline(_cases), StageWatch (times, activations held), by_stage
  schedules.py  gpipe_schedule, bubble_fraction, in_flight, check_schedule, simulate, idle_fraction
  costs.py      gpt_layer_flops, measure_layer_costs, plot_partition
  timeline.py   stage_timelines, plot_timeline, compare_timelines, timeline_slider
  compare.py    the same model under torch.distributed.pipelining (ScheduleGPipe / Schedule1F1B)
"""
