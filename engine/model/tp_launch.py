"""Tensor parallelism in the engine: rank 0 in the engine's process, ranks 1..W-1 in worker processes it starts.

``Engine.open`` with ``EngineConfig.tensor_parallel_size = W > 1`` (``tickloom/runtime.py``) builds a
``TensorParallelRanks``, which

1. starts the rendezvous store on a free localhost port (port 0: the kernel picks, so no two engines race for one)
   and ``W - 1`` workers, ``python -m tickloom.engine.model.tp_worker`` (``tp_worker.py``), each told its rank, the
   model, dtype, quantization, device and thread count in argv and the store's address in ``MASTER_ADDR`` /
   ``MASTER_PORT``: nothing is pickled;
2. loads rank 0's shard while the workers load theirs (``load_model(..., build=shard_model)``), joins the process
   group (gloo on CPU, nccl on CUDA), and tells the workers the KV pool's size once the engine has derived it;
3. hands the engine an executor (``_RankZero``) that makes each call of ``TensorParallelExecutor`` (``tp.py``:
   broadcast, then run the shard) on one thread.

Closing sends the stop call, waits a bounded time for the workers to exit, kills what is left, and leaves the
process group. Every wait here is bounded, so a worker that dies or hangs ends the engine with
``TensorParallelError`` instead of hanging it.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO, Any, TypeVar

import torch
import torch.distributed as dist

from tickloom.engine.model.config import ModelConfig
from tickloom.engine.model.convert import resolve_model
from tickloom.engine.model.loaders import LoadedModel, load_model
from tickloom.engine.model.tp import TensorParallelExecutor, build_executors_together, shard_model
from tickloom.engine.model.types import HostKV, StepResult
from tickloom.events.commands import BindRequest, RunStep

log = logging.getLogger(__name__)

T = TypeVar("T")

COLLECTIVE_TIMEOUT_S = 120.0
"""Rank 0's bound on any wait for the other ranks: the rendezvous (workers importing torch), their loading, and
every collective. A worker that exits is noticed at once (its sockets close); this bounds one that hangs."""
STOP_WAIT_S = 10.0
"""How long closing waits for the stop call to go out and for the workers to exit before killing them."""
WORKER_MODULE = "tickloom.engine.model.tp_worker"

_ONE_GROUP = threading.Lock()
"""torch.distributed has one default process group per process, so one tensor-parallel engine at a time."""


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine died, hung past ``COLLECTIVE_TIMEOUT_S``, or failed a collective."""


def rank_devices(device: str, world: int) -> list[str]:
    """Each rank's torch device: all ``cpu``, or ``world`` CUDA devices from ``device``'s index on."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return ["cpu"] * world
    if dev.type == "cuda":
        first, count = dev.index or 0, torch.cuda.device_count()
        if first + world > count:
            raise ValueError(f"needs {world} CUDA devices from cuda:{first} (one per rank); there are {count}")
        return [f"cuda:{first + r}" for r in range(world)]
    raise ValueError(f"runs on cpu (gloo) or cuda (nccl), not on {dev.type}")


def read_model_config(model: str) -> ModelConfig:
    """The model's configuration, read before anything is loaded or started (to check that it can be sharded)."""
    return ModelConfig.from_file(resolve_model(model) / "config.json")


class _Job:
    __slots__ = ("done", "error", "fn", "result")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


class _DistThread:
    """The one thread of the engine's process that calls torch.distributed (and runs rank 0's shard).

    Why one thread: the device actor runs the executor on its own thread, but the group is created, and left, while
    that thread does not exist; NCCL binds a communicator to the thread's current CUDA device; and a call made
    while another is in a collective would interleave two collectives. Here every call waits for the one before.
    The workers are started from this thread too, as their parent-death signal follows the thread that started
    them (``tp_worker.py``), and this one lives until they are gone."""

    def __init__(self, device: str, on_exit: Callable[[], None]) -> None:
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=4)
        self._device = device
        self._on_exit = on_exit
        self._thread = threading.Thread(target=self._main, name="tickloom-tp-rank0", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> _Job:
        job = _Job(fn)
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise TensorParallelError("rank 0's thread has too many calls queued") from None
        return job

    def call(self, fn: Callable[[], T]) -> T:
        job = self.submit(fn)
        job.done.wait()
        result: T = job.outcome()
        return result

    def stop(self, timeout: float) -> bool:
        """Let the thread end after its current call; whether it ended within ``timeout``."""
        try:
            self._jobs.put(None, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _main(self) -> None:
        try:
            if self._device.startswith("cuda"):
                torch.cuda.set_device(self._device)
            while (job := self._jobs.get()) is not None:
                try:
                    job.result = job.fn()
                except BaseException as exc:  # handed to the caller, which raises it
                    job.error = exc
                finally:
                    job.done.set()
        finally:
            self._on_exit()


class _Worker:
    """One worker process (a rank above 0) and the file its stderr goes to."""

    def __init__(self, rank: int, proc: subprocess.Popen[bytes], stderr: IO[bytes]) -> None:
        self.rank, self.proc, self.stderr = rank, proc, stderr

    def exit_reason(self, code: int) -> str:
        how = f"code {code}" if code >= 0 else f"signal {_signal_name(-code)}"
        reason = f"tensor-parallel rank {self.rank} (pid {self.proc.pid}) exited with {how}"
        tail = self.stderr_tail()
        return f"{reason}; its last words: {tail}" if tail else reason

    def stderr_tail(self, lines: int = 3, window: int = 4096) -> str:
        size = os.fstat(self.stderr.fileno()).st_size
        data = os.pread(self.stderr.fileno(), window, max(size - window, 0)).decode("utf-8", "replace")
        return " | ".join([line for line in data.splitlines() if line.strip()][-lines:])


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


class TensorParallelRanks:
    """Rank 0's side of a tensor-parallel engine: the workers, the process group and the executor.

    ``start`` and ``connect`` block (the engine runs them in a worker thread); ``check`` raises if a rank is gone;
    ``close`` is idempotent and bounded, and must run whatever happened before it."""

    def __init__(self, world: int, model: str, *, dtype: str | None, device: str, threads: int | None,
                 quant: str | None, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        """Raises ``ValueError`` for a setting that cannot run (the engine names ``tensor_parallel_size``)."""
        if world < 2:
            raise ValueError(f"{world} ranks: tensor parallelism needs at least 2")
        self.world, self.model, self.dtype, self.quant = world, model, dtype, quant
        self.devices = rank_devices(device, world)
        self.backend = "nccl" if self.devices[0].startswith("cuda") else "gloo"
        if threads is None and self.backend == "gloo":  # the ranks share this machine's cores
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            threads = max(1, cores // world)
        self.threads = threads
        self.timeout = datetime.timedelta(seconds=timeout_s)
        if not _ONE_GROUP.acquire(blocking=False):
            raise ValueError("another tensor-parallel engine is open in this process (torch.distributed has one "
                             "default process group per process)")
        self.workers: list[_Worker] = []
        self._failure: str | None = None
        self._group_up = False
        self._closed = False
        self._stuck = False
        """A call left running on rank 0's thread (``_wait`` gave up on it): closing does not wait for it."""
        self._store: Any = None
        self._loaded: LoadedModel | None = None
        self._tp: TensorParallelExecutor | None = None
        self._thread = _DistThread(self.devices[0], _ONE_GROUP.release)

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    # -- opening -------------------------------------------------------------------------------------------------
    def start(self) -> LoadedModel:
        """Start the workers, load rank 0's shard (as they load theirs), join the process group."""
        self._store = self._wait(self._thread.submit(self._spawn), "starting the workers")
        self._loaded = load_model(self.model, self.dtype, self.devices[0], self.threads, self.quant,
                                  build=functools.partial(shard_model, rank=0, world=self.world))
        self._wait(self._thread.submit(functools.partial(
            dist.init_process_group, self.backend, store=self._store, rank=0, world_size=self.world,
            timeout=self.timeout)), "joining the process group")
        self._group_up = True
        return self._loaded

    def connect(self, num_blocks: int, block_size: int) -> _RankZero:
        """Tell the workers the KV pool's size, wait until every rank holds its executor; rank 0's executor."""
        self._tp = self._wait(self._thread.submit(functools.partial(self._handshake, num_blocks, block_size)),
                              "waiting for the workers to load")
        return _RankZero(self, self._tp)

    def _spawn(self) -> Any:
        """The rendezvous store (port 0: the kernel picks a free one, so nothing races for it) and the workers."""
        store = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True,  # type: ignore[attr-defined]
                              timeout=self.timeout, wait_for_workers=False)
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
               "TICKLOOM_TP_PARENT": str(os.getpid())}
        for rank in range(1, self.world):
            argv = [sys.executable, "-m", WORKER_MODULE, "--rank", str(rank), "--world", str(self.world),
                    f"--model={self.model}", "--device", self.devices[rank], "--backend", self.backend]
            for flag, value in (("--dtype", self.dtype), ("--quant", self.quant), ("--threads", self.threads)):
                if value is not None:
                    argv += [flag, str(value)]
            err = tempfile.TemporaryFile(prefix=f"tickloom-tp-rank{rank}-")  # noqa: SIM115 (closed by close())
            try:
                proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=err)
            except BaseException:
                err.close()
                raise
            self.workers.append(_Worker(rank, proc, err))
        return store

    def _handshake(self, num_blocks: int, block_size: int) -> TensorParallelExecutor:
        assert self._loaded is not None
        executor, failed = build_executors_together(self._loaded.model, torch.device(self.devices[0]),
                                                    (num_blocks, block_size))
        if executor is None or failed:
            self._reap(STOP_WAIT_S)  # the workers exit after the vote; their stderr says why
            reasons = [w.exit_reason(w.proc.returncode) for w in self.workers if w.proc.returncode]
            raise TensorParallelError(f"{failed} of {self.world} ranks could not load the model: "
                                      + ("; ".join(reasons) or "see the log"))
        return TensorParallelExecutor(executor)

    def _wait(self, job: _Job, doing: str) -> Any:
        """``job``'s outcome; raises ``TensorParallelError`` as soon as a worker exits while it runs. (A job left
        running then is bounded by the timeout of the wait it is in, and ``close`` does not wait for it.)"""
        started = time.monotonic()
        while not job.done.wait(0.05):
            try:
                self.check()
                if time.monotonic() - started > self.timeout.total_seconds() + STOP_WAIT_S:
                    raise self.fail(f"{doing} took more than {self.timeout.total_seconds():.0f} s")
            except TensorParallelError:
                self._stuck = True
                raise
        try:
            return job.outcome()
        except TensorParallelError:
            raise
        except Exception as exc:
            raise self.fail(self._exited(1.0) or f"{doing} failed: {type(exc).__name__}: {exc}") from exc

    # -- running -------------------------------------------------------------------------------------------------
    def call(self, fn: Callable[[], T]) -> T:
        """``fn`` on rank 0's thread. An executor's own refusal (``ValueError``, ``KeyError``: every rank refused
        alike) is raised as it is; anything else leaves the ranks out of step, so it breaks the group for good."""
        self.check()
        try:
            return self._thread.call(fn)
        except (ValueError, KeyError):
            raise
        except Exception as exc:
            raise self.fail(self._exited(1.0) or f"{type(exc).__name__}: {exc}") from exc

    def _exited(self, wait: float) -> str | None:
        """Why a worker exited, if one has or does within ``wait`` seconds: after a failed collective, that says
        more than the socket's error (the kernel closes a killed worker's sockets before its parent can reap it)."""
        deadline = time.monotonic() + wait
        while True:
            for worker in self.workers:
                code = worker.proc.poll()
                if code is not None:
                    return worker.exit_reason(code)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def fail(self, reason: str) -> TensorParallelError:
        """Mark the group broken (the first reason is kept); the error to raise."""
        if self._failure is None:
            self._failure = reason
        return TensorParallelError(f"tensor parallelism failed: {self._failure}")

    def check(self) -> None:
        """Raise ``TensorParallelError`` if the group is broken or a worker has exited."""
        if self._failure is not None:
            raise TensorParallelError(f"tensor parallelism failed: {self._failure}")
        for worker in self.workers:
            code = worker.proc.poll()
            if code is not None:
                raise self.fail(worker.exit_reason(code))

    # -- closing -------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (the stop call, then a bounded wait, then SIGKILL), leave the process group, end rank
        0's thread. Idempotent; problems are logged, as this runs while the engine is already closing."""
        if self._closed:
            return
        self._closed = True
        try:
            stopped = False
            if self._tp is not None and self._failure is None and all(w.proc.poll() is None for w in self.workers):
                job = self._thread.submit(self._tp.stop)
                stopped = job.done.wait(STOP_WAIT_S) and job.error is None
                if not stopped:
                    log.warning("tensor parallelism: the stop call did not go out: %r", job.error or "timed out")
            self._reap(STOP_WAIT_S if stopped else 0.0)
        finally:
            if not self._stuck:
                job = self._thread.submit(self._leave)
                if not job.done.wait(STOP_WAIT_S) or job.error is not None:
                    log.warning("tensor parallelism: leaving the process group failed: %r", job.error or "timeout")
            if not self._thread.stop(0.0 if self._stuck else STOP_WAIT_S):
                log.warning("tensor parallelism: rank 0's thread is still in a call; it ends when that times out")
            for worker in self.workers:
                worker.stderr.close()

    def _leave(self) -> None:
        if self._group_up:
            dist.destroy_process_group()
        self._store = None  # the rendezvous server closes

    def _reap(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for the workers to exit, then kill the rest and wait for them."""
        deadline = time.monotonic() + grace
        for worker in self.workers:
            try:
                worker.proc.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                if grace > 0:
                    log.warning("tensor parallelism: rank %d (pid %d) did not stop in %.0f s; killing it",
                                worker.rank, worker.proc.pid, grace)
                worker.proc.kill()
                worker.proc.wait(STOP_WAIT_S)


class _RankZero:
    """The engine's executor when tensor-parallel: ``TensorParallelExecutor``'s calls, made on rank 0's thread."""

    def __init__(self, ranks: TensorParallelRanks, tp: TensorParallelExecutor) -> None:
        self._ranks = ranks
        self._tp = tp
        self.block_size = tp.block_size

    @property
    def num_blocks(self) -> int:
        return self._tp.num_blocks

    def bind(self, command: BindRequest) -> None:
        self._ranks.call(functools.partial(self._tp.bind, command))

    def release(self, request_id: str) -> None:
        self._ranks.call(functools.partial(self._tp.release, request_id))

    def run_step(self, step: RunStep) -> StepResult:
        return self._ranks.call(functools.partial(self._tp.run_step, step))

    def copy_out(self, request_id: str, block_ids: list[int], num_tokens: int) -> HostKV:
        return self._tp.copy_out(request_id, block_ids, num_tokens)  # raises: EngineConfig refuses spill with TP

    def copy_in(self, request_id: str, block_ids: list[int], host_kv: HostKV) -> None:
        self._tp.copy_in(request_id, block_ids, host_kv)
