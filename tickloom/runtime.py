"""Wiring: builds the core, the device, the actors and the log from an ``EngineConfig``, and supervises them.

Supervision: every actor runs in one nursery. A fault reported as an input affects only its requests; an
actor that raises is fatal: every open stream gets ``EngineError`` naming the actor and the cause at once, the
nursery cancels the rest, the log is closed at its last whole frame, and ``Engine.open`` raises that error.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from tickloom.actors.deadlines import DeadlineActor
from tickloom.actors.device import StubDevice, ThreadDevice
from tickloom.actors.log import LogActor, LogWriteFailed
from tickloom.actors.mailbox import Envelope, Outbox, Reporter, Source
from tickloom.actors.retire import ClientStream, GroupStream, RetireActor
from tickloom.actors.spill import SpillActor, SpillStore, SwapInActor
from tickloom.actors.step import StepActor
from tickloom.config import EngineConfig
from tickloom.engine.core import CoreConfig, SchedulerCore
from tickloom.engine.core.config import SchedulingKnobs
from tickloom.engine.errors import ConfigError, EngineError, EngineOverloaded
from tickloom.engine.model.stub import StubTokenizer
from tickloom.events import (
    DIGEST_VERSION,
    FORMAT_VERSION,
    SCHEMA_HASH,
    Command,
    Finish,
    LogExists,
    LogHeader,
    LogWriter,
    RequestArrived,
    Shutdown,
    check_new_log_path,
)

if TYPE_CHECKING:
    from tickloom.engine.model.loaders import LoadedModel
    from tickloom.engine.model.structured import Constraints
    from tickloom.engine.model.tp_launch import TensorParallelRanks

INBOX_SIZE = 4096
ENGINE_VERSION = "0.1.0"


class _FreeSlotsThenRetire:
    """The step actor's retire target: frees the submit slots of each tick's finished requests, then hands the
    commands on to the retire actor."""

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime

    def deliver_nowait(self, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, Finish):
                self._rt.finished(command.request_id)
        self._rt.retire.deliver_nowait(commands)


class Runtime:
    """Everything an open engine holds. Built by ``build_runtime``; used by ``Engine``."""

    def __init__(self, config: EngineConfig, core_config: CoreConfig, tokenizer: Any, fingerprint: str,
                 executor: Any, torch_info: tuple[str, str, str, int],
                 ranks: TensorParallelRanks | None = None) -> None:
        self.config = config
        self.ranks = ranks
        """The other ranks of a tensor-parallel engine (``tensor_parallel_size > 1``), stopped by ``close``."""
        self.core_config = core_config
        self.tokenizer = tokenizer
        self.constraints: Constraints | None = getattr(executor, "constraints", None)
        """The grammar engine that checks and runs structured-output constraints; None where none runs (the stub
        model, tensor parallelism)."""
        self.fatal: EngineError | None = None
        self.closing = False
        self.live: set[str] = set()
        self.live_changed = trio.Event()
        self.started_at = time.monotonic()
        send, self._inbox = trio.open_memory_channel[Envelope](INBOX_SIZE)
        self.client = Outbox(Source.CLIENT, send)
        # Open requests are bounded by max_waiting, the core's waiting bound: however they split between waiting
        # and running, the core never has to refuse one for a full queue.
        limit = core_config.max_waiting + 64
        self._slots = trio.Semaphore(core_config.max_waiting)
        self.max_slots = core_config.max_waiting
        self._multi_slots = trio.Lock()
        self.store: SpillStore | None = None
        self.spill: SpillActor | None = None
        self.swap_in: SwapInActor | None = None
        self.log: LogActor | None = None
        self._new_writer: LogWriter | None = None
        try:
            self._wire(config, core_config, tokenizer, fingerprint, executor, torch_info, send, limit)
        except BaseException:  # a failed start leaves nothing behind: no spill directory, no log file
            if self._new_writer is not None:
                self._new_writer.discard()
            if self.store is not None:
                self.store.discard()
            raise
        self._new_writer = None

    def _wire(self, config: EngineConfig, core_config: CoreConfig, tokenizer: Any, fingerprint: str, executor: Any,
              torch_info: tuple[str, str, str, int], send: trio.MemorySendChannel[Envelope], limit: int) -> None:
        """Build the spill store, the device, the actors, the log and the core (``__init__`` undoes it on failure)."""
        faults = config.faults
        if config.spill_enabled:
            self.store = _new_spill_store(config.spill_dir, config.host_spill_bytes)
            fail_spill = set(faults.fail_spill) if faults else set()
            self.spill = SpillActor(self.store, Outbox(Source.SPILL, send.clone()), limit,
                                    fault=lambda rid: "injected spill write error" if rid in fail_spill else None)
            fail_swap = set(faults.fail_swap_in) if faults else set()
            self.swap_in = SwapInActor(self.store, Outbox(Source.SWAP_IN, send.clone()), limit,
                                       fault=lambda rid: "injected swap-in read error" if rid in fail_swap else None)
        device_outbox = Outbox(Source.DEVICE, send.clone())
        self.device: ThreadDevice | StubDevice
        if executor is None:
            step_time = config.stub_step_time
            self.device = StubDevice(device_outbox, self.spill, limit * 4, vocab_size=core_config.vocab_size,
                                     step_time=lambda _step: step_time, avoid=core_config.eos_token_ids,
                                     fail_steps=frozenset(faults.fail_steps) if faults else frozenset(),
                                     block_size=core_config.block_size,
                                     extras=faults.stub_extras if faults else 0)
        else:
            self.device = ThreadDevice(executor, device_outbox, self.spill, limit * 4,
                                       fail_steps=frozenset(faults.fail_steps) if faults else frozenset())
        self.reporter = Reporter(Outbox(Source.RETIRE, send.clone()), limit, "retire",
                                 delay=faults.report_delay if faults else 0.0)
        self.retire = RetireActor(tokenizer, self.reporter.report_nowait)
        self.deadlines = DeadlineActor(Outbox(Source.DEADLINE, send.clone()), limit)
        if config.log_path is not None:
            header = LogHeader(
                format_version=FORMAT_VERSION, schema_hash=SCHEMA_HASH, digest_version=DIGEST_VERSION,
                engine_version=ENGINE_VERSION,
                config_json=json.dumps({"core": json.loads(core_config.to_json()),
                                        "engine": json.loads(msgspec.json.encode(config))}, sort_keys=True),
                model_fingerprint=fingerprint, tokenizer_fingerprint=fingerprint, torch_version=torch_info[0],
                device=torch_info[1], dtype=torch_info[2], threads=torch_info[3],
                snapshot_every=config.snapshot_every,
            )
            self._new_writer = _new_log(config.log_path, header)
            self.log = LogActor(self._new_writer, config.fsync)
        self.core = SchedulerCore(core_config)
        self.step = StepActor(self.core, self._inbox, device=self.device, deadlines=self.deadlines,
                              retire=_FreeSlotsThenRetire(self), spill=self.spill, swap_in=self.swap_in, log=self.log,
                              fsync=config.fsync, snapshot_every=config.snapshot_every)

    # -- supervision -----------------------------------------------------------------------------------------
    def actors(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        tasks: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("step", self.step.run), ("device", self.device.run), ("deadlines", self.deadlines.run),
            ("retire", self.retire.run), ("retire", self.reporter.run),
        ]
        if self.spill is not None and self.swap_in is not None:
            tasks += [("spill", self.spill.run), ("swap-in", self.swap_in.run)]
        if self.log is not None:
            tasks.append(("log", self.log.run))
        faults = self.config.faults
        if faults is not None and faults.crash_actor is not None:
            tasks.append((faults.crash_actor, self._injected_crash))
        if self.ranks is not None:
            tasks.append(("device", self._watch_ranks))
        return tasks

    async def _watch_ranks(self) -> None:
        """A tensor-parallel worker that exits, or a broken process group, is fatal (the device's ranks are gone)."""
        assert self.ranks is not None
        while True:
            self.ranks.check()
            await trio.sleep(0.05)

    async def _injected_crash(self) -> None:
        assert self.config.faults is not None
        await trio.sleep(self.config.faults.crash_after)
        raise RuntimeError("injected crash")

    async def _guard(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        try:
            await run()
        except Exception as exc:
            error = EngineError("log" if isinstance(exc, LogWriteFailed) else name, exc)
            self._fail(error)
            raise error from exc

    def _fail(self, error: EngineError) -> None:
        """The engine's fatal error (the first one is kept): every open stream gets it."""
        if self.fatal is None:
            self.fatal = error
            self.retire.fail_all(error)
            self.live_changed.set()

    @asynccontextmanager
    async def supervise(self) -> AsyncIterator[trio.Nursery]:
        async with trio.open_nursery() as nursery:
            for name, run in self.actors():
                nursery.start_soon(self._guard, name, run, name=f"tickloom-{name}")
            yield nursery

    async def shutdown(self) -> None:
        """End what is left with explicit errors (the core's shutdown input), then stop the device."""
        self.closing = True
        self._check_ranks()
        if self.fatal is None:
            with trio.move_on_after(10):
                await self.reporter.wait_flushed()  # streams closed before this end cancelled, not shut down
                await self.client.send(Shutdown())
                await self.step.shut_down.wait()
            self._check_ranks()
        self.device.stop_nowait()

    def _check_ranks(self) -> None:
        """A tensor-parallel rank lost between two looks of the watcher (a failed step ends its requests first, so
        their client may already be leaving) is fatal all the same."""
        if self.ranks is not None and self.fatal is None:
            try:
                self.ranks.check()
            except Exception as exc:  # TensorParallelError: made the engine's fatal error, raised by Engine.open
                self._fail(EngineError("device", exc))

    def close(self) -> None:
        """Release what outlives the nursery: the log (closed at its last whole frame), spill files, the
        structured-output mask worker and the tensor-parallel workers (the device thread has ended, so no call is
        in flight)."""
        try:
            if self.log is not None:
                if self.fatal is not None and self.fatal.actor == "log":
                    self.log.writer.abandon()
                else:
                    self.log.writer.close()
            if self.store is not None:
                self.store.close()
        finally:
            try:
                if self.constraints is not None:
                    self.constraints.close()
            finally:
                if self.ranks is not None:
                    self.ranks.close()

    # -- requests --------------------------------------------------------------------------------------------
    def now_ns(self) -> int:
        return int(trio.current_time() * 1e9)

    async def acquire_slot(self) -> None:
        if self.config.overload == "reject":
            try:
                self._slots.acquire_nowait()
            except trio.WouldBlock:
                raise EngineOverloaded(f"{len(self.live)} requests are open; the waiting queue is full") from None
        else:
            await self._slots.acquire()

    async def acquire_slots(self, count: int) -> None:
        """``count`` submit slots, all or none (the ``n`` choices of one request are ``n`` core requests).

        One multi-slot acquisition runs at a time, so no two can each hold a part of what they need and wait for
        the other's: whatever the first waits for is held by requests that finish."""
        if count == 1:
            await self.acquire_slot()
            return
        if self.config.overload == "reject":
            if self._slots.value < count:
                raise EngineOverloaded(f"{len(self.live)} requests are open; the waiting queue has no room for "
                                       f"{count} more")
            for _ in range(count):
                self._slots.acquire_nowait()
            return
        async with self._multi_slots:
            got = 0
            try:
                for _ in range(count):
                    await self._slots.acquire()
                    got += 1
            except BaseException:
                for _ in range(got):
                    self._slots.release()
                raise

    def release_slot(self) -> None:
        self._slots.release()

    @property
    def free_slots(self) -> int:
        """Submit slots not held by an open request (all ``core_config.max_waiting`` of them when idle)."""
        return int(self._slots.value)

    def open_stream(self, arrival: RequestArrived) -> ClientStream:
        self.live.add(arrival.request_id)
        return self.retire.open_stream(arrival.request_id, arrival.params, len(arrival.prompt_token_ids),
                                       trio.current_time(), prompt_token_ids=arrival.prompt_token_ids)

    def open_group(self, request_id: str, arrivals: Sequence[RequestArrived]) -> GroupStream:
        """One stream over the arrivals of the ``n`` choices of ``request_id`` (``RetireActor.open_group``)."""
        self.live.update(a.request_id for a in arrivals)
        first = arrivals[0]
        return self.retire.open_group(request_id, [a.request_id for a in arrivals], first.params,
                                      len(first.prompt_token_ids), trio.current_time(),
                                      prompt_token_ids=first.prompt_token_ids)

    def finished(self, request_id: str) -> None:
        if request_id in self.live:
            self.live.discard(request_id)
            self.release_slot()
            self.live_changed.set()
            self.live_changed = trio.Event()

    def stats(self) -> dict[str, Any]:
        gauges = self.core.gauges()
        s = self.step.stats
        elapsed = max(time.monotonic() - self.started_at, 1e-9)
        return {
            "waiting": gauges.waiting, "running": gauges.running, "preempted": gauges.preempted,
            "swapped": gauges.swapped, "blocks_free": gauges.free_blocks, "blocks_cached": gauges.cached_blocks,
            "blocks_total": self.core_config.num_blocks, "ticks": s.ticks, "steps": s.steps, "tokens": s.tokens,
            "tokens_per_s": s.tokens / elapsed, "preemptions": s.preemptions, "swaps": s.swaps,
            "spill_bytes": self.store.spilled_bytes if self.store is not None else 0, "log_bytes": s.log_bytes,
        }


def _new_log(path: str, header: LogHeader) -> LogWriter:
    """Create the log at ``log_path``. An existing path is never overwritten: it, and any other failure to create
    the file, is a ``ConfigError`` naming ``log_path``."""
    try:
        return LogWriter(path, header)
    except LogExists as exc:
        raise ConfigError(str(exc)) from exc
    except OSError as exc:
        raise ConfigError(f"log_path={path!r} cannot be created: {exc}") from exc


def _new_spill_store(directory: str | None, host_bytes: int) -> SpillStore:
    """The spill store. Any failure to make or use ``spill_dir`` (not a directory, read-only, no permission, a full
    disk) is a ``ConfigError`` naming ``spill_dir`` and the reason; the store has removed what it made."""
    try:
        return SpillStore(directory, host_bytes)
    except OSError as exc:
        raise ConfigError(f"spill_dir={directory!r} cannot be used: {exc}") from exc


def _check_log_path(path: str) -> None:
    """Refuse a taken ``log_path`` before loading a model; ``_new_log`` refuses atomically again later."""
    try:
        check_new_log_path(path)
    except LogExists as exc:
        raise ConfigError(str(exc)) from exc


def core_config_for(config: EngineConfig, **derived: Any) -> CoreConfig:
    """The core's configuration: ``config``'s scheduling knobs as they are, overridden by what the engine derives
    from the model (``num_blocks``, ``vocab_size``, ``eos_token_ids``, a ``max_seq_len`` capped by its context)."""
    knobs = {name: getattr(config, name) for name in SchedulingKnobs.__struct_fields__}
    return CoreConfig(**{**knobs, "spill_enabled": config.spill_enabled, **derived})


async def build_runtime(config: EngineConfig) -> Runtime:
    """Load the model (in a worker thread) and wire everything; nothing runs until ``supervise``."""
    if config.log_path is not None:
        _check_log_path(config.log_path)
    if config.model == "stub":
        tokenizer = StubTokenizer(config.stub_vocab_size)
        num_blocks = config.num_blocks or 1024
        core_config = core_config_for(config, num_blocks=num_blocks, vocab_size=config.stub_vocab_size,
                                      eos_token_ids=(tokenizer.eos_token_id,))
        return Runtime(config, core_config, tokenizer, "stub", None, ("", "stub", "", 0))
    from tickloom.engine.model.executor import ModelExecutor
    from tickloom.engine.model.loaders import load_model

    ranks: TensorParallelRanks | None = None
    if config.tensor_parallel_size > 1:
        ranks, loaded = await _start_ranks(config)
    else:
        try:
            loaded = await trio.to_thread.run_sync(load_model, config.model, config.dtype, config.device,
                                                   config.threads, config.quant)
        except OSError as exc:  # the loader names most problems (ModelLoadError); an OS error left over is ours
            raise _model_error(config.model, exc) from exc
    try:
        import torch

        mcfg = loaded.config
        max_seq_len = min(config.max_seq_len, mcfg.max_position_embeddings)
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        else:  # a rank's cache holds its share of the kv heads (loaded.model.cfg is the shard's)
            dtype_bytes = torch.tensor([], dtype=loaded.model.dtype).element_size()
            per_block = (2 * mcfg.num_layers * config.block_size * loaded.model.cfg.num_kv_heads * mcfg.head_dim
                         * dtype_bytes)
            num_blocks = max(config.kv_memory_bytes // per_block, max_seq_len // config.block_size + 1)
        core_config = core_config_for(config, num_blocks=num_blocks, max_seq_len=max_seq_len,
                                      vocab_size=mcfg.vocab_size, eos_token_ids=tuple(mcfg.eos_token_ids))
        executor: Any
        if ranks is None:
            from tickloom.engine.model.speculate import ProposerSetting, make_proposer
            from tickloom.engine.model.structured import ConstraintLimits, Constraints

            limits = ConstraintLimits(max_text_chars=config.max_constraint_chars,
                                      max_grammar_size=config.max_constraint_grammar_size)
            constraints = Constraints(loaded.tokenizer, mcfg.vocab_size, tuple(mcfg.eos_token_ids), limits)
            proposer = None
            if config.speculative_tokens:
                setting = ProposerSetting(config.speculative_proposer, config.speculative_draft_model,
                                          config.speculative_draft_quant)
                try:
                    proposer = await trio.to_thread.run_sync(functools.partial(
                        make_proposer, setting, target=config.model, target_vocab=mcfg.vocab_size,
                        dtype=config.dtype, device=config.device, num_blocks=num_blocks,
                        block_size=config.block_size))
                except (OSError, ValueError) as exc:
                    raise ConfigError(f"EngineConfig.speculative_proposer={config.speculative_proposer!r}: "
                                      f"{exc}") from exc
            executor = ModelExecutor(loaded.model, num_blocks, config.block_size, constraints, proposer)
        else:
            executor = await trio.to_thread.run_sync(ranks.connect, num_blocks, config.block_size)
        dtype_name = str(loaded.model.dtype).removeprefix("torch.")
        if loaded.model.quant != "none":  # "bfloat16+int4": what replay --full passes back to load_model
            dtype_name = f"{dtype_name}+{loaded.model.quant}"
        info = (str(torch.__version__), str(loaded.model.device), dtype_name, torch.get_num_threads())
        if config.chat_template is not None:  # the template's text: EngineConfig read and compiled it
            loaded.tokenizer.replace_chat_template(config.chat_template)
        return Runtime(config, core_config, loaded.tokenizer, loaded.fingerprint, executor, info, ranks)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise


def _model_error(model: str, exc: OSError) -> ConfigError:
    return ConfigError(f"model={model!r} cannot be loaded: {exc}")


async def _start_ranks(config: EngineConfig) -> tuple[TensorParallelRanks, LoadedModel]:
    """Check that the model can be sharded over ``tensor_parallel_size`` ranks (a ``ConfigError`` naming it),
    start the workers and load rank 0's shard (``engine/model/tp_launch.py``)."""
    from tickloom.engine.model.tp import shard_config
    from tickloom.engine.model.tp_launch import TensorParallelRanks, read_model_config

    world = config.tensor_parallel_size
    try:
        mcfg = await trio.to_thread.run_sync(read_model_config, config.model)
    except OSError as exc:
        raise _model_error(config.model, exc) from exc
    try:
        shard_config(mcfg, world)
        ranks = TensorParallelRanks(world, config.model, dtype=config.dtype, device=config.device,
                                    threads=config.threads, quant=config.quant)
    except ValueError as exc:
        raise ConfigError(f"EngineConfig.tensor_parallel_size={world}: {exc}") from None
    try:
        return ranks, await trio.to_thread.run_sync(ranks.start)
    except BaseException:
        ranks.close()
        raise
