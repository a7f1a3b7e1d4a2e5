"""PyTorch's own pipeline schedules, run with the same arguments as the notebook's step functions.

    step = partial(torch_schedule_step, schedule="1F1B")
    calls = run_pipeline(step, PipelineCase(..., n_micro=4), exercise="Schedule1F1B")

`torch_schedule_step(stage, batch, targets, loss_fn, n_micro, schedule)` wraps the stage's
module in `torch.distributed.pipelining.PipelineStage` and runs one step of
`ScheduleGPipe` or `Schedule1F1B` (torch/distributed/pipelining/schedules.py), so the
runner records it exactly like a learner's step: its messages, its gradients, its timeline
and the activations it held. Torch splits the batch with `tensor_split` and, with
`scale_grads=True` (its default), divides the accumulated gradients by m after the last
backward: the same gradients as dividing each micro-batch's loss by m. Torch's first step
also infers shapes (a forward and messages of its own) and lets the stages vote on static
or dynamic shapes, so a warm-up step runs first and only the second step is recorded.

Constraints of torch's single-stage schedules (checked in torch 2.13): stage s runs on rank s
of the group (so the case's placement must be the default), and Schedule1F1B refuses
m < p ("Number of microbatches ... must be greater than or equal to the number of stages").
With manually built stages, as here, nothing is printed to stderr; the tracer frontend
(`pipeline()` + `SplitPoint`) prints a FutureWarning.

Used by notebook 07 (the real API next to yours) and its benchmark.
"""

from dpcourse.topics.pipeline.runner import restart_watch

SCHEDULES = ("GPipe", "1F1B")


def torch_schedule_step(stage, batch, targets, loss_fn, n_micro, schedule="1F1B", warmup=1):
    """One step of torch's ScheduleGPipe or Schedule1F1B on this rank's stage; the loss on the last stage.

    `warmup` steps run first and are forgotten (gradients zeroed, the runner's records restarted):
    torch's first step also exchanges shapes and votes between stages.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if stage.ranks != tuple(range(stage.n_stages)):
        raise ValueError("torch's single-stage schedules put stage s on rank s: use the default placement")
    kind = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule]
    pipe_stage = PipelineStage(stage.module, stage.index, stage.n_stages, stage.device)
    runner = kind(pipe_stage, n_microbatches=n_micro, loss_fn=loss_fn)
    for _ in range(warmup):
        _one_step(runner, stage, batch, targets)
        stage.module.zero_grad(set_to_none=True)
    restart_watch()
    losses = _one_step(runner, stage, batch, targets)
    return sum(loss.item() for loss in losses) / n_micro if stage.is_last else None


def _one_step(runner, stage, batch, targets):
    losses = []
    if stage.is_first and stage.is_last:
        runner.step(batch, target=targets, losses=losses)
    elif stage.is_first:
        runner.step(batch)
    elif stage.is_last:
        runner.step(target=targets, losses=losses)
    else:
        runner.step()
    return losses
