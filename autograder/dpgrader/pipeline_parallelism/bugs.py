"""Planted bugs for 07_pipeline_parallelism: each must lose the listed cells with a message saying why.

Four or more per exercise, each a mistake a learner makes: cutting by layer count or greedily,
not checking the stage count, returning only the inner cuts; a received activation without
requires_grad_(), neighbours computed from the rank, a gradient ignored, a receive posted
before the send it waits on (deadlock), 0.0 instead of None on the other stages; no loss / m,
backwards in reverse order, `split` instead of `tensor_split`, one receive buffer for every
micro-batch, the loss returned by every stage; torch's warm-up count, no min(., m), backward
before forward in the steady state, the stage index reversed; blocking sends (deadlock), no
loss / m, retain_graph=True (activations never freed), backwards paired with the most recent
forward, finished micro-batches left in the dicts, every send request kept until the end.
Each rule the text states ("None on the others", "keep each micro-batch's input and output
until its backward, and no longer", "wait for a send before the next one in its direction")
has one.
"""

from dpgrader.planted import Bug

PARTITION = [
    Bug("partition_layers", "equal_layer_counts", source='''
def partition_layers(layer_costs, n_stages):
    """Boundaries [0, ..., len(layer_costs)] of stages whose slowest stage is as cheap as possible."""
    n = len(layer_costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} layers into {n_stages} stages")
    return [round(s * n / n_stages) for s in range(n_stages + 1)]
''', loses={"test_partition_layers_basic": "whose slowest stage costs 24; the best partition's slowest stage "
                                            "costs 17"}),
    Bug("partition_layers", "greedy_fill_to_the_average", source='''
def partition_layers(layer_costs, n_stages):
    """Boundaries [0, ..., len(layer_costs)] of stages whose slowest stage is as cheap as possible."""
    n = len(layer_costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} layers into {n_stages} stages")
    target = sum(layer_costs) / n_stages
    cuts, total = [0], 0
    for i, cost in enumerate(layer_costs):
        if total + cost > target and i > cuts[-1] and len(cuts) < n_stages:
            cuts.append(i)
            total = 0
        total += cost
    return cuts + [n]
''', loses={"test_partition_layers_edge_cases": "returned [0, 1, 3, 4]: expected 5 boundaries from 0 to 4"},
        keeps=["test_partition_layers_basic"]),
    Bug("partition_layers", "no_check_of_the_stage_count",
        patch=[('    if not 1 <= n_stages <= n:\n        raise ValueError(f"cannot split {n} layers into '
                '{n_stages} stages of at least one layer each")\n', "")],
        loses={"test_partition_layers_edge_cases":
               "partition_layers([1, 2, 3], 4) returned [0, 0, 0, 0, 3]: it should raise a ValueError"},
        keeps=["test_partition_layers_basic"]),
    Bug("partition_layers", "returns_only_the_inner_cuts",
        patch=[("return cuts[::-1]", "return cuts[::-1][1:-1]")],
        loses={"test_partition_layers_basic": "returned [3]: expected 3 boundaries from 0 to 6"}),
]

NAIVE = [
    Bug("naive_pipeline_step", "received_activation_without_requires_grad",
        patch=[("        x.requires_grad_()\n", "")],
        loses={"test_naive_pipeline_step_basic": "a received activation must get requires_grad_()"}),
    Bug("naive_pipeline_step", "neighbours_from_the_rank",
        patch=[("dist.recv(x, stage.prev)", "dist.recv(x, dist.get_rank() - 1)"),
               ("dist.send(out.detach(), stage.next)", "dist.send(out.detach(), dist.get_rank() + 1)"),
               ("dist.recv(grad, stage.next)", "dist.recv(grad, dist.get_rank() + 1)"),
               ("dist.send(x.grad, stage.prev)", "dist.send(x.grad, dist.get_rank() - 1)")],
        loses={"test_naive_pipeline_step_edge_cases":
               "recv from rank -1: there is no rank -1 (the ranks are 0 to 2) -- stage 1 runs on rank 0; its "
               "neighbours are stage.prev = 2 and stage.next = 1 (world ranks): name them by stage.prev and "
               "stage.next, not rank - 1 and rank + 1"},
        keeps=["test_naive_pipeline_step_basic"]),
    Bug("naive_pipeline_step", "received_gradient_ignored",
        patch=[("out.backward(grad)", "out.backward(torch.ones_like(out))")],
        loses={"test_naive_pipeline_step_basic": "stage 0 (rank 0): the gradient of 0.weight is"}),
    Bug("naive_pipeline_step", "zero_instead_of_none_on_the_other_stages",
        patch=[("return loss.item() if stage.is_last else None", "return loss.item() if stage.is_last else 0.0")],
        loses={"test_naive_pipeline_step_basic": "stage 0 (rank 0) returned 0.0: every stage but the last must "
                                                 "return None"}),
    Bug("naive_pipeline_step", "waits_for_the_gradient_before_sending_the_activation",
        patch=[("        dist.send(out.detach(), stage.next)\n        grad = torch.empty_like(out)\n"
                "        dist.recv(grad, stage.next)\n",
                "        grad = torch.empty_like(out)\n        dist.recv(grad, stage.next)\n"
                "        dist.send(out.detach(), stage.next)\n")],
        loses={"test_naive_pipeline_step_basic":
               "waiting to receive the gradient of micro-batch 0 (its message 1 from stage 1)"}),
]

GPIPE = [
    Bug("gpipe_step", "gpipe_loss_not_divided_by_m",
        patch=[("out = loss_fn(out, ys[i]) / n_micro", "out = loss_fn(out, ys[i])")],
        loses={"test_gpipe_step_basic": "4x the expected value: divide each micro-batch's loss by m = 4"}),
    Bug("gpipe_step", "backwards_in_reverse_order",
        patch=[("    for i in range(n_micro):\n        if stage.is_last:\n            outputs[i].backward()",
                "    for i in reversed(range(n_micro)):\n        if stage.is_last:\n"
                "            outputs[i].backward()")],
        loses={"test_gpipe_step_memory_and_order": "step 6 is B4 where B0 was expected"},
        keeps=["test_gpipe_step_basic"]),
    Bug("gpipe_step", "split_instead_of_tensor_split",
        patch=[("xs, ys = batch.tensor_split(n_micro), targets.tensor_split(n_micro)",
                "xs, ys = batch.split(n_micro), targets.split(n_micro)")],
        loses={"test_gpipe_step_basic": "after the forward of micro-batch 1: IndexError"}),
    Bug("gpipe_step", "the_loss_returned_by_every_stage",
        patch=[("    return total if stage.is_last else None", "    return total")],
        loses={"test_gpipe_step_basic": "stage 0 (rank 0) returned 0.0: every stage but the last must return "
                                        "None"}),
    Bug("gpipe_step", "one_receive_buffer_for_every_micro_batch",
        patch=[("    inputs, outputs, total = [], [], 0.0\n",
                "    inputs, outputs, total = [], [], 0.0\n"
                "    buffer = torch.empty(len(xs[0]), stage.in_features, dtype=stage.dtype, "
                "device=stage.device)\n"),
               ("            x = torch.empty(len(xs[i]), stage.in_features, dtype=stage.dtype, "
                "device=stage.device)\n            dist.recv(x, stage.prev)\n"
                "            x.requires_grad_()\n",
                "            dist.recv(buffer, stage.prev)\n"
                "            x = buffer.detach().requires_grad_()\n")],
        loses={"test_gpipe_step_memory_and_order": "stage 2 (rank 0): the gradient of 2.weight is"},
        keeps=["test_gpipe_step_basic"]),
]

ONE_F_ONE_B = [
    Bug("one_f_one_b", "warm_up_of_p_minus_s",
        patch=[("warmup = min(n_stages - stage - 1, n_micro)", "warmup = min(n_stages - stage, n_micro)")],
        loses={"test_one_f_one_b_basic":
               "one_f_one_b(2, 3, 0) returned F0 F1 F2 B0 B1 B2, expected F0 F1 B0 F2 B1 B2: step 3 is F2 where "
               "B0 was expected (warm-up: min(p - s - 1, m) = 1 forward(s))"}),
    Bug("one_f_one_b", "warm_up_not_capped_by_m",
        patch=[("warmup = min(n_stages - stage - 1, n_micro)", "warmup = n_stages - stage - 1")],
        loses={"test_one_f_one_b_edge_cases": "one_f_one_b(4, 2, 0) returned F0 F1 F2 B-1 B0 B1, expected F0 F1 "
                                              "B0 B1: step 3 is F2 where B0 was expected"},
        keeps=["test_one_f_one_b_basic"]),
    Bug("one_f_one_b", "backward_before_forward_in_the_steady_state",
        patch=[('order += [("F", warmup + i), ("B", i)]', 'order += [("B", i), ("F", warmup + i)]')],
        loses={"test_one_f_one_b_basic": "one_f_one_b(2, 3, 0) returned F0 B0 F1 B1 F2 B2, expected F0 F1 B0 F2 "
                                         "B1 B2: step 2 is B0 where F1 was expected"}),
    Bug("one_f_one_b", "stage_index_reversed",
        patch=[("warmup = min(n_stages - stage - 1, n_micro)", "warmup = min(stage, n_micro)")],
        loses={"test_one_f_one_b_basic": "one_f_one_b(2, 3, 0) returned F0 B0 F1 B1 F2 B2"}),
]

RUN_SCHEDULE = [
    Bug("run_schedule", "blocking_sends",
        patch=[('send("activation", out.detach(), stage.next)', "dist.send(out.detach(), stage.next)"),
               ('send("gradient", x.grad, stage.prev)', "dist.send(x.grad, stage.prev)")],
        loses={"test_run_schedule_basic": "waiting to send the gradient of micro-batch 0 (its message 1 to "
                                          "stage 0)"}),
    Bug("run_schedule", "schedule_loss_not_divided_by_m",
        patch=[("out = loss_fn(out, ys[i]) / n_micro", "out = loss_fn(out, ys[i])")],
        loses={"test_run_schedule_basic": "3x the expected value: divide each micro-batch's loss by m = 3"}),
    Bug("run_schedule", "retain_graph_keeps_every_activation",
        patch=[("out.backward()", "out.backward(retain_graph=True)"),
               ("out.backward(grad)", "out.backward(grad, retain_graph=True)")],
        loses={"test_run_schedule_memory":
               "stage 0 (rank 0) held the activations of 5 micro-batch(es) at once, expected at most "
               "4"},
        keeps=["test_run_schedule_basic"]),
    Bug("run_schedule", "a_copy_of_every_output_kept",  # new memory: no tensor of autograd's, only measured
        patch=[("inputs, outputs, total = {}, {}, 0.0", "inputs, outputs, total, log = {}, {}, 0.0, []"),
               ("inputs[i], outputs[i] = x, out", "inputs[i], outputs[i] = x, out\n            log.append(out.detach().clone())")],
        loses={"test_run_schedule_memory": "MiB more than that -- a micro-batch's activations are still held "
                                           "after its backward"},
        keeps=["test_run_schedule_basic"]),
    Bug("run_schedule", "backward_of_the_latest_forward",
        patch=[("x, out = inputs.pop(i), outputs.pop(i)",
                "x, out = inputs.popitem()[1], outputs.popitem()[1]")],
        loses={"test_run_schedule_basic": "the gradient of"}),
    Bug("run_schedule", "finished_micro_batches_left_in_the_dicts",
        patch=[("x, out = inputs.pop(i), outputs.pop(i)", "x, out = inputs[i], outputs[i]")],
        loses={"test_run_schedule_memory":
               "when the backward of micro-batch 1 started, micro-batch 0, whose backward had already run, "
               "still had its output alive -- your code still refers to its output tensor"},
        keeps=["test_run_schedule_basic"]),
    Bug("run_schedule", "every_send_request_kept_until_the_end", source='''
def run_schedule(stage, batch, targets, loss_fn, schedule):
    """Run this stage's ordered ("F", i) / ("B", i) actions; sends never block; the loss on the last stage."""
    n_micro = sum(1 for kind, _ in schedule if kind == "F")
    xs, ys = batch.tensor_split(n_micro), targets.tensor_split(n_micro)
    inputs, outputs, sends, total = {}, {}, [], 0.0
    for kind, i in schedule:
        if kind == "F":
            if stage.is_first:
                x = xs[i]
            else:
                x = torch.empty(len(xs[i]), stage.in_features, dtype=stage.dtype, device=stage.device)
                dist.recv(x, stage.prev)
                x.requires_grad_()
            out = stage.module(x)
            if stage.is_last:
                out = loss_fn(out, ys[i]) / n_micro
                total += out.item()
            else:
                sends.append(dist.isend(out.detach(), stage.next))
            inputs[i], outputs[i] = x, out
        else:
            x, out = inputs.pop(i), outputs.pop(i)
            if stage.is_last:
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, stage.next)
                out.backward(grad)
            if not stage.is_first:
                sends.append(dist.isend(x.grad, stage.prev))
    for work in sends:
        work.wait()
    return total if stage.is_last else None
''', loses={"test_run_schedule_memory":
              "still had its output alive -- no name of yours holds it, but something shares its memory: the "
              "request of a dist.isend not waited for yet"},
        keeps=["test_run_schedule_basic"]),
]

BUGS = PARTITION + NAIVE + GPIPE + ONE_F_ONE_B + RUN_SCHEDULE
