"""From notebook to cluster: the course's CNN training as a torchrun program.

A function you ran with `launch(train, N, ...)` is already a distributed
program; only the way its processes start differs. Under torchrun each worker
gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in its
environment, and `dist.init_process_group()` reads them. This module is that
glue, and nothing more -- the training itself is a function you name:

    torchrun --standalone --nproc-per-node=2 -m dpcourse.runtime.cluster my_training:train_ddp \
             --samples 512 --epochs 3 --checkpoint-dir ckpt --out result.pt

runs `my_training.train_ddp(make_model, dataset, epochs=..., global_batch=..., lr=...,
seed=..., checkpoint_dir=...)` on every worker (the signature of notebook 06's
exercise) on the course's generated images and SmallCNN, and rank 0 saves what
it returned to --out. The same command line, with --nnodes and a rendezvous
endpoint, runs on several machines; `slurm_script` writes the batch file.

Helpers for running torchrun from Python (the notebook, the tests): `free_port`,
`torchrun_command`, and `run_agents`, which starts agents in their own
sessions, bounds them with a timeout and kills every process they started
(agents and workers, which torchrun puts in sessions of their own) on failure.
"""

import argparse
import importlib
import inspect
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from functools import partial

from dpcourse.runtime.inside_rank import to_cpu

DTYPES = ("float32", "float64")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dpcourse.runtime.cluster",
                                     description="Run a DDP training function on the course's CNN "
                                                 "under torchrun.")
    parser.add_argument("target", help="MODULE:FUNCTION, e.g. my_training:train_ddp")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--image-size", type=int, default=12)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-seed", type=int, default=1)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--out", help="where rank 0 saves what the function returned (torch.save)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="default: nccl when this node has a GPU per local rank, else gloo "
                             "(DPCOURSE_BACKEND overrides the default)")
    return parser.parse_args(argv)


def load_target(target):
    """Import MODULE:FUNCTION (the current directory is searched first, like `python script.py`)."""
    module_name, _, function_name = target.partition(":")
    if not module_name or not function_name:
        raise SystemExit(f"target must look like MODULE:FUNCTION, got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return getattr(importlib.import_module(module_name), function_name)


def pick_backend(requested=None):
    """The course's one rule (dpcourse.backend.resolve_backend: DPCOURSE_BACKEND honoured,
    NCCL only with one GPU per rank) applied to this node's workers (torchrun's LOCAL_WORLD_SIZE)."""
    from dpcourse.backend import resolve_backend

    return resolve_backend(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), requested)


def main(argv=None):
    """The worker program torchrun starts N times."""
    import torch
    import torch.distributed as dist

    from dpcourse.toys.images import GeneratedImages
    from dpcourse.toys.smallcnn import SmallCNN

    args = parse_args(argv)
    train = load_target(args.target)
    backend = pick_backend(args.backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    try:
        dtype = getattr(torch, args.dtype)
        dataset = GeneratedImages(args.samples, size=args.image_size, seed=args.data_seed, dtype=dtype)
        make_model = partial(SmallCNN, classes=dataset.classes, width=args.width, dtype=dtype)
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        started = time.perf_counter()
        result = train(make_model, dataset, epochs=args.epochs, global_batch=args.global_batch,
                       lr=args.lr, seed=args.seed, checkpoint_dir=args.checkpoint_dir)
        elapsed = time.perf_counter() - started
        if dist.get_rank() == 0:
            losses = result.get("losses", {}) if isinstance(result, dict) else {}
            shown = ", ".join(f"epoch {e}: {loss:.4f}" for e, loss in sorted(losses.items()))
            print(f"[{dist.get_world_size()} workers, {backend}] trained in {elapsed:.2f} s; "
                  f"losses {shown or '(no epoch left to train)'}", flush=True)
            if args.out:
                torch.save(to_cpu(result), args.out)
        # leave together: a rank that tears down gloo while a peer still holds its connections
        # makes that peer abort ("terminate called without an active exception", seen here)
        dist.barrier()
    finally:
        dist.destroy_process_group()


HEADER = '''\
"""{function} exported from a notebook: torchrun imports it from here."""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from dpcourse import rank_device
'''


def export_function(fn, folder, module="my_training", header=HEADER):
    """Write fn's source (from the notebook cell) into folder/module.py, after the usual imports.

    torchrun starts fresh interpreters that cannot see a notebook's cells: the
    function has to live in a file. `fn` may be a list of functions (a function and
    the ones it calls, notebook 14's restartable job): they are written in order.
    Returns the file's path.
    """
    functions = fn if isinstance(fn, (list, tuple)) else [fn]
    sources = [textwrap.dedent(inspect.getsource(f)) for f in functions]
    path = os.path.join(folder, f"{module}.py")
    with open(path, "w") as f:
        f.write(header.format(function=", ".join(g.__name__ for g in functions)) + "\n\n"
                + "\n\n".join(sources))
    return path


def free_port(host="127.0.0.1"):
    """A TCP port nobody listens on now (the OS picks it): never assume 29500 is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_command(target, script_args=(), nproc_per_node=2, nnodes=1, endpoint=None,
                     run_id="dpcourse", local_addr=None, python=None):
    """The argv of one torchrun agent: --standalone for one node, a c10d rendezvous otherwise.

    `python -m torch.distributed.run` is the `torchrun` command itself, run by
    this interpreter (so it is the same environment's torch).
    """
    argv = [python or sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1 and endpoint is None:
        argv += ["--standalone", f"--nproc-per-node={nproc_per_node}"]
    else:
        argv += [f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
                 "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"]
        if local_addr:
            argv.append(f"--local-addr={local_addr}")
    return argv + ["-m", "dpcourse.runtime.cluster", target, *map(str, script_args)]


def shell_line(argv):
    """How a command reads in a terminal: `torchrun ...` rather than `python -m torch.distributed.run`."""
    if argv[1:3] == ["-m", "torch.distributed.run"]:
        argv = ["torchrun", *argv[3:]]
    return shlex.join(argv)


class AgentsFailed(RuntimeError):
    """A torchrun job failed or timed out; the message holds each agent's exit status and output."""


def run_agents(commands, timeout=120.0, env=None, cwd=None):
    """Run torchrun agents (one per simulated node) to completion; return their outputs.

    Each agent starts in its own session; torchrun starts its workers in
    sessions of their own too. On a timeout or a failed agent, every agent and
    every process it started is killed (killpg, SIGKILL) and reaped, and
    AgentsFailed says what each agent printed.
    """
    env = dict(os.environ if env is None else env)
    if "GLOO_SOCKET_IFNAME" not in env and _is_loopback(commands):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # every worker is on this machine: talk over loopback
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=cwd, start_new_session=True) for cmd in commands]
    outputs = [""] * len(procs)
    failure = None
    try:
        deadline = time.monotonic() + timeout
        for i, proc in enumerate(procs):
            try:
                outputs[i], _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failure = f"timed out after {timeout:.0f} s"
                break
            if proc.returncode != 0:
                failure = f"agent {i} exited with status {proc.returncode}"
                break
    finally:
        if failure is not None or any(p.poll() is None for p in procs):
            _kill_trees(procs)
            for i, proc in enumerate(procs):
                try:
                    rest, _ = proc.communicate(timeout=10)
                    outputs[i] += rest or ""
                except (subprocess.TimeoutExpired, ValueError):
                    pass
    if failure is not None:
        shown = "\n".join(f"--- agent {i} (status {p.returncode}):\n{outputs[i][-3000:]}"
                          for i, p in enumerate(procs))
        raise AgentsFailed(f"torchrun job {failure}\n{shown}")
    return outputs


def _is_loopback(commands):
    return any("127.0.0.1" in arg or "localhost" in arg or arg == "--standalone"
               for cmd in commands for arg in cmd)


def _kill_trees(procs):
    """SIGKILL each agent's process group and the groups of everything below it (its workers)."""
    groups = set()
    for proc in procs:
        for pid in [proc.pid, *_descendants(proc.pid)]:
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        proc.wait()


def _descendants(pid):
    """Every process below `pid`, read from /proc (Linux; elsewhere, none)."""
    children = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cluster_command_lines(target="my_training:train_ddp", script="--epochs 90 --checkpoint-dir ckpt",
                          gpus_per_node=8):
    """The command lines the notebook prints: one node, two 'nodes' on loopback, several machines."""
    return {
        "one machine, 2 workers": f"torchrun --standalone --nproc-per-node=2 -m dpcourse.runtime.cluster "
                                  f"{target} {script}",
        "two 'nodes' on this machine (run both, e.g. in two terminals)":
            f"torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d "
            f"--rdzv-endpoint=127.0.0.1:PORT --rdzv-id=demo -m dpcourse.runtime.cluster {target} {script}",
        f"2 machines x {gpus_per_node} GPUs (the same line on each; HOST0 = the first machine)":
            f"torchrun --nnodes=2 --nproc-per-node={gpus_per_node} --rdzv-backend=c10d "
            f"--rdzv-endpoint=HOST0:29400 --rdzv-id=job42 -m dpcourse.runtime.cluster {target} {script}",
    }


def slurm_script(target="my_training:train_ddp", script="--epochs 90 --checkpoint-dir $SCRATCH/ckpt",
                 nodes=2, gpus_per_node=8):
    """A SLURM batch file: one torchrun agent per node, the first node hosts the rendezvous."""
    return f"""#!/bin/bash
#SBATCH --job-name=ddp-cnn
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1          # one torchrun agent per node; it starts the workers
#SBATCH --gpus-per-node={gpus_per_node}
#SBATCH --cpus-per-task=32
#SBATCH --time=02:00:00
#SBATCH --requeue                    # preempted? SLURM restarts it and it resumes from ckpt
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun torchrun --nnodes="$SLURM_NNODES" --nproc-per-node={gpus_per_node} \\
     --rdzv-backend=c10d --rdzv-endpoint="$head:29400" --rdzv-id="$SLURM_JOB_ID" \\
     -m dpcourse.runtime.cluster {target} {script}
"""


def exit_without_teardown(code=0):
    """End a worker process without interpreter and C++ static teardown.

    DDP keeps a reference to its process group even after destroy_process_group(),
    so gloo's worker threads are still alive when the interpreter finalises, and
    one run in 5 to 25 here aborted there with "terminate called without an active
    exception" (SIGABRT, after the result was saved; pytorch#179291 describes it).
    By now the result is saved and the output flushed: skipping teardown loses nothing.
    """
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
    exit_without_teardown()
