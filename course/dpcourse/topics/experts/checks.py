"""Verdicts for notebook 12's mixture-of-experts test cells, against the single-process layer.

    expect_routing(route_tokens(logits, 2, 1.0), logits, 2, 1.0, "route_tokens(logits, 2, 1.0)")
    expect_aux_gradient(route_tokens, [(logits, 2, 1.0)])   # aux_loss differentiable through P
    expect_moe(runs, case, "ExpertParallelMoE", route_tokens=route_tokens)

Why a module: a router is right when every token goes to its k most probable experts with the
right gates, when each expert takes exactly the token-choices its capacity allows in the stated
order, and when the load-balancing loss is Switch Transformer's formula; an expert-parallel layer
is right when every rank's output, loss, dropped count and gradients are what the single-process
layer computes on that rank's tokens, and when only the kept tokens travel, in two all-to-alls
each way. The references are `models.route` (plain loops, float64) and autograd on it, in the
test cell's process. Messages name the token, the expert, the rank holding it, and the rule.
"""

import torch

from dpcourse.checks.core import TOLERANCES, describe
from dpcourse.checks.tensors import close, expect_collectives, expect_tensor
from dpcourse.comm.cases import members_of
from dpcourse.runtime.launcher import launch
from dpcourse.runtime.timeouts import TIMEOUTS
from dpcourse.topics.experts.models import ALPHA, aux_loss, capacity, choices, mixture, route, served

F64 = 8
ALL_TO_ALL = ("all_to_all_single", "all_to_all")
COUNTS = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor")


# --------------------------------------------------------------------------- route_tokens

def expect_routing(got, logits, k, capacity_factor, what, alpha=ALPHA):
    """got = route_tokens(logits, k, capacity_factor): (experts, gates, kept, aux_loss) as the rules say."""
    if not (isinstance(got, (tuple, list)) and len(got) == 4):
        raise AssertionError(f"{what} should return (experts, gates, kept, aux_loss), got "
                             f"{describe(got)[:200]}")
    experts, gates, kept, aux = got
    tokens, n_experts = logits.shape
    probs, want_experts, want_gates = choices(logits.double(), k)
    for name, value in (("experts", experts), ("gates", gates), ("kept", kept), ("aux_loss", aux)):
        if not isinstance(value, torch.Tensor):
            raise AssertionError(f"{what}: {name} should be a tensor, got {type(value).__name__}")
    if experts.shape != (tokens, k) or experts.dtype != torch.int64:
        raise AssertionError(f"{what}: experts should be an int64 tensor of shape ({tokens}, {k}) (each "
                             f"token's k experts, most probable first), got {experts.dtype} "
                             f"{tuple(experts.shape)}")
    if not torch.equal(experts.cpu(), want_experts):
        t = _first_row(experts.cpu() != want_experts)
        raise AssertionError(f"{what}: token {t} chose experts {experts[t].tolist()}, expected "
                             f"{want_experts[t].tolist()}: the {k} largest probabilities, most probable "
                             "first "
                             f"(softmax(logits).topk(k)), p = {[round(p, 4) for p in probs[t].tolist()]}")
    wrong_gates = []
    if k > 1:
        wrong_gates.append((probs.gather(1, want_experts), "the probabilities themselves: with k = 2 the two "
                                                           "gates are divided by their sum (they add up to "
                                                           "1)"))
    else:
        wrong_gates.append((torch.ones_like(want_gates), "all ones: the gate is the chosen expert's "
                                                         "probability"))
    expect_tensor(gates, want_gates, f"{what}: gates", wrong_gates)
    cap = capacity(tokens, n_experts, k, capacity_factor)
    want_kept = served(want_experts, cap, n_experts)
    if kept.shape != want_kept.shape or kept.dtype != torch.bool:
        raise AssertionError(f"{what}: kept should be a bool tensor of shape ({tokens}, {k}), got "
                             f"{kept.dtype} {tuple(kept.shape)}")
    if not torch.equal(kept.cpu(), want_kept):
        message = _kept_message(kept.cpu(), want_kept, want_experts, cap, tokens, k, n_experts,
                                capacity_factor)
        raise AssertionError(f"{what}: {message}")
    want_aux = aux_loss(probs, want_experts, alpha)
    wrong_aux = _aux_mistakes(probs, want_experts, want_kept, alpha)
    expect_tensor(aux.reshape(()), want_aux, f"{what}: aux_loss (alpha · E · sum_i f_i · P_i)", wrong_aux)


def routing_label(logits, k, capacity_factor):
    return (f"route_tokens(logits of {logits.shape[0]} tokens x {logits.shape[1]} experts, k={k}, "
            f"capacity_factor={capacity_factor})")


def aux_loss_gradients(route_tokens, cases):
    """Inside a rank: for each case (logits, k, capacity_factor), route_tokens run on logits that require
    grad, and what its aux_loss gives back: {"requires_grad", "grad" (of aux_loss with respect to the
    logits, or None)} or {"error"}. The gradient must be taken where the learner's code runs: a value
    handed back to the test cell is plain, without its autograd graph."""
    reports = []
    for logits, k, capacity_factor in cases:
        x = logits.clone().requires_grad_()
        try:
            aux = route_tokens(x, k, capacity_factor)[3]
            if not (isinstance(aux, torch.Tensor) and aux.requires_grad):
                reports.append({"requires_grad": False})
                continue
            (grad,) = torch.autograd.grad(aux.sum(), x, allow_unused=True)
            reports.append({"requires_grad": True, "grad": grad})
        except Exception as exc:  # noqa: BLE001 - reported as the learner's error
            reports.append({"error": f"{type(exc).__name__}: {exc}"[:300]})
    return reports


def aux_gradient_reference(logits, k, alpha=ALPHA):
    """The gradient of alpha · E · sum_i f_i · P_i with respect to the logits (f_i, a count, has none)."""
    x = logits.double().clone().requires_grad_()
    probs, experts, _ = choices(x, k)
    (grad,) = torch.autograd.grad(aux_loss(probs, experts.detach(), alpha), x)
    return grad


NOT_DIFFERENTIABLE = ("aux_loss does not require grad when the logits do: it must be differentiable through "
                      "P_i, the mean over the tokens of softmax(logits)[:, i] -- compute it from the "
                      "probabilities, without .detach(), .item(), .tolist() or torch.no_grad() (only f_i, a "
                      "count, carries no gradient)")


def expect_aux_gradient(route_tokens, cases):
    """route_tokens' aux_loss is differentiable through P, with the right gradient: one launch of one rank
    runs every case (logits, k, capacity_factor) with logits that require grad."""
    (reports,) = launch(aux_loss_gradients, 1, route_tokens, list(cases),
                        group_timeout=TIMEOUTS["test_group"])
    for (logits, k, capacity_factor), report in zip(cases, reports, strict=True):
        what = routing_label(logits, k, capacity_factor)
        if report.get("error"):
            raise AssertionError(f"{what}, on logits that require grad, raised {report['error']}")
        if not report.get("requires_grad"):
            raise AssertionError(f"{what}: {NOT_DIFFERENTIABLE}")
        if report.get("grad") is None:
            raise AssertionError(f"{what}: aux_loss requires grad but none of it reaches the logits: "
                                 f"{NOT_DIFFERENTIABLE}")
        expect_tensor(report["grad"], aux_gradient_reference(logits, k),
                      f"{what}: the gradient of aux_loss with respect to the logits")


def aux_is_differentiable(route_tokens, n_experts, k):
    """Whether route_tokens' aux_loss carries a gradient to the logits (one rank, one small case)."""
    logits = torch.linspace(-1.0, 1.0, 6 * n_experts, dtype=torch.float64).reshape(6, n_experts).sin()
    (reports,) = launch(aux_loss_gradients, 1, route_tokens, [(logits, k, 1.0)],
                        group_timeout=TIMEOUTS["test_group"])
    return bool(reports[0].get("requires_grad"))


def _first_row(mask):
    return int(mask.any(dim=1).nonzero()[0])


def _kept_message(kept, want, experts, cap, tokens, k, n_experts, capacity_factor):
    t, c = [int(i) for i in (kept != want).nonzero()[0]]
    e = int(experts[t, c])
    takers = [(int(tt), int(cc)) for cc in range(k) for tt in range(tokens) if int(experts[tt, cc]) == e]
    counts = torch.bincount(experts[kept].flatten(), minlength=n_experts).tolist() if kept.any() else []
    over = [i for i, count in enumerate(counts) if count > cap]
    state = "kept" if kept[t, c] else "dropped"
    rule = (f"expert {e}'s capacity is C = ceil({capacity_factor:g} x {k} x {tokens} / {n_experts}) = {cap}; "
            f"choices reach it in this order: "
            + ", ".join(f"token {tt} (choice {cc})" for tt, cc in takers[:cap + 2])
            + (", ..." if len(takers) > cap + 2 else "")
            + " -- first choices in token order, then second choices; it takes the first C")
    extra = f" (expert {over[0]} kept {counts[over[0]]} > C = {cap})" if over else ""
    return (f"token {t}'s choice {c} (expert {e}) is {state}, expected "
            f"{'kept' if want[t, c] else 'dropped'}{extra}: {rule}")


def _aux_mistakes(probs, experts, kept, alpha):
    tokens, n_experts = probs.shape
    P = probs.mean(dim=0)
    first = torch.bincount(experts[:, 0], minlength=n_experts).double() / tokens
    kept_first = torch.bincount(experts[:, 0][kept[:, 0]], minlength=n_experts).double() / tokens
    every = torch.bincount(experts.flatten(), minlength=n_experts).double() / (tokens * experts.shape[1])
    return [
        (alpha * (first * P).sum(), "the factor E (the number of experts) is missing: alpha · E · sum f_i "
                                    "P_i"),
        (alpha * n_experts * (P * P).sum(), "f_i must be the fraction of tokens whose first choice is "
                                            "expert i "
                                            "(a count, not probabilities)"),
        (alpha * n_experts * (kept_first * P).sum(), "f_i counted the kept tokens only: it counts the "
                                                     "router's "
                                                     "choices, before the capacity drops any"),
        (alpha * n_experts * (every * P).sum(), "f_i counted every choice of a token: Switch Transformer's "
                                                "f_i counts the first choice (argmax) only"),
        ((first * P).sum() * n_experts, "alpha (0.01) is missing"),
    ] if experts.shape[1] > 1 else [
        (alpha * (first * P).sum(), "the factor E (the number of experts) is missing: alpha · E · sum f_i "
                                    "P_i"),
        (alpha * n_experts * (P * P).sum(), "f_i must be the fraction of tokens whose first choice is "
                                            "expert i "
                                            "(a count, not probabilities)"),
        (alpha * n_experts * (kept_first * P).sum(), "f_i counted the kept tokens only: it counts the "
                                                     "router's "
                                                     "choices, before the capacity drops any"),
        ((first * P).sum() * n_experts, "alpha (0.01) is missing"),
    ]


# --------------------------------------------------------------------------- ExpertParallelMoE

def moe_reference(case, world_size):
    """Per world rank: route(moe, x_r) with x_r's gradient, the router's gradient from its own loss,
    and the experts' gradients summed over its group, for loss_r = sum(y_r · dy_r) + aux_r; and the
    gradients of x_r and of the router without aux_r's part (what a layer whose aux_loss carries no
    gradient gets)."""
    moe = mixture(**dict(case["full"], device="cpu"))
    per_rank = []
    for rank in range(world_size):
        x = case["xs"][rank].double().clone().requires_grad_()
        out = route(moe, x)
        outputs = (out["y"] * case["dys"][rank].double()).sum()
        params = list(moe.parameters())
        grads = torch.autograd.grad(outputs + out["aux_loss"], [x, *params], allow_unused=True,
                                    retain_graph=True)
        without_aux = torch.autograd.grad(outputs, [x, moe.router.weight])
        names = [n for n, _ in moe.named_parameters()]
        param_grads = {n: (g if g is not None else torch.zeros_like(p))
                       for n, p, g in zip(names, params, grads[1:], strict=True)}
        per_rank.append(dict(out=out, x_grad=grads[0], grads=param_grads,
                             without_aux={"x": without_aux[0], "router.weight": without_aux[1]}))
    return moe, per_rank


def _wrong_tokens(got, out, group):
    """' (wrong for tokens [...], whose kept choices went to experts [...] held by ranks [...]; tokens [...]
    had every choice dropped)', to point at an expert or at the capacity."""
    if not isinstance(got, torch.Tensor) or got.shape != out["y"].shape:
        return ""
    bad = ((got.double() - out["y"].detach()).abs() > TOLERANCES["float64 rows"][0]).any(dim=1)
    bad = bad.nonzero().flatten().tolist()
    if not bad:
        return ""
    routed = [t for t in bad if out["kept"][t].any()]
    dropped = [t for t in bad if not out["kept"][t].any()]
    experts = sorted({int(e) for t in routed
                      for e, kept in zip(out["experts"][t], out["kept"][t], strict=True) if kept})
    per = len(out["load"]) // len(group)
    parts = []
    if routed:
        owners = sorted({group[e // per] for e in experts})
        parts.append(f"wrong for tokens {routed[:8]}{' ...' if len(routed) > 8 else ''}, whose kept choices "
                     f"went to expert(s) {experts}, held by rank(s) {owners}")
    if dropped:
        parts.append(f"tokens {dropped[:8]}{' ...' if len(dropped) > 8 else ''} had every choice dropped "
                     f"over capacity: their y is 0")
    return " (" + "; ".join(parts) + ")"


def _wrong_outputs(moe, x):
    with torch.no_grad():
        return [(route(moe, x, drop=False)["y"], "the token-choices over capacity were processed too: drop "
                                                 "them "
                                                 "(they add nothing to y)"),
                (route(moe, x, gated=False)["y"], "the experts' outputs were not weighed by their gates")]


def expect_moe(case_runs, case, what, route_tokens=None):
    """Every rank of an ExpertParallelMoE case: experts held, output, aux_loss, dropped count, gradients
    (x, router, its experts), and the all-to-alls of each direction.

    route_tokens: the learner's, which the layer routes with. A router gradient that lacks exactly
    aux_loss's part is the layer's mistake only if route_tokens' aux_loss is differentiable (its own
    cells grade that rule): with a route_tokens whose aux_loss is detached, the layer is right."""
    world_size = len(case_runs)
    verdict = {}  # whether route_tokens' aux_loss is differentiable, asked once
    moe, reference = moe_reference(case, world_size)
    n_experts = len(moe.experts)
    for run in case_runs:
        _expect_held(run, moe, members_of(case.get("groups"), run.rank, world_size), what)
    for run in case_runs:
        group = members_of(case.get("groups"), run.rank, world_size)
        ref, where = reference[run.rank], f"{what}: rank {run.rank}"
        out = ref["out"]
        x = case["xs"][run.rank].double()
        if not close(run.output, out["y"].detach()):
            tokens = _wrong_tokens(run.output, out, group)
            expect_tensor(run.output, out["y"].detach(), f"{where}'s output y{tokens}",
                          _wrong_outputs(moe, x))
        expect_tensor(run.aux_loss.reshape(()) if isinstance(run.aux_loss, torch.Tensor) else run.aux_loss,
                      out["aux_loss"].detach(), f"{where}'s aux_loss (of its own {x.shape[0]} tokens)")
        if run.dropped != out["dropped"]:
            raise AssertionError(f"{where}: `dropped` is {run.dropped}, expected {out['dropped']} "
                                 "token-choices "
                                 f"over capacity (C = {out['capacity']} per expert for its {x.shape[0]} "
                                 "tokens)")
        if run.no_grad or run.input_grad is None:
            raise AssertionError(f"{where}: no gradient reached x: the all-to-alls must carry gradients back "
                                 f"(an autograd.Function whose backward is the all-to-all the other way)")
        wanted = {"x": ref["x_grad"], "router.weight": ref["grads"]["router.weight"]}
        if _without_aux_part(run, ref, where, route_tokens, verdict, len(moe.experts), moe.k):
            wanted = ref["without_aux"]  # route_tokens' aux_loss has no gradient: its own cells say so
        expect_tensor(run.input_grad, wanted["x"], f"{where}'s gradient of x")
        expect_tensor(run.grads.get("router.weight"), wanted["router.weight"],
                      f"{where}'s gradient of router.weight (from its own tokens' loss)")
        n, index = len(group), group.index(run.rank)
        per = n_experts // n
        for j in range(per):
            e = index * per + j
            total = {}
            for member in group:
                for name, grad in reference[member]["grads"].items():
                    if name.startswith(f"experts.{e}."):
                        total[name] = total.get(name, 0) + grad
            for name, grad in total.items():
                mine = name.replace(f"experts.{e}.", f"experts.{j}.", 1)
                got = run.grads.get(mine)
                if got is None:
                    got = torch.zeros_like(grad)
                expect_tensor(got, grad, f"{where}: expert {e} (its experts.{j}): the gradient of "
                              f"{mine.split('.', 2)[2]}, summed over the tokens of every rank routed to it")
        sent, received = _token_counts(reference, group, run.rank, n_experts, n)
        d = x.shape[1]
        counts = (COUNTS, None)
        expect_collectives(run, [o for o in run.forward], [counts, (ALL_TO_ALL, sent * d * F64),
                                                           (ALL_TO_ALL, received * d * F64)],
                           what, "forward", group, rule="one exchange of token counts, then the kept tokens "
                                                        "to "
                                                        "their experts' ranks and the results back: two "
                                                        "all-to-alls with uneven splits")
        _expect_small(run, run.forward[:1], n_experts, n, what)
        backward = [(ALL_TO_ALL, sent * d * F64), (ALL_TO_ALL, received * d * F64)]
        expect_collectives(run, run.backward, backward, what, "backward", group,
                           rule="each all-to-all's backward is the all-to-all the other way, with the splits "
                                "swapped")


def _without_aux_part(run, ref, where, route_tokens, verdict, n_experts, k):
    """True when the gradients of x and of the router lack exactly aux_loss's part and the layer is not
    to blame: route_tokens' own aux_loss carries no gradient (asked once, in a rank). Raises when the layer
    is to blame (or when route_tokens is not known); False when the gradients are not of that shape."""
    if close(run.input_grad, ref["x_grad"]) or not all(
            close(got, ref["without_aux"][name]) for name, got in
            (("x", run.input_grad), ("router.weight", run.grads.get("router.weight")))):
        return False
    what = (f"{where}'s gradients of x and of router.weight lack aux_loss's part: the aux_loss the layer "
            f"returns carries no gradient to the router")
    if route_tokens is None:
        raise AssertionError(f"{what} (route_tokens' must be differentiable through P, and the layer returns "
                             "it as it is)")
    if "aux" not in verdict:
        verdict["aux"] = aux_is_differentiable(route_tokens, n_experts, k)
    if verdict["aux"]:
        raise AssertionError(f"{what}, though your route_tokens' aux_loss is differentiable: return the "
                             "aux_loss route_tokens gives, as it is (no .detach(), no .item())")
    return True


def _expect_small(run, ops, n_experts, n, what):
    for o in ops:
        if o.nbytes > F64 * n_experts * n:
            raise AssertionError(f"{what}: rank {run.rank}'s first {o.op} carried {o.nbytes} bytes: "
                                 "exchange the "
                                 f"token counts per expert ({n_experts} integers) before the tokens "
                                 "themselves")


def _token_counts(reference, group, rank, n_experts, n):
    """(token-choices rank sends away, token-choices its experts receive), kept ones only."""
    per = n_experts // n
    mine = range(group.index(rank) * per, (group.index(rank) + 1) * per)
    out = reference[rank]["out"]
    sent = int(out["kept"].sum())
    received = sum(int(((reference[m]["out"]["experts"] == e) & reference[m]["out"]["kept"]).sum())
                   for m in group for e in mine)
    return sent, received


def _expect_held(run, moe, group, what):
    n, index = len(group), group.index(run.rank)
    n_experts = len(moe.experts)
    per = n_experts // n
    full = dict(moe.named_parameters())
    expected = {"router.weight": full["router.weight"]}
    for j in range(per):
        for name, p in moe.experts[index * per + j].named_parameters():
            expected[f"experts.{j}.{name}"] = p
    if sorted(run.params) != sorted(expected):
        raise AssertionError(f"{what}: rank {run.rank}'s layer has parameters {sorted(run.params)[:8]}, "
                             "expected "
                             f"{sorted(expected)[:8]}{' ...' if len(expected) > 8 else ''}: a copy of the "
                             "router "
                             f"as `router` and its {per} expert(s) as `experts` (an nn.ModuleList), nothing "
                             "else")
    for name, want in expected.items():
        got = run.params[name]
        if got.shape == want.shape and torch.equal(got.double(), want.detach().double()):
            continue
        owner = next((e for e in range(n_experts)
                      if name.startswith("experts.") and
                      torch.equal(got.double(), dict(moe.experts[e].named_parameters())[name.split(".", 2)[2]]
                                  .detach().double())), None)
        hint = ""
        if owner is not None:
            hint = (f" -- it holds expert {owner}'s; rank {run.rank} is rank {index} of its group of {n}, "
                    "whose "
                    f"experts are {index * per}..{index * per + per - 1} (dist.get_rank(group) x E / N "
                    "onwards)")
        raise AssertionError(f"{what}: rank {run.rank}'s {name} is not the expected expert's{hint}")
