"""Helper library of the distributed-training course: launch ranks, check results, draw pictures.

Sub-packages by role (each module's docstring names the notebooks that use it):
  backend    which backend a launch uses and which device a rank's tensors belong on
  runtime/   start ranks and run inside one (launch, the torchrun driver, timeouts)
  grading/   what runs inside a graded rank (the grader's warm interpreter, routed group, frames)
  comm/      what ranks said to each other (the recorder, per-call records, traffic)
  checks/    what every chapter's test cells share: one message style, one tolerance table
  reference/ yardsticks computed independently (float64 gradients, single-process training, splits)
  toys/      generated data and small models
  viz/       rank colours, widgets, timelines, curves
  topics/    tools of one subject: data_parallel, collectives, ddp, pipeline, ...
"""

from dpcourse.backend import rank_device, resolve_backend
from dpcourse.runtime.failures import LaunchError
from dpcourse.runtime.launcher import launch

__all__ = ["launch", "resolve_backend", "rank_device", "LaunchError"]
