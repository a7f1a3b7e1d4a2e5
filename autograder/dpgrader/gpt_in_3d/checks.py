"""Hidden checks of 13_gpt_in_3d. Each raises a short AssertionError saying what is wrong.

Every learner function runs inside launched ranks (dpcourse.topics.gpt_in_3d.runs: each rank is sent only its
part of a case) or, for dp_samples, as a direct call; expected values are computed here, in the test cell's
process (dpcourse.topics.gpt_in_3d.checks: init_device_mesh's layout, the unsharded float64 model, one process
training on the same global batches). With the visible tests, cases cover 1, 2, 3, 4, 6 and 8 ranks, every
listed layout of 8 ranks and four of 2 and 4, tensor parallelism over 2 and 4 ranks with 1, 2 and 3 heads per
rank, dropout on, unbalanced stage costs both ways, 2 to 4 micro-batches, an epoch boundary, float32, the
memory of a sharded model measured from outside, and checkpoints resumed in two other layouts. Cases are tiny
(2-4 blocks of d_model 16-24, sequences of 8) and share launches: the chapter's grading costs launches, and a
launch of 8 ranks with DTensor's start-up costs seconds here.
"""

import tempfile

from dpcourse.reference.lm import Recipe, batches_of
from dpcourse.topics.gpt_in_3d.checks import (
    expect_block,
    expect_memory_sharded,
    expect_mesh,
    expect_pipeline,
    expect_resumed,
    expect_samples,
    expect_sharded,
    expect_sizes_refused,
    expect_training,
)
from dpcourse.topics.gpt_in_3d.runs import run_cases
from dpcourse.toys.gpt import GPTConfig, activations, parameter_count
from dpcourse.toys.text import samples

# What each exercise's expected values come from (autograder/exercises.json lists them).
REFERENCES = {
    "make_mesh": "init_device_mesh's layout written out: torch.arange(world).view(dp, pp, tp), each dim's "
                 "groups "
                 "the lines of that array through the rank",
    "block_plan": "the unsharded float64 block on the whole sequence (and its gradients), with the generator "
                  "seeded as the ranks seed it",
    "pipeline_stages": "the whole float64 model on each dp rank's rows, micro-batch by micro-batch; the best "
                       "cut "
                       "found by trying every one",
    "shard_data_parallel": "the whole float64 model on the global batch (FSDP's gradients, averaged); "
                           "reference.lm.global_batch (DistributedSampler's permutation) for the samples; "
                           "the "
                           "memory measured from outside the rank",
    "train_step": "reference.lm.single_process_lm: one float64 process on the same global batches and recipe",
    "checkpoint_3d": "reference.lm.single_process_lm, uninterrupted, on the same global batches",
}

TINY = dict(vocab=16, seq=8, d_model=16, n_heads=4, n_layers=2)
RECIPE = Recipe(batch=8, lr=0.3, warmup=2, total=8)


# --------------------------------------------------------------------------- 1. the mesh

def check_make_mesh(make_mesh):
    """6 ranks in four layouts (and one that does not fit), 1 rank alone (the visible tests run 8)."""
    layouts = [(3, 1, 2), (1, 2, 3), (6, 1, 1), (2, 3, 1), (2, 2, 2)]
    reports = run_cases("mesh", {"make_mesh": make_mesh}, 6, [dict(layout=lay) for lay in layouts],
                        exercise="make_mesh")
    for layout, case_reports in zip(layouts, reports, strict=True):
        what = f"make_mesh{layout} on 6 ranks"
        if layout == (2, 2, 2):
            expect_sizes_refused(case_reports, layout, what)
        else:
            expect_mesh(case_reports, layout, what)
    alone = run_cases("mesh", {"make_mesh": make_mesh}, 1, [dict(layout=(1, 1, 1))], exercise="make_mesh")[0]
    expect_mesh(alone, (1, 1, 1), "make_mesh(1, 1, 1) on 1 rank")


# --------------------------------------------------------------------------- 2. one block

def check_block_plan(block_plan):
    """tp = 4 with one head per rank and dropout on; tp = 2 with three heads per rank (d_model 24, 6
    heads)."""
    cases = [dict(config=dict(TINY, dropout=0.25), seed=11, tp=4, rng_seed=3, label="tp 4, dropout 0.25",
                  replicas=[(activations((2, 8, 16), seed=12), activations((2, 8, 16), seed=13))]),
             dict(config=dict(TINY, d_model=24, n_heads=6), seed=14, tp=2, label="tp 2, 3 heads per rank",
                  replicas=[(activations((1, 8, 24), seed=15 + r), activations((1, 8, 24), seed=17 + r))
                            for r in range(2)])]
    runs = run_cases("block", {"block_plan": block_plan}, 4, cases, exercise="block_plan")
    for case, reports in zip(cases, runs, strict=True):
        expect_block(reports, case, f"block_plan on 4 ranks ({case['label']})")


# --------------------------------------------------------------------------- 3. pipeline stages

def check_pipeline_stages(cut_stage, make_schedule):
    """4 stages with 4 micro-batches; 2 pipelines of 2 stages whose costs favour a short last stage, 3
    micro-batches."""
    pieces = {"cut_stage": cut_stage, "make_schedule": make_schedule}
    cases = [dict(config=dict(TINY, n_layers=4), seed=31, layout=(1, 4), costs=[1, 1, 1, 1], n_micro=4,
                  rows=samples(4, 8, seed=32), label="4 stages"),
             dict(config=dict(TINY, n_layers=4), seed=33, layout=(2, 2), costs=[1, 1, 1, 5], n_micro=3,
                  rows=samples(12, 8, seed=34), label="2 x 2, costs [1, 1, 1, 5]")]
    for case, reports in zip(cases, run_cases("pipeline", pieces, 4, cases, exercise="pipeline_stages"),
                             strict=True):
        expect_pipeline(reports, case, f"the pipeline on 4 ranks ({case['label']})")


# --------------------------------------------------------------------------- 4. fully_shard, samples

def check_shard_data_parallel(apply_fsdp, dp_samples):
    """The notebook's GPT (0.8M parameters, float64) on 2 ranks with its memory measured from outside the
    ranks; 3 blocks on 3 ranks; dp_samples on 1 and 3 ranks over two epochs of 12 samples."""
    config = GPTConfig(seq=16)
    big = dict(config=config.as_dict(), seed=41, dp=2, rows=samples(2, 16, seed=42),
               label="2 ranks, measured")
    reports = run_cases("fsdp", {"apply_fsdp": apply_fsdp}, 2, [big], exercise="shard_data_parallel",
                        measure_memory=True)[0]
    expect_sharded(reports, big, "apply_fsdp on 2 ranks, the notebook's GPT")
    expect_memory_sharded(reports, big, "apply_fsdp on 2 ranks, the notebook's GPT",
                          model_bytes=8 * parameter_count(config))
    three = dict(config=dict(TINY, n_layers=3), seed=43, dp=3, rows=samples(6, 8, seed=44), label="3 ranks")
    reports = run_cases("fsdp", {"apply_fsdp": apply_fsdp}, 3, [three], exercise="shard_data_parallel")[0]
    expect_sharded(reports, three, "apply_fsdp on 3 ranks")
    for dp in (1, 3):
        for step in range(4):  # 12 samples, batch 6: an epoch is 2 steps
            expect_samples([dp_samples(12, 6, step, d, dp, 5) for d in range(dp)], 12, 6, step, 5,
                           f"dp_samples(12 samples, batch 6, step {step}) on {dp} dp rank(s)")


# --------------------------------------------------------------------------- 5. the 3-D step

def check_train_step(pieces):
    """4 ranks: (2, 2, 1) and (1, 1, 4) for 2 steps, (4, 1, 1) in float32."""
    data = samples(32, 8, seed=51)
    cases = [dict(config=TINY, seed=52, layouts=[(2, 2, 1), (1, 1, 4)], recipe=RECIPE, n_micro=2,
                  steps=batches_of(data, RECIPE, 2), label="float64"),
             dict(config=TINY, seed=53, layouts=[(4, 1, 1)], recipe=RECIPE, n_micro=2, dtype="float32",
                  steps=batches_of(data, RECIPE, 2), label="float32")]
    runs = run_cases("train", pieces, 4, cases, exercise="train_step", group_timeout=10)
    for case, reports in zip(cases, runs, strict=True):
        expect_training(reports, case, f"train_step on 4 ranks ({case['label']})")


# --------------------------------------------------------------------------- 6. checkpoints

def check_checkpoint_3d(pieces):
    """2 ranks: a step in a pipeline of 2 stages, (1, 2, 1), saved, loaded as data parallelism, (2, 1, 1),
    two more steps (the stage's parameters and momentum buffers come back as FSDP shards)."""
    with tempfile.TemporaryDirectory() as folder:
        case = dict(config=TINY, seed=61, layouts=[(1, 2, 1), (2, 1, 1)], recipe=RECIPE, n_micro=2, split=1,
                    steps=batches_of(samples(32, 8, seed=62), RECIPE, 3), path=folder,
                    label="(1, 2, 1) -> (2, 1, 1)")
        reports = run_cases("checkpoint", pieces, 2, [case], exercise="checkpoint_3d", group_timeout=10)[0]
    expect_resumed(reports, case, "save_checkpoint in (1, 2, 1), load_checkpoint in (2, 1, 1)")
