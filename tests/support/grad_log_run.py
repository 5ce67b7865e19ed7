"""A small training run that logs its per-class rows (``GradLog``), for the log's tests.

Holds ``train`` (steps ``[start, stop)`` of a seeded MLP run with ``PerClassGradScaler``, each
step's rows into a ``GradLog``, a checkpoint of model and optimizer at every window boundary;
``kill_at``: the process kills itself with SIGKILL before that step, as a crash mid-window) and a
command line for running it in a fresh process.

    python -m tests.support.grad_log_run LOG CHECKPOINT START STOP [KILL_AT]
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from classgrad import GradLog, PerClassGradScaler
from classgrad.workers import zoo

C = 6
WINDOW = 2
LR = 0.1
DIM = 32


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(12, 8, generator=g), torch.randint(0, C, (12,), generator=g)


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = zoo.mlp(C, in_features=8, hidden=16, seed=3).eval()
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def train(log_url: str, checkpoint: str, start: int, stop: int, kill_at: int | None = None) -> None:
    model, opt = fresh()
    if start:
        state = torch.load(checkpoint, weights_only=True)
        assert state["step"] == start, (state["step"], start)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    scaler = PerClassGradScaler()
    with GradLog(log_url, model, C, window=WINDOW, dim=DIM, start_step=start) as log:
        for step in range(start, stop):
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if step % WINDOW == 0:
                torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, checkpoint)
            x, y = batch(step)
            opt.zero_grad()  # step_batch adds the aggregate into .grad, as backward() does
            rows, ids = scaler.step_batch(model, x, y, opt, num_classes=C)
            log.add(step, rows, ids, lr=LR, counts=torch.bincount(y, minlength=C)[ids])


if __name__ == "__main__":
    url, ckpt, a, b = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    train(url, ckpt, a, b, int(sys.argv[5]) if len(sys.argv) > 5 else None)


def rows_only(log_url: str, steps: int, rank: int | None = None, world: int = 1) -> None:
    """Steps ``[0, steps)`` of the run without updates (``update_grad=False``: every step sees the
    same model), each rank given its share of every batch (samples ``rank::world``); ``rank``
    None: one process, the whole batches."""
    model, opt = fresh()
    scaler = PerClassGradScaler()
    with GradLog(log_url, model, C, window=WINDOW, dim=DIM, overwrite=True) as log:
        for step in range(steps):
            x, y = batch(step)
            if rank is not None:
                x, y = x[rank::world], y[rank::world]
            rows, ids = scaler.step_batch(model, x, y, opt, num_classes=C, update_grad=False)
            log.add(step, rows, ids, lr=LR, counts=torch.bincount(y, minlength=C)[ids])


def ddp_rank(rank: int, world: int, rendezvous: str, log_url: str, steps: int) -> None:
    """``rows_only`` on one rank of a gloo process group (``torch.multiprocessing.spawn``'s target).
    The ranks meet through a file (``rendezvous``, not yet existing): no TCP store server, whose
    teardown by rank 0 could abort a rank still leaving the group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        rows_only(log_url, steps, rank, world)
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()
    # Out without the interpreter's teardown: torch 2.13's gloo sometimes aborts there ("terminate
    # called without an active exception", 1 run in 8 here) after everything is done and written.
    sys.stdout.flush()
    os._exit(0)
