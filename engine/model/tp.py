"""Tensor parallelism: one Llama/Qwen2 model sharded over ``torch.distributed`` ranks (gloo on CPU, nccl on CUDA).

Megatron's split, built from what ``llama.py`` already has, without touching its forward:

- **Attention by heads.** Rank ``r`` of ``W`` keeps query heads ``[r·H/W, (r+1)·H/W)`` and kv heads
  ``[r·K/W, (r+1)·K/W)`` (the rows of q/k/v and their biases) and the matching columns of ``o_proj``. Each kv head
  serves the same query heads as unsharded (``H/K`` of them, contiguous), so a rank's attention is the unsharded
  attention of its heads, over a KV cache that holds only its kv heads.
- **MLP by intermediate channels.** Rows ``[r·I/W, (r+1)·I/W)`` of ``gate_proj`` and ``up_proj``, the matching
  columns of ``down_proj``.
- ``o_proj`` and ``down_proj`` then give partial sums: each is wrapped (``AllReduced``) so that its output is summed
  over the ranks. Everything else (embedding, norms, LM head) is replicated, so after each all-reduce every rank
  holds the same hidden state, the same logits, and samples the same token (the sampler is counter-based: seed and
  position, no hidden state).

A rank's model is a plain ``LlamaModel`` built from its shards and a per-rank ``ModelConfig`` (heads, kv heads and
intermediate size divided by ``W``); the only hook is the two wrapped projections per layer. Floating-point sums
are regrouped (each rank's partial dot products, then the all-reduce), which can move a logit in its last bits;
the tests check that the tokens are those of one rank, greedy and seeded.

The scheduler core stays single: rank 0 hosts it (the engine, the simulator) with a ``TensorParallelExecutor`` as
its executor. Each call (bind, run a step, release) is encoded with msgspec and broadcast to the other ranks, which
run ``serve_rank`` and make the same call on their shard, so every rank receives the same commands in the same
order. Spilling KV to the host is not supported with more than one rank (each rank holds a shard).

The engine turns this on with ``EngineConfig.tensor_parallel_size``: ``tp_launch.py`` starts the other ranks as
worker processes (``tp_worker.py``), loads rank 0's shard in the engine's process, runs every call on one thread,
and stops the workers when the engine closes or fails. ``tests/test_tp.py`` drives the ranks by hand (the core in
the simulator), ``tests/test_tp_engine.py`` through ``Engine.open``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from tickloom.engine.model.config import ModelConfig
from tickloom.engine.model.executor import ModelExecutor
from tickloom.engine.model.kv_cache import HostKV
from tickloom.engine.model.llama import LlamaModel
from tickloom.engine.model.quant import Linear, RawBlocks, Weight
from tickloom.engine.model.types import StepResult
from tickloom.events.commands import BindRequest, RunStep

log = logging.getLogger(__name__)


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The configuration one rank's model has: heads, kv heads and intermediate channels divided by ``world``."""
    for name, value in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % world:
            raise ValueError(f"tensor parallelism over {world} ranks needs {name}={value} divisible by {world}")
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                               intermediate_size=cfg.intermediate_size // world)


def _rows(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = w.shape[0] // world
    return w[rank * n : (rank + 1) * n].contiguous()


def _cols(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = w.shape[1] // world
    return w[:, rank * n : (rank + 1) * n].contiguous()


def shard_tensors(cfg: ModelConfig, tensors: Mapping[str, Weight], rank: int, world: int) -> dict[str, Weight]:
    """Rank ``rank``'s tensors (Hugging Face names): q/k/v rows (and biases) and gate/up rows split, o/down columns
    split, the rest as they are. GGUF block tensors that are split are dequantized first."""
    out: dict[str, Weight] = {}
    for name, w in tensors.items():
        split = name.rsplit(".", 2)
        kind = ".".join(split[-2:]) if len(split) == 3 else name
        if kind in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias",
                    "v_proj.bias", "gate_proj.weight", "up_proj.weight"):
            out[name] = _rows(_dense(w), rank, world)
        elif kind in ("o_proj.weight", "down_proj.weight"):
            out[name] = _cols(_dense(w), rank, world)
        else:
            out[name] = w
    return out


def _dense(w: Weight) -> torch.Tensor:
    return w.dequantize() if isinstance(w, RawBlocks) else w


class AllReduced:
    """A ``Linear`` whose output is summed over the ranks of ``group`` (a row-parallel projection)."""

    __slots__ = ("group", "in_features", "inner", "out_features")

    def __init__(self, inner: Linear, group: Any = None) -> None:
        self.inner = inner
        self.group = group
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        dist.all_reduce(y, group=self.group)
        return y

    def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
        """As ``__call__``, float32 (``LlamaModel._project``)."""
        as_f32 = getattr(self.inner, "forward_f32", None)
        y = as_f32(x) if as_f32 is not None else self.inner(x).float()
        dist.all_reduce(y, group=self.group)
        return y

    def nbytes(self) -> int:
        return self.inner.nbytes()


def shard_model(cfg: ModelConfig, tensors: Mapping[str, Weight], dtype: torch.dtype, device: torch.device,
                quant: str = "none", *, rank: int, world: int, group: Any = None) -> LlamaModel:
    """Rank ``rank``'s model: a ``LlamaModel`` of its shards, its row-parallel projections all-reduced."""
    model = LlamaModel(shard_config(cfg, world), shard_tensors(cfg, tensors, rank, world), dtype, device, quant)
    if world > 1:
        for layer in model.layers:
            layer.wo = AllReduced(layer.wo, group)
            layer.w2 = AllReduced(layer.w2, group)
        model.layers_changed()  # the all-reduces run in the layer loop: no fused call may go around them
    return model


# -- the commands every rank receives ----------------------------------------------------------------------------
class _Bind(msgspec.Struct, frozen=True, tag="bind", array_like=True):
    command: BindRequest


class _Step(msgspec.Struct, frozen=True, tag="step", array_like=True):
    step: RunStep


class _Release(msgspec.Struct, frozen=True, tag="release", array_like=True):
    request_id: str


class _Stop(msgspec.Struct, frozen=True, tag="stop", array_like=True):
    pass


_Call = _Bind | _Step | _Release | _Stop
_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[_Call] = msgspec.msgpack.Decoder(_Call)


def _broadcast(call: _Call | None, device: torch.device, group: Any = None) -> _Call:
    """Rank 0 sends ``call``; every rank returns it. Bytes, never pickled objects: a length, then the payload."""
    if dist.get_rank(group) == 0:
        assert call is not None
        data = _encoder.encode(call)
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        dist.broadcast(size, 0, group=group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), 0, group=group)
        return call
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, 0, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, 0, group=group)
    return _decoder.decode(payload.cpu().numpy().tobytes())


def _apply(executor: ModelExecutor, call: _Call) -> StepResult | None:
    if isinstance(call, _Bind):
        executor.bind(call.command)
    elif isinstance(call, _Step):
        return executor.run_step(call.step)
    elif isinstance(call, _Release):
        executor.release(call.request_id)
    return None


class TensorParallelExecutor:
    """Rank 0's executor: the ``ModelExecutor`` API; each call is broadcast to the other ranks, then made here.

    The other ranks run ``serve_rank`` until ``stop``. A step that raises on rank 0 raised on every rank (they run the
    same code on the same inputs), so the ranks stay in step."""

    def __init__(self, executor: ModelExecutor, group: Any = None) -> None:
        if dist.get_rank(group) != 0:
            raise ValueError("TensorParallelExecutor runs on rank 0; the other ranks run serve_rank")
        self.executor = executor
        self.group = group
        self.model = executor.model
        self.block_size = executor.block_size

    @property
    def num_blocks(self) -> int:
        return self.executor.num_blocks

    def _call(self, call: _Call) -> StepResult | None:
        _broadcast(call, self.model.device, self.group)
        return _apply(self.executor, call)

    def bind(self, command: BindRequest) -> None:
        self._call(_Bind(command))

    def run_step(self, step: RunStep) -> StepResult:
        result = self._call(_Step(step))
        assert result is not None
        return result

    def release(self, request_id: str) -> None:
        self._call(_Release(request_id))

    def is_bound(self, request_id: str) -> bool:
        return self.executor.is_bound(request_id)

    def block_table(self, request_id: str) -> list[int]:
        return self.executor.block_table(request_id)

    def copy_out(self, request_id: str, block_ids: list[int], num_tokens: int) -> HostKV:
        raise NotImplementedError("spilling KV is not supported with tensor parallelism (each rank holds a shard)")

    def copy_in(self, request_id: str, block_ids: list[int], host_kv: HostKV) -> None:
        raise NotImplementedError("spilling KV is not supported with tensor parallelism (each rank holds a shard)")

    def stop(self) -> None:
        """Release the other ranks from ``serve_rank``."""
        _broadcast(_Stop(), self.model.device, self.group)


def build_executors_together(model: LlamaModel | None, device: torch.device, pool: tuple[int, int] | None = None,
                             group: Any = None) -> tuple[ModelExecutor | None, int]:
    """Every rank at once: take the KV pool's ``(num_blocks, block_size)`` from rank 0 (its ``pool``), build this
    rank's executor (``model`` None: its shard did not load), and count the ranks that could not. Why a vote: a rank
    that failed still takes part in both collectives, so no rank waits for one that never comes, and all of them
    learn at once whether to serve or to exit."""
    setup = torch.tensor(pool or (0, 0), dtype=torch.int64, device=device)
    dist.broadcast(setup, 0, group=group)
    num_blocks, block_size = (int(v) for v in setup.tolist())
    executor: ModelExecutor | None = None
    if model is not None:
        try:
            executor = ModelExecutor(model, num_blocks, block_size)
        except Exception:  # counted in the vote; the traceback goes to stderr, which rank 0 reads back
            log.exception("a tensor-parallel rank could not build its executor")
    failed = torch.tensor([int(executor is None)], dtype=torch.int64, device=device)
    dist.all_reduce(failed, group=group)
    return executor, int(failed.item())


def serve_rank(executor: ModelExecutor, group: Any = None) -> int:
    """A rank other than 0: make every call rank 0 broadcasts on this rank's shard, until it stops; the calls made.

    An exception here is the same one rank 0 raised for the same call (``run_step``'s input checks), so it is
    carried on past, as rank 0's device reports its step failed and goes on."""
    calls = 0
    while True:
        call = _broadcast(None, executor.model.device, group)
        if isinstance(call, _Stop):
            return calls
        calls += 1
        try:
            _apply(executor, call)
        except (ValueError, KeyError):
            continue  # rank 0 raised the same for this call and reports the step failed
