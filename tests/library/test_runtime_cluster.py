"""Notebook 06's training under torchrun: one node with 2 workers, and two "nodes" on this machine
(two torchrun agents meeting at a c10d rendezvous on loopback). Both must end exactly where one
process training on the same global batches ends. Every job is bounded by a timeout, and on failure
every agent and worker is killed (agents and workers each run in their own session: killpg).
"""

import os
import time
import uuid
from functools import partial

import pytest
import torch

from dpcourse.reference.training import single_process_training
from dpcourse.runtime.cluster import AgentsFailed, free_port, run_agents, torchrun_command
from dpcourse.topics.ddp.checks import expect_same_state, read_checkpoint
from dpcourse.toys.images import GeneratedImages
from dpcourse.toys.smallcnn import SmallCNN
from markers import exercise

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_orphans")]

TARGET = "dpgrader.ddp_in_practice.checks:reference_train_ddp"  # a correct train_ddp, kept grader-side
SAMPLES, EPOCHS, GLOBAL_BATCH, LR, SEED, WIDTH = 64, 2, 16, 0.05, 3, 4
TIMEOUT = 180  # seconds per job: each worker starts a Python with torch (slow on 2 busy cores)


def options(folder):
    return ["--samples", SAMPLES, "--epochs", EPOCHS, "--global-batch", GLOBAL_BATCH, "--lr", LR,
            "--seed", SEED, "--width", WIDTH, "--dtype", "float64",
            "--checkpoint-dir", folder / "ckpt", "--out", folder / "result.pt"]


def expect_single_process_result(folder, world_size, outputs):
    dataset = GeneratedImages(SAMPLES, seed=1, dtype=torch.float64)  # the program's defaults
    make_model = partial(SmallCNN, width=WIDTH, dtype=torch.float64)
    expected = single_process_training(make_model, dataset, epochs=EPOCHS, global_batch=GLOBAL_BATCH,
                                       lr=LR, seed=SEED, world_size=world_size)
    assert any(f"[{world_size} workers, gloo]" in out or f"[{world_size} workers, nccl]" in out
               for out in outputs), outputs
    result = torch.load(folder / "result.pt", weights_only=True)
    expect_same_state(result["model"], expected["model"], "the model rank 0 returned under torchrun")
    for epoch, loss in expected["losses"].items():
        assert abs(result["losses"][epoch] - loss) < 1e-9, (epoch, result["losses"], loss)
    assert sorted(result["seen"]) == list(range(EPOCHS))
    checkpoint = read_checkpoint(folder / "ckpt")
    assert checkpoint["epoch"] == EPOCHS - 1
    expect_same_state(checkpoint["model"], expected["model"], "the checkpoint written under torchrun")


@exercise("train_ddp")
def test_torchrun_standalone_two_workers_equal_single_process(tmp_path):
    command = torchrun_command(TARGET, options(tmp_path), nproc_per_node=2)
    outputs = run_agents([command], timeout=TIMEOUT, cwd=tmp_path)
    expect_single_process_result(tmp_path, 2, outputs)


@exercise("train_ddp")
def test_two_agents_c10d_rendezvous_on_loopback_equal_single_process(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"  # never assume 29500 is free
    run_id = f"test-{uuid.uuid4().hex[:8]}"  # the same job id on both agents
    commands = [torchrun_command(TARGET, options(tmp_path), nproc_per_node=1, nnodes=2,
                                 endpoint=endpoint, run_id=run_id, local_addr="127.0.0.1")
                for _ in range(2)]
    outputs = run_agents(commands, timeout=TIMEOUT, cwd=tmp_path)
    expect_single_process_result(tmp_path, 2, outputs)


def test_a_hanging_job_is_killed_with_every_worker(tmp_path):
    marker = f"hang_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{marker}.py").write_text(
        "import os, time\n\n"
        "def train(*args, **kwargs):\n"
        "    open(f'started-{os.environ[\"RANK\"]}', 'w').close()\n"
        "    time.sleep(600)\n")
    command = torchrun_command(f"{marker}:train", ["--checkpoint-dir", tmp_path / "ckpt"],
                               nproc_per_node=2)
    started = time.monotonic()
    with pytest.raises(AgentsFailed, match="timed out after 25 s"):
        run_agents([command], timeout=25, cwd=tmp_path)
    assert time.monotonic() - started < 60
    assert sorted(p.name for p in tmp_path.glob("started-*")) == ["started-0", "started-1"], (
        "the workers never started: the test proves nothing")
    assert not processes_mentioning(marker), "workers of the killed job are still running"


def processes_mentioning(text):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found
