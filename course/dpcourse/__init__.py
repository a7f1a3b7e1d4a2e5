"""Helper library of the distributed-training course: launch ranks, check results, draw pictures.

Sub-packages by role (each module's docstring names the notebooks that use it):
  runtime/   start ranks and run inside one (launch, the torchrun driver, backend choice, timeouts)
  comm/      what ranks said to each other (the recorder, per-call records, traffic)
  checks/    comparisons for test cells: one message style, one tolerance table
  reference/ yardsticks computed independently (float64 gradients, single-process training, splits)
  toys/      generated data and small models
  viz/       rank colours, widgets, timelines, curves
  topics/    tools of one subject: data_parallel, collectives, ddp, pipeline, ...
"""

from dpcourse.runtime.backend import rank_device, resolve_backend
from dpcourse.runtime.failures import LaunchError
from dpcourse.runtime.launcher import launch

__all__ = ["launch", "resolve_backend", "rank_device", "LaunchError"]
