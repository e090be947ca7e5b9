"""A worker process of a tensor-parallel engine: one rank above 0 (``tp_launch.py`` starts it).

    python -m tickloom.engine.model.tp_worker --rank R --world W --model M --device D --backend gloo|nccl
                                              [--dtype X] [--quant Q] [--threads N]

with ``MASTER_ADDR`` / ``MASTER_PORT`` (rank 0's rendezvous store) and ``TICKLOOM_TP_PARENT`` (the engine's pid)
in the environment. It joins the process group, loads its shard, takes the KV pool's size from rank 0, votes on
whether every rank is ready, then serves rank 0's calls (``tp.serve_rank``) until the stop call. It dies with the
engine: its parent-death signal is SIGKILL (Linux), and a collective with a rank 0 that is gone fails at once.
Exit status: 0 after the stop call, 1 on any error (the traceback is on stderr, which rank 0 reads back).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import os
import signal
import sys
import traceback

import torch
import torch.distributed as dist

from tickloom.engine.model.loaders import load_model
from tickloom.engine.model.tp import build_executors_together, serve_rank, shard_model

WAIT_FOREVER = datetime.timedelta(days=3650)
"""A worker's collective timeout. Between calls it waits for rank 0 as long as the engine is idle; it never waits
on a rank 0 that is gone (the sockets close, and the parent-death signal kills it)."""


def _die_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends (Linux's ``PR_SET_PDEATHSIG``), and exit now
    if the engine is already gone. Ctrl-C in a terminal reaches the whole process group: the engine handles it
    and stops the workers itself, so they ignore SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    parent = os.environ.get("TICKLOOM_TP_PARENT")
    if parent is not None and os.getppid() != int(parent):
        raise SystemExit("tp_worker: the engine that started this worker is gone")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tp_worker", description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--backend", choices=["gloo", "nccl"], required=True)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--quant", default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    _die_with_parent()
    if args.device.startswith("cuda"):
        torch.cuda.set_device(args.device)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),  # type: ignore[attr-defined]
                          args.world, is_master=False, timeout=WAIT_FOREVER)
    dist.init_process_group(args.backend, store=store, rank=args.rank, world_size=args.world, timeout=WAIT_FOREVER)
    try:
        return _serve(args)
    finally:
        dist.destroy_process_group()


def _serve(args: argparse.Namespace) -> int:
    try:  # joined first, so a failure here is reported to rank 0 in the vote below rather than by a timeout
        model = load_model(args.model, args.dtype, args.device, args.threads, args.quant,
                           build=functools.partial(shard_model, rank=args.rank, world=args.world)).model
    except Exception:
        traceback.print_exc()
        model = None
    executor, failed = build_executors_together(model, torch.device(args.device))
    if executor is None:
        return 1
    if failed:
        return 0  # another rank failed; rank 0 reports it
    serve_rank(executor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
