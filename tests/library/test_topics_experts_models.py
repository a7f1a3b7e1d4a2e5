"""dpcourse.topics.experts: the single-process layer's routing rules and the routing check's messages."""

import math

import pytest
import torch

from dpcourse.topics.experts.checks import expect_routing
from dpcourse.topics.experts.models import ALPHA, aux_loss, capacity, choices, mixture, route, served
from markers import exercise

pytestmark = exercise("route_tokens", "expert_parallel_moe")


def test_capacity_is_served_first_choices_first_in_token_order():
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    # capacity 2: expert 0 takes tokens 0 and 1 (first choices); token 2's first choice is dropped; expert 1
    # takes token 3's first choice, then token 0's second; token 2's second choice (expert 1) is dropped
    assert served(experts, 2, 3).tolist() == [[True, True], [True, True], [False, False], [True, False]]
    assert capacity(6, 4, 1, 1.0) == 2 and capacity(8, 4, 2, 1.25) == 5


def test_the_load_balancing_loss_is_alpha_at_a_uniform_router_and_e_times_more_when_collapsed():
    uniform = torch.full((8, 4), 0.25, dtype=torch.float64)
    first = torch.arange(8).remainder(4).unsqueeze(1)
    assert math.isclose(float(aux_loss(uniform, first)), ALPHA)
    collapsed = torch.zeros(8, 4, dtype=torch.float64)
    collapsed[:, 2] = 1.0
    assert math.isclose(float(aux_loss(collapsed, torch.full((8, 1), 2))), ALPHA * 4)


def test_top2_gates_add_up_to_one_and_the_layer_is_what_its_rules_say():
    moe = mixture(d_model=4, d_hidden=6, n_experts=4, k=2, capacity_factor=0.5, seed=1, device="cpu")
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    probs, experts, gates = choices(moe.router(x), 2)
    assert torch.allclose(gates.sum(dim=1), torch.ones(6, dtype=torch.float64))
    out = route(moe, x)
    assert out["dropped"] == int((~out["kept"]).sum()) > 0
    y = torch.zeros_like(x)
    for t in range(6):
        for c in range(2):
            if out["kept"][t, c]:
                y[t] += out["gates"][t, c] * moe.experts[int(out["experts"][t, c])](x[t])
    assert torch.allclose(out["y"], y)


def reference_router(logits, k, capacity_factor):
    probs, experts, gates = choices(logits, k)
    kept = served(experts, capacity(logits.shape[0], logits.shape[1], k, capacity_factor), logits.shape[1])
    return experts, gates, kept, aux_loss(probs, experts)


def test_expect_routing_passes_the_rules_and_names_the_expert_and_capacity_of_a_wrong_choice():
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expect_routing(reference_router(logits, 2, 1.0), logits, 2, 1.0, "route")
    experts, gates, kept, aux = reference_router(logits, 2, 1.0)
    everything = torch.ones_like(kept)
    if not torch.equal(everything, kept):
        with pytest.raises(AssertionError, match=r"is kept, expected dropped.*capacity is C = ceil"):
            expect_routing((experts, gates, everything, aux), logits, 2, 1.0, "route")
    with pytest.raises(AssertionError, match="the factor E"):
        expect_routing((experts, gates, kept, aux / 4), logits, 2, 1.0, "route")
