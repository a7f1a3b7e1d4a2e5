"""The GPT of notebook 13 (dpcourse.toys.gpt), its text (toys.text) and its single-process yardstick
(reference.lm): what every parallel layout is compared with must itself be right."""

import math

import pytest
import torch
import torch.nn.functional as F

from dpcourse.reference.lm import (
    Recipe,
    batches_of,
    global_batch,
    lr_factor,
    make_optimizer,
    single_process_lm,
)
from dpcourse.toys.gpt import GPTConfig, ShardedDropout, gpt, lm_loss, parameter_count, stage_of
from dpcourse.toys.text import ALPHABET, VOCAB, arithmetic_text, decode, encode, samples, windows
from markers import chapter

pytestmark = chapter("gpt_in_3d")

TINY = GPTConfig(vocab=16, seq=8, d_model=16, n_heads=4, n_layers=3)


def test_the_parameter_count_formula_counts_what_the_model_holds():
    for config in (TINY, GPTConfig(), GPTConfig(d_model=32, n_heads=2, n_layers=1, d_hidden=40)):
        assert parameter_count(config) == sum(p.numel() for p in gpt(config).parameters())
    assert 0.7e6 < parameter_count(GPTConfig()) < 1.0e6  # the notebook's model: ~0.8M parameters


def test_the_same_seed_builds_the_same_model_and_leaves_the_global_generator_alone():
    state = torch.random.get_rng_state()
    a, b = gpt(TINY, seed=3), gpt(TINY, seed=3)
    assert torch.equal(state, torch.random.get_rng_state())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.tok.weight, gpt(TINY, seed=4).tok.weight)


def test_stages_chained_compute_the_whole_model_and_keep_its_parameter_names():
    model = gpt(TINY, seed=1, dtype=torch.float64)
    tokens = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(0))
    stages = [stage_of(model, 0, 1), stage_of(model, 1, 3)]
    assert list(stages[1].blocks) == ["1", "2"] and stages[1].tok is None and stages[0].head is None
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert torch.allclose(stages[1](stages[0](tokens)), model(tokens), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="blocks"):
        stage_of(model, 2, 2)


def test_attention_computes_the_heads_its_slices_hold():
    """q, k, v cut by rows into two halves of the heads, proj by columns: the two halves' outputs sum to
    the whole attention (what a column- then row-parallel split computes on 2 ranks)."""
    model = gpt(TINY, seed=2, dtype=torch.float64)
    attn, x = model.blocks["0"].attn, torch.randn(2, 8, 16, dtype=torch.float64)
    whole = attn(x)
    halves = []
    for rows in (slice(0, 8), slice(8, 16)):
        q, k, v = (F.linear(x, layer.weight[rows], layer.bias[rows]).view(2, 8, -1, 4).transpose(1, 2)
                   for layer in (attn.q, attn.k, attn.v))
        future = torch.ones(8, 8, dtype=torch.bool).triu(1)
        scores = (q @ k.transpose(-2, -1) / 2).masked_fill(future, -math.inf)
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 8, -1)
        halves.append(F.linear(y, attn.proj.weight[:, rows]))
    assert torch.allclose(halves[0] + halves[1] + attn.proj.bias, whole, atol=1e-12, rtol=0)


def test_attention_is_causal():
    model = gpt(TINY, seed=2, dtype=torch.float64)
    tokens = torch.randint(0, 16, (1, 8), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[0, 5] = (changed[0, 5] + 1) % 16
    a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :5], b[:, :5]) and not torch.allclose(a[:, 5:], b[:, 5:])


def test_sharded_dropout_draws_the_whole_tensors_mask_from_the_default_generator():
    drop, x = ShardedDropout(0.5), torch.ones(2, 6, 4, dtype=torch.float64)
    torch.manual_seed(7)
    y = drop(x)
    torch.manual_seed(7)
    keep = torch.rand((2, 6, 4), dtype=torch.float64) >= 0.5
    assert torch.equal(y, keep * 2.0)
    assert torch.equal(ShardedDropout(0.0)(x), x) and torch.equal(drop.eval()(x), x)


def test_the_text_is_arithmetic_in_a_16_character_alphabet():
    text = arithmetic_text(2000, seed=5)
    assert len(text) == 2000 and VOCAB == 16 and set(text) <= set(ALPHABET)
    for line in text.splitlines()[:-1]:
        left, right = line.rstrip(".").split(" = ")
        a, op, b = left.split(" ")
        assert int(right) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    assert decode(encode(text)) == text and arithmetic_text(2000, seed=5) == text != arithmetic_text(2000, 6)
    with pytest.raises(ValueError, match="alphabet"):
        encode("abc")


def test_windows_are_inputs_and_their_next_characters():
    ids = encode(arithmetic_text(100))
    w = windows(ids, 8)
    assert w.shape == (12, 9) and torch.equal(w[1], ids[8:17])
    assert samples(5, 8).shape == (5, 9)


def test_epochs_are_permutations_cut_into_batches():
    seen = torch.cat([global_batch(12, 4, step, seed=3) for step in range(3)])
    assert sorted(seen.tolist()) == list(range(12))
    assert not torch.equal(global_batch(12, 4, 0, 3), global_batch(12, 4, 3, 3))  # a new order each epoch
    with pytest.raises(ValueError, match="whole batches"):
        global_batch(10, 4, 0, 0)


def test_the_learning_rate_warms_up_then_decays_to_a_tenth():
    recipe = Recipe(lr=1.0, warmup=2, total=10)
    assert [round(lr_factor(recipe, s), 6) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_factor(recipe, 10) == pytest.approx(0.1) and lr_factor(recipe, 50) == pytest.approx(0.1)
    model = gpt(TINY)
    optimizer, schedule = make_optimizer(model.parameters(), recipe)
    lrs = []
    for _ in range(4):
        lrs.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert lrs == pytest.approx([recipe.lr_at(s) for s in range(4)])


def test_the_single_process_run_is_repeatable_and_float32_stays_near_float64():
    data, recipe = samples(16, TINY.seq), Recipe(batch=4, warmup=1, total=4)
    batches = batches_of(data, recipe, 3)
    a = single_process_lm(TINY, 0, batches, recipe)
    b = single_process_lm(TINY, 0, batches, recipe)
    c = single_process_lm(TINY, 0, batches, recipe, dtype=torch.float32)
    assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
    assert max(abs(x - y) for x, y in zip(a["losses"], c["losses"], strict=True)) < 1e-5
    assert a["losses"][0] == pytest.approx(math.log(16), rel=0.05)  # untrained: about uniform
    assert a["lrs"] == pytest.approx([recipe.lr_at(s) for s in range(3)])
    rows = data[global_batch(16, 4, 0, recipe.data_seed)]
    first = lm_loss(gpt(TINY, dtype=torch.float64)(rows[:, :-1]), rows[:, 1:])
    assert a["losses"][0] == pytest.approx(first.item())
