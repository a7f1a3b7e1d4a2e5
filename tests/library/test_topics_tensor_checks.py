"""dpcourse.topics.tensor.runs and checks: a correct tensor-parallel piece passes, known mistakes are named.

The correct pieces are the reference layers of the grader (dpgrader.tensor_parallelism.tuned); the
mistakes are small variations of them, written here.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dpcourse.topics.tensor.checks import (
    COLUMN,
    MLP,
    ROW,
    column_mistakes,
    expect_module,
    expect_operator,
    expect_training,
    f_semantics,
    g_semantics,
    gather_semantics,
    row_mistakes,
)
from dpcourse.topics.tensor.models import inputs
from dpcourse.topics.tensor.runs import run_module_cases, run_operator_cases, run_training
from dpgrader.tensor_parallelism import tuned as tp
from markers import exercise

GROUPS = [[0, 1], [2, 3]]
F_RULE = "f: the identity forward, one all-reduce of the gradient backward"


def operator_case(shape=(3, 4), grad_shape=None, groups=GROUPS, world=4):
    return dict(inputs=[inputs(shape, seed=r) for r in range(world)],
                grads=[inputs(grad_shape or shape, seed=10 + r) for r in range(world)], groups=groups,
                label="test case")


def f_on_the_world(x, group=None):
    return tp.copy_to_tp(x, None)


def g_that_also_reduces_backward(x, group=None):
    return tp.copy_to_tp(tp.reduce_from_tp(x, group), group)


def gather_that_sums_backward(x, group=None):
    return tp.gather_from_tp(tp.copy_to_tp(x, group), group)


@exercise("copy_to_tp", "reduce_from_tp", "gather_from_tp")
def test_the_reference_operators_pass_and_their_mistakes_are_named():
    case, gather_case = operator_case(), operator_case((3, 2), (3, 4))
    runs = run_operator_cases(tp.copy_to_tp, 4, [case], exercise="f")[0]
    expect_operator(runs, case, f_semantics(case, 4), "f", F_RULE)
    runs = run_operator_cases(tp.reduce_from_tp, 4, [case], exercise="g")[0]
    expect_operator(runs, case, g_semantics(case, 4), "g")
    runs = run_operator_cases(tp.gather_from_tp, 4, [gather_case], exercise="gather")[0]
    expect_operator(runs, gather_case, gather_semantics(gather_case, 4), "gather")

    runs = run_operator_cases(f_on_the_world, 4, [case], exercise="f")[0]
    with pytest.raises(AssertionError, match=r"ran on ranks \(0, 1, 2, 3\), expected its tensor-parallel "
                                             r"group \(0, 1\) -- the whole world"):
        expect_operator(runs, case, f_semantics(case, 4), "f", F_RULE)
    runs = run_operator_cases(tp.reduce_from_tp, 4, [case], exercise="f")[0]
    with pytest.raises(AssertionError, match=r"rank 0 issued all_reduce of 96 bytes on ranks \(0, 1\) in "
                                             r"forward, expected no communication \(f: the identity"):
        expect_operator(runs, case, f_semantics(case, 4), "f", F_RULE)
    runs = run_operator_cases(g_that_also_reduces_backward, 4, [case], exercise="g")[0]
    with pytest.raises(AssertionError, match="in backward, expected no communication"):
        expect_operator(runs, case, g_semantics(case, 4), "g")
    runs = run_operator_cases(gather_that_sums_backward, 4, [gather_case], exercise="gather")[0]
    with pytest.raises(AssertionError, match="in backward, expected no communication"):
        expect_operator(runs, gather_case, gather_semantics(gather_case, 4), "gather")


@exercise("copy_to_tp")
def test_a_wrong_value_is_explained_by_the_known_mistake_it_matches():
    case = operator_case()
    runs = run_operator_cases(tp.copy_to_tp, 4, [case], exercise="f")[0]
    expected = f_semantics(case, 4)
    expected["backward"] = [[] for _ in range(4)]          # look at the values only
    for run in runs:
        run.backward, run.input_grad = [], case["grads"][run.rank].double()
    with pytest.raises(AssertionError, match="it is this rank's own output gradient: backward must"):
        expect_operator(runs, case, expected, "f")


class ColumnWithoutF(tp.ColumnParallelLinear):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class ColumnSlicedByWorldRank(tp.ColumnParallelLinear):
    def __init__(self, linear, group=None, gather_output=False):
        super().__init__(linear, group, gather_output)
        rows = linear.out_features // dist.get_world_size(group)
        r = dist.get_rank() % (linear.out_features // rows)
        self.weight = nn.Parameter(linear.weight.detach()[r * rows:(r + 1) * rows].clone())


class RowWithBiasOnEveryRank(tp.RowParallelLinear):
    def forward(self, x):
        return tp.reduce_from_tp(F.linear(x, self.weight, self.bias), self.group)


def column_case(groups=None, **options):
    return dict(full=("linear", dict(in_features=8, out_features=12, seed=1)), options=options,
                x=inputs((5, 8), seed=2), dy=inputs((5, 12), seed=3),
                output="replicated" if options.get("gather_output") else "parallel", groups=groups, label="c")


@exercise("column_parallel_linear", "row_parallel_linear")
def test_layers_pass_and_layer_mistakes_are_named():
    case = column_case(GROUPS)
    expect_module(run_module_cases(tp.ColumnParallelLinear, 4, [case], exercise="c")[0], case, COLUMN, "c",
                  forward=[], backward=[("all_reduce", 5 * 8 * 8)], wrong=column_mistakes(case))
    runs = run_module_cases(ColumnWithoutF, 4, [case], exercise="c")[0]
    with pytest.raises(AssertionError, match=r"is f \(copy_to_tp\) missing\?"):
        expect_module(runs, case, COLUMN, "c", wrong=column_mistakes(case))
    shifted = column_case([[0, 2], [1, 3]])
    runs = run_module_cases(ColumnSlicedByWorldRank, 4, [shifted], exercise="c")[0]
    message = r"rank 1 \(rank 0 of 2 in its group\) holds weight .* the slice of group rank 1; "
    with pytest.raises(AssertionError, match=message):
        expect_module(runs, shifted, COLUMN, "c")
    row = dict(full=("linear", dict(in_features=8, out_features=6, seed=4)), options={},
               x=inputs((5, 8), seed=5), dy=inputs((5, 6), seed=6), input="parallel", groups=None, label="r")
    expect_module(run_module_cases(tp.RowParallelLinear, 2, [row], exercise="r")[0], row, ROW, "r",
                  forward=[("all_reduce", 5 * 6 * 8)], backward=[], wrong=row_mistakes(row))
    runs = run_module_cases(RowWithBiasOnEveryRank, 2, [row], exercise="r")[0]
    with pytest.raises(AssertionError, match="off by 1 x bias: the bias was added on every rank before"):
        expect_module(runs, row, ROW, "r", wrong=row_mistakes(row))


class MLPWithFrozenFc2(tp.TensorParallelMLP):
    def __init__(self, mlp, group=None):
        super().__init__(mlp, group)
        self.fc2.bias.requires_grad_(False)


@exercise("tensor_parallel_mlp", "tensor_parallel_attention")
def test_training_is_compared_slice_by_slice_with_the_unsharded_module():
    case = dict(full=("mlp", dict(d_model=8, d_hidden=16, seed=0)), groups=GROUPS, lr=0.2,
                batches=[(inputs((4, 8), seed=s), inputs((4, 8), seed=10 + s)) for s in range(3)], label="t")
    size = [("all_reduce", 4 * 8 * 8)]
    expect_training(run_training(tp.TensorParallelMLP, 4, case, exercise="t"), case, MLP, "t", forward=size,
                    backward=size)
    with pytest.raises(AssertionError, match=r"fc2.bias is .* \(it did not move at all"):
        expect_training(run_training(MLPWithFrozenFc2, 4, case, exercise="t"), case, MLP, "t")


@exercise("copy_to_tp", "reduce_from_tp", "gather_from_tp")
def test_a_learner_exception_names_the_exercise_the_case_and_the_rank():
    from dpcourse import LaunchError

    def not_written(x, group=None):
        raise NotImplementedError()

    with pytest.raises(LaunchError, match=r"raised NotImplementedError: f \(test case\)"):
        run_operator_cases(not_written, 4, [operator_case()], exercise="f")  # the same on every rank: no race

    def sliced_by_world_rank(x, group=None):
        return x.chunk(dist.get_world_size(group), dim=-1)[dist.get_rank()]

    both = (r"f \(test case\) raised on the ranks of group \[2, 3\] whose world rank is 2 or more: "
            r"IndexError: .* -- a group of 2 has slices 0 to 1: was the index the world rank")
    with pytest.raises(LaunchError, match=both):
        run_operator_cases(sliced_by_world_rank, 4, [operator_case()], exercise="f")


@exercise("copy_to_tp", "reduce_from_tp", "gather_from_tp")
def test_output_gradients_reach_only_outputs_that_require_grad():
    def detached(x, group=None):
        return x.detach() * 1

    case = operator_case(groups=None, world=2)
    runs = run_operator_cases(detached, 2, [case], exercise="f")[0]
    assert all(run.no_grad and run.input_grad is None for run in runs)
    with pytest.raises(AssertionError, match="output does not require grad"):
        expect_operator(runs, case, f_semantics(case, 2), "f")
    assert torch.equal(runs[0].output, case["inputs"][0])


class AttentionWithAllHeadsOnEveryRank(tp.TensorParallelAttention):
    def __init__(self, attention, group=None):
        super().__init__(attention, group)
        self.heads = attention.n_heads


@exercise("tensor_parallel_attention")
def test_attention_with_every_head_on_every_rank_is_named():
    from dpcourse.topics.tensor.checks import ATTENTION, attention_mistakes

    case = dict(full=("attention", dict(d_model=8, n_heads=4, seed=0)), x=inputs((2, 3, 8), seed=1),
                dy=inputs((2, 3, 8), seed=2), groups=None, label="a")
    runs = run_module_cases(tp.TensorParallelAttention, 2, [case], exercise="a")[0]
    expect_module(runs, case, ATTENTION, "a", wrong=attention_mistakes(case))
    runs = run_module_cases(AttentionWithAllHeadsOnEveryRank, 2, [case], exercise="a")[0]
    with pytest.raises(AssertionError, match="each rank computed all 4 heads on its slice of qkv"):
        expect_module(runs, case, ATTENTION, "a", wrong=attention_mistakes(case))


class _InPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def f_reducing_in_place(x, group=None):
    return _InPlace.apply(x, group)


def test_a_backward_that_changes_the_gradient_it_was_handed_is_named():
    case = operator_case()
    runs = run_operator_cases(f_reducing_in_place, 4, [case], exercise="f")[0]
    with pytest.raises(AssertionError, match=r"f: rank 0's backward changed the gradient it was handed, in "
                                             r"place"):
        expect_operator(runs, case, f_semantics(case, 4), "f", F_RULE)


class ColumnOfViews(tp.ColumnParallelLinear):
    """Right values, but its weight is a view of the unsharded layer's."""

    def __init__(self, linear, group=None, gather_output=False):
        super().__init__(linear, group, gather_output)
        n, r = dist.get_world_size(group), dist.get_rank(group)
        rows = linear.out_features // n
        self.weight = nn.Parameter(linear.weight.data[r * rows:(r + 1) * rows])


def test_a_slice_that_is_a_view_of_the_unsharded_weight_is_named():
    case = dict(column_case(gather_output=False), output="parallel")
    runs = run_module_cases(ColumnOfViews, 2, [case], exercise="column")[0]
    with pytest.raises(AssertionError, match=r"rank 0's weight is a view of the unsharded module's "
                                             r"parameter, not a copy: it keeps all 96 values of the full "
                                             r"tensor alive for its 48"):
        expect_module(runs, case, COLUMN, "column")


class ColumnWithoutAReason(tp.ColumnParallelLinear):
    def __init__(self, linear, group=None, gather_output=False):
        if linear.out_features % dist.get_world_size(group):
            raise ValueError("cannot split")
        super().__init__(linear, group, gather_output)


class ColumnDroppingTheRemainder(nn.Module):
    def __init__(self, linear, group=None, gather_output=False):
        super().__init__()
        rows = linear.out_features // dist.get_world_size(group)
        self.weight = nn.Parameter(linear.weight.detach()[:rows].clone())


def test_a_refusal_must_be_a_value_error_that_gives_the_numbers():
    from dpcourse.topics.tensor.checks import expect_refusal

    ten = dict(full=("linear", dict(in_features=8, out_features=10, seed=1)), options={}, groups=None,
               refuse=True, label="10 on 4")
    numbers = {"output features": 10, "ranks": 4}
    for cls, message in ((tp.ColumnParallelLinear, None),
                         (ColumnWithoutAReason, r"a ValueError, but its message should say why, giving "
                                                r"the numbers 10 \(output features\) and 4 \(ranks\) "
                                                r"\(the rule\)"),
                         (ColumnDroppingTheRemainder, r"rank 0 built the module: expected a ValueError "
                                                      r"\(the rule\)")):
        runs = run_module_cases(cls, 4, [ten], exercise="column")[0]
        if message is None:
            expect_refusal(runs, "column", numbers, "the rule")
        else:
            with pytest.raises(AssertionError, match=message):
                expect_refusal(runs, "column", numbers, "the rule")


def test_a_block_on_a_broken_layer_sends_the_learner_back_to_the_layer():
    from dpcourse.topics.tensor.checks import built_on

    with pytest.raises(AssertionError, match=r"the MLP is built on your ColumnParallelLinear \(exercise 4\), "
                                             r"which fails its own test: fix ColumnParallelLinear first"):
        with built_on("the MLP", copy_to_tp=tp.copy_to_tp, ColumnParallelLinear=ColumnOfViews):
            raise AssertionError("the MLP's own failure")
    with pytest.raises(AssertionError, match="^the MLP's own failure$"):  # the layers pass: its own message
        with built_on("the MLP", copy_to_tp=tp.copy_to_tp, RowParallelLinear=tp.RowParallelLinear):
            raise AssertionError("the MLP's own failure")


class AttentionHeadsOverTheWorld(tp.TensorParallelAttention):
    def __init__(self, attention, group=None):
        super().__init__(attention, group)
        self.heads = attention.n_heads // dist.get_world_size()


def test_a_training_forward_wrong_from_the_start_is_explained_by_its_first_output():
    from dpcourse.topics.tensor.checks import ATTENTION, attention_mistakes

    case = dict(full=("attention", dict(d_model=8, n_heads=4, seed=21)), groups=GROUPS, lr=0.2,
                batches=[(inputs((2, 3, 8), seed=22 + s), inputs((2, 3, 8), seed=32 + s)) for s in range(2)],
                label="training")
    runs = run_training(AttentionHeadsOverTheWorld, 4, case, exercise="attention")
    with pytest.raises(AssertionError, match=r"the loss of step 0, before any update, is .* the forward "
                                             r"already differs from the unsharded module's -- each rank "
                                             r"computed 1 head\(s\), n_heads / N with N the world's 4 ranks"):
        expect_training(runs, case, ATTENTION, "attention", wrong=attention_mistakes)
    runs = run_training(tp.TensorParallelAttention, 4, case, exercise="attention")
    assert [run.rank for run in runs] == [0, 1, 2, 3]  # every rank is judged, not rank 0 alone
    expect_training(runs, case, ATTENTION, "attention", wrong=attention_mistakes)
