"""A GPipe step whose messages are autograd operators: what notebook 09 runs inside each replica.

    loss = gpipe(stage, batch, targets, loss_fn, n_micro)   # same contract as notebook 07's gpipe_step

Notebook 07 has you write the pipeline step as two loops of explicit sends and receives. This
version is written another way, so that it documents the schedule without handing out that
exercise: the stage boundary is a pair of differentiable point-to-point operators, the way
Megatron's f and g make tensor parallelism's communication part of autograd (notebook 08):
  * `receive_activation` (stages after the first): forward, a recv of the previous stage's
    activation; backward, a send of its gradient back to that stage;
  * `send_activation` (stages before the last): forward, a send of the activation to the next
    stage, returning an empty "token"; backward, a recv of the gradient from the next stage.
A step is then m forwards, micro-batch by micro-batch, each ending in its (scaled) loss or its
token, and m backwards through those ends in the same order 0, 1, ..., m - 1 (as
ScheduleGPipe): calling backward on a token is what waits for the gradient from downstream.
Each operator carries an empty tensor that requires grad (an "anchor"), so its backward runs
even on a stage whose layers have no parameters.

Messages: per micro-batch, one activation to the next stage and one gradient to the previous
one, rows x width values each: the traffic notebook 07 grades. Each micro-batch's loss is
divided by m, so the gradients are the batch's. Used by notebook 09 (its data x pipeline
exercise and demos).
"""

import torch
import torch.distributed as dist
from torch.autograd import Function


class _ReceiveActivation(Function):
    @staticmethod
    def forward(ctx, anchor, shape, dtype, source):
        ctx.source = source
        buffer = torch.empty(shape, dtype=dtype, device=anchor.device)
        dist.recv(buffer, source)
        return buffer

    @staticmethod
    def backward(ctx, grad):
        dist.send(grad.contiguous(), ctx.source)
        return None, None, None, None


class _SendActivation(Function):
    @staticmethod
    def forward(ctx, anchor, h, destination):
        ctx.destination, ctx.shape, ctx.dtype, ctx.device = destination, h.shape, h.dtype, h.device
        dist.send(h.detach().contiguous(), destination)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad):
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        dist.recv(grad, ctx.destination)
        return None, grad, None


def _anchor(stage):
    return torch.empty(0, dtype=stage.dtype, device=stage.device, requires_grad=True)


def receive_activation(stage, rows):
    """This stage's input for `rows` rows, received from stage.prev; its gradient goes back there."""
    return _ReceiveActivation.apply(_anchor(stage), (rows, stage.in_features), stage.dtype, stage.prev)


def send_activation(stage, h):
    """Send h to stage.next; returns a token whose backward receives h's gradient from there."""
    return _SendActivation.apply(_anchor(stage), h, stage.next)


def gpipe(stage, batch, targets, loss_fn, n_micro):
    """One GPipe step on this rank's stage (notebook 07's contract): the batch's loss on the last
    stage, None elsewhere; afterwards the stage's parameters hold the batch's gradients."""
    if n_micro < 1 or len(batch) % n_micro:
        raise ValueError(f"a batch of {len(batch)} rows does not split into {n_micro} equal micro-batches")
    xs, ys = batch.tensor_split(n_micro), targets.tensor_split(n_micro)
    ends, total = [], 0.0
    for k in range(n_micro):
        x = xs[k] if stage.is_first else receive_activation(stage, len(xs[k]))
        h = stage.module(x)
        if stage.is_last:
            end = loss_fn(h, ys[k]) / n_micro
            total += end.item()
        else:
            end = send_activation(stage, h)
        ends.append(end)
    for end in ends:  # backwards in micro-batch order, as ScheduleGPipe
        if stage.is_last:
            end.backward()
        else:
            end.backward(torch.empty(0, dtype=stage.dtype, device=stage.device))
    return total if stage.is_last else None
