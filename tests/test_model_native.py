"""Issue 16: tickloom's own CPU kernels (``engine/model/native.py``, ``cpu_kernels.c``) against plain torch
references: the int4 matmul at every remainder of its row tiling, the paged decode attention over scattered
blocks, the properties replay leans on (a row's result does not depend on its batch or the thread count), and the
fallback when the kernels are off."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tickloom.engine.model import native, packing

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")


def _weights(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor]:
    """Random GGUF-order nibbles, float16-exact s and z, and the float32 weight they encode."""
    rng = np.random.default_rng(seed)
    g = k // 32
    q = rng.integers(0, 16, (n, g, 32), dtype=np.uint8)
    nibbles = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
    s = (rng.random((n, g)) * 0.02 + 0.001).astype(np.float16).astype(np.float32)
    z = (-8 * s + rng.normal(0, 0.01, (n, g))).astype(np.float16).astype(np.float32)
    w = q.astype(np.float32) * s[..., None] + z[..., None]
    return nibbles, s, z, torch.from_numpy(w.reshape(n, k))


def test_pack_and_unpack_are_inverse() -> None:
    nibbles, s, z, _ = _weights(48, 96, seed=1)
    tiles = packing.pack_tiles(nibbles, s, z)
    assert tiles.shape == (3, 3, packing.TILE_BYTES)
    back = packing.unpack_tiles(tiles)
    assert np.array_equal(back[0], nibbles) and np.array_equal(back[1], s) and np.array_equal(back[2], z)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 21])
def test_matmul_matches_the_dequantized_weight_at_every_tile_remainder(m: int) -> None:
    """Rows go through the kernel 8 at a time and the rest 1..7 at a time, each count its own code path."""
    nibbles, s, z, w = _weights(64, 160, seed=m)
    x = torch.randn(m, 160, generator=torch.Generator().manual_seed(m)).bfloat16()
    y = native.matmul(x, packing.pack_tiles(nibbles, s, z), 64)
    ref = x.float() @ w.t()
    assert y.dtype == torch.bfloat16 and y.shape == (m, 64)
    # int8 activations per group of 32 (rounding error up to 1/254 of the group's largest value), bfloat16 out
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2


def test_matmul_of_zero_activations_is_exactly_zero() -> None:
    """A group of zeros has no scale to divide by; it must contribute nothing (not NaN)."""
    nibbles, s, z, _ = _weights(16, 64, seed=3)
    y = native.matmul(torch.zeros(2, 64, dtype=torch.bfloat16), packing.pack_tiles(nibbles, s, z), 16)
    assert torch.equal(y, torch.zeros(2, 16, dtype=torch.bfloat16))


def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads() -> None:
    """Replay and preemption re-run rows in other batches: the kernel must give the same bits."""
    nibbles, s, z, _ = _weights(128, 256, seed=4)
    tiles = packing.pack_tiles(nibbles, s, z)
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    whole = native.matmul(x, tiles, 128)
    for i in range(11):
        assert torch.equal(native.matmul(x[i : i + 1].contiguous(), tiles, 128), whole[i : i + 1])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(native.matmul(x, tiles, 128), whole)
    finally:
        torch.set_num_threads(before)


def test_the_scratch_buffer_is_kept_per_thread_and_grown_when_too_small() -> None:
    """The kernels' scratch is reused between calls of one thread, grown when a call needs more, and never shared
    by two threads (a draft model and its target may multiply at once)."""
    first = native._scratch_at_least(1024)
    assert native._scratch_at_least(512) == first  # kept
    grown = native._scratch_at_least(1 << 24)
    assert native._scratch_at_least(1 << 24) == grown
    other: list[int] = []
    worker = threading.Thread(target=lambda: other.append(native._scratch_at_least(1024)))
    worker.start()
    worker.join()
    assert other[0] not in (first, grown)
    # a large call after a small one, and a small one after it, give what fresh buffers give
    nibbles, s, z, _ = _weights(32, 4096, seed=8)
    tiles = packing.pack_tiles(nibbles, s, z)
    x = torch.randn(40, 4096, generator=torch.Generator().manual_seed(8)).bfloat16()
    small = native.matmul(x[:1].contiguous(), tiles, 32)
    big = native.matmul(x, tiles, 32)
    assert torch.equal(native.matmul(x[:1].contiguous(), tiles, 32), small)
    assert torch.equal(big[:1], small)


@pytest.mark.parametrize("m", [1, 2, 3, 9])
def test_the_float32_output_is_the_same_sums_unrounded(m: int) -> None:
    """``int_matmul``'s float32 output (the o and down projections, added to the float32 residual stream): the very
    sums the bfloat16 output rounds to nearest even, on both row paths (one or two rows a pass, and more),
    batch-invariant."""
    nibbles, s, z, _ = _weights(64, 160, seed=10 + m)
    tiles = packing.pack_tiles(nibbles, s, z)
    x = torch.randn(m, 160, generator=torch.Generator().manual_seed(m)).bfloat16()
    y32 = native.matmul(x, tiles, 64, torch.float32)
    assert y32.dtype == torch.float32 and y32.shape == (m, 64)
    assert torch.equal(y32.bfloat16(), native.matmul(x, tiles, 64))
    assert not torch.equal(y32, y32.bfloat16().float()), "the float32 output is not rounded to bfloat16"
    assert torch.equal(native.matmul(x[-1:].contiguous(), tiles, 64, torch.float32), y32[-1:])


def test_matmul_rejects_shapes_it_cannot_tile() -> None:
    nibbles, s, z, _ = _weights(16, 64, seed=5)
    with pytest.raises(ValueError, match="N=8"):
        native.matmul(torch.zeros(1, 64, dtype=torch.bfloat16), packing.pack_tiles(nibbles, s, z), 8)


def _attention_case(lengths: list[int], kv_heads: int, groups: int, head_dim: int, block_size: int, seed: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    per_row = max(-(-n // block_size) for n in lengths)
    kv = torch.randn(2 * kv_heads, num_blocks, block_size, head_dim, generator=g).bfloat16()
    # scattered, distinct blocks per row; padding entries point at block 0, as build_step_batch pads
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = torch.zeros(len(lengths), per_row, dtype=torch.long)
    at = 0
    for r, n in enumerate(lengths):
        need = -(-n // block_size)
        tables[r, :need] = perm[at : at + need]
        at += need
    width = (kv_heads * groups + 2 * kv_heads) * head_dim
    qkv = torch.randn(len(lengths), width, generator=g).bfloat16()
    return qkv, kv, tables, torch.tensor(lengths, dtype=torch.long), torch.empty(0)


def _reference(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, groups: int,
               scale: float) -> torch.Tensor:
    kvh, d = kv.shape[0] // 2, kv.shape[3]
    out = []
    for r in range(q.shape[0]):
        n = int(lengths[r])
        k = kv[:kvh, tables[r]].reshape(kvh, -1, d)[:, :n].float()
        v = kv[kvh:, tables[r]].reshape(kvh, -1, d)[:, :n].float()
        qq = q[r].float().view(kvh, groups, d)
        out.append((torch.softmax(qq @ k.transpose(1, 2) * scale, -1) @ v).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize(("lengths", "kv_heads", "groups", "head_dim"), [
    ([1], 3, 3, 64),  # the first token attends to itself only
    ([16], 3, 3, 64),  # exactly one full block
    ([17], 1, 4, 32),  # one past a block boundary
    ([200], 3, 3, 64),  # several vector chunks of scores plus a remainder
    ([5, 33, 100, 64], 2, 2, 128),  # rows of different lengths in one call
])
def test_decode_attention_matches_softmax_attention(lengths: list[int], kv_heads: int, groups: int,
                                                    head_dim: int) -> None:
    qkv, kv, tables, lens, _ = _attention_case(lengths, kv_heads, groups, head_dim, 16, seed=len(lengths))
    q = qkv[:, : kv_heads * groups * head_dim]  # a column slice: rows are strided, as in the forward
    got = native.decode_attention(q, kv, tables.reshape(-1), lens, groups, head_dim**-0.5)
    ref = _reference(q, kv, tables, lens, groups, head_dim**-0.5)
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    assert float((got.float() - ref).abs().max()) < 2e-2  # bfloat16 output of values near 1


@pytest.mark.parametrize(("lengths", "kv_heads", "groups", "head_dim"), [
    ([1], 3, 3, 64),
    ([200], 3, 3, 64),
    ([5, 33, 100, 64], 2, 2, 128),
])
def test_decode_attention_of_a_float32_model_is_float32_throughout(lengths: list[int], kv_heads: int, groups: int,
                                                                  head_dim: int) -> None:
    """A float32 model's cache and queries: the same kernel reading float32, to float32's precision (the bfloat16
    form's tolerance is 2e-2: its output is rounded to 8 bits)."""
    qkv, kv, tables, lens, _ = _attention_case(lengths, kv_heads, groups, head_dim, 16, seed=len(lengths))
    kv32 = kv.float() + torch.randn(kv.shape, generator=torch.Generator().manual_seed(1)) * 1e-3  # not bf16 values
    q = (qkv.float() + 1e-3)[:, : kv_heads * groups * head_dim]
    got = native.decode_attention(q, kv32, tables.reshape(-1), lens, groups, head_dim**-0.5)
    ref = _reference(q, kv32, tables, lens, groups, head_dim**-0.5)
    assert got.dtype == torch.float32
    assert float((got - ref).abs().max()) < 1e-5
    with pytest.raises(ValueError, match="both the same"):
        native.decode_attention(q, kv, tables.reshape(-1), lens, groups, head_dim**-0.5)


def test_decode_attention_ignores_blocks_past_the_length() -> None:
    """Positions at or past a row's length must not count, whatever the cache holds there."""
    qkv, kv, tables, lens, _ = _attention_case([20], 2, 2, 32, 16, seed=7)
    q = qkv[:, :128]
    first = native.decode_attention(q, kv, tables.reshape(-1), lens, 2, 0.2)
    kv[:, tables[0, 1], 4:] = 100.0  # the second block's slots 4.. (positions 20..31)
    assert torch.equal(native.decode_attention(q, kv, tables.reshape(-1), lens, 2, 0.2), first)


def test_decode_attention_rejects_a_length_outside_the_table() -> None:
    qkv, kv, tables, _, _ = _attention_case([20], 2, 2, 32, 16, seed=8)
    for bad in (0, 33):
        with pytest.raises(ValueError, match="context length"):
            native.decode_attention(qkv[:, :128], kv, tables.reshape(-1), torch.tensor([bad]), 2, 0.2)


def test_off_switch_falls_back_to_torch_and_says_why() -> None:
    code = ("from tickloom.engine.model import native; from tickloom.engine.model.quant import Int4Linear; "
            "import torch; lin = Int4Linear.from_float(torch.randn(32, 64), 32); "
            "print(native.status(), lin.tiles is None)")
    env = {**os.environ, "TICKLOOM_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "off (TICKLOOM_NATIVE=0) True"


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def test_add_rms_norm_adds_in_place_then_normalizes() -> None:
    x, add, w = _bf16(3, 64, seed=1), _bf16(3, 64, seed=2), torch.rand(64) + 0.5
    want_x = (x.float() + add.float()).bfloat16()  # the residual stream stays bfloat16
    xf = want_x.float()
    want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    got = native.add_rms_norm(x, add, w, 1e-5)
    assert torch.equal(x, want_x)
    assert float((got.float() - want).abs().max()) <= 2e-2 * float(want.abs().max())
    alone = native.add_rms_norm(x, None, w, 1e-5)  # no add: x is left as it is
    assert torch.equal(x, want_x) and torch.equal(alone, got)


@pytest.mark.parametrize(("out_dtype", "tolerance"), [(torch.bfloat16, 1e-2), (torch.float32, 1e-6)])
def test_add_rms_norm_on_a_float32_stream_adds_without_rounding(out_dtype: torch.dtype, tolerance: float) -> None:
    """The float32 residual stream of a bfloat16 model (a bfloat16 out) and of a float32 model (a float32 out)."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    add = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    w = torch.rand(64) + 0.5
    want_x = x + add
    want = want_x * torch.rsqrt(want_x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    got = native.add_rms_norm(x, add, w, 1e-5, out_dtype)
    assert torch.equal(x, want_x), "x += add in float32, exactly"
    assert got.dtype == out_dtype
    assert float((got.float() - want).abs().max()) <= tolerance * float(want.abs().max())
    assert torch.equal(native.add_rms_norm(x, None, w, 1e-5, out_dtype), got) and torch.equal(x, want_x)
    with pytest.raises(ValueError, match=r"x is torch\.float32, add torch\.bfloat16"):
        native.add_rms_norm(x, add.bfloat16(), w, 1e-5, out_dtype)
    if out_dtype == torch.float32:
        with pytest.raises(ValueError, match="a float32 out from a float32 x"):
            native.add_rms_norm(x.bfloat16(), None, w, 1e-5, torch.float32)


def test_rope_and_store_rotates_q_and_k_and_stores_k_and_v() -> None:
    from tickloom.engine.model.kv_cache import PagedKVCache
    from tickloom.engine.model.llama import apply_rope, rope_tables

    heads, kv_heads, d = 4, 2, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    cos, sin = rope_tables(inv_freq, 64, torch.bfloat16, torch.device("cpu"))
    qkv = _bf16(3, (heads + 2 * kv_heads) * d, seed=3)
    positions, slots = torch.tensor([0, 7, 40]), torch.tensor([5, 17, 2])
    ref_qkv = qkv.clone()
    rope_heads = heads + kv_heads
    rot = apply_rope(ref_qkv[:, : rope_heads * d].float().view(3, rope_heads, d).clone(),
                     cos.float()[positions].unsqueeze(1), sin.float()[positions].unsqueeze(1))
    cache = PagedKVCache(1, 4, 8, kv_heads, d, torch.bfloat16, torch.device("cpu"))
    native.rope_and_store(qkv, positions, cos, sin, rope_heads, kv_heads, slots, cache.kv[0])
    got = qkv[:, : rope_heads * d].float().view(3, rope_heads, d)
    assert float((got - rot).abs().max()) < 3e-2
    assert torch.equal(qkv[:, rope_heads * d :], ref_qkv[:, rope_heads * d :])  # V is not rotated
    flat = cache.kv[0].view(2 * kv_heads, -1, d)
    for r in range(3):
        assert torch.equal(flat[:, int(slots[r])], qkv[r, heads * d :].view(2 * kv_heads, d))
    untouched = [s for s in range(32) if s not in slots.tolist()]
    assert not flat[:, untouched].any()


def test_rope_and_store_of_a_float32_model() -> None:
    from tickloom.engine.model.kv_cache import PagedKVCache
    from tickloom.engine.model.llama import apply_rope, rope_tables

    heads, kv_heads, d = 4, 2, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    cos, sin = rope_tables(inv_freq, 64, torch.float32, torch.device("cpu"))
    qkv = torch.randn(3, (heads + 2 * kv_heads) * d, generator=torch.Generator().manual_seed(3))
    positions, slots = torch.tensor([0, 7, 40]), torch.tensor([5, 17, 2])
    rope_heads = heads + kv_heads
    rot = apply_rope(qkv[:, : rope_heads * d].view(3, rope_heads, d).clone(), cos[positions].unsqueeze(1),
                     sin[positions].unsqueeze(1))
    v_before = qkv[:, rope_heads * d :].clone()
    cache = PagedKVCache(1, 4, 8, kv_heads, d, torch.float32, torch.device("cpu"))
    native.rope_and_store(qkv, positions, cos, sin, rope_heads, kv_heads, slots, cache.kv[0])
    assert float((qkv[:, : rope_heads * d].view(3, rope_heads, d) - rot).abs().max()) < 1e-5
    assert torch.equal(qkv[:, rope_heads * d :], v_before)
    flat = cache.kv[0].view(2 * kv_heads, -1, d)
    for r in range(3):  # the whole float32 heads, not half of their bytes
        assert torch.equal(flat[:, int(slots[r])], qkv[r, heads * d :].view(2 * kv_heads, d))
    with pytest.raises(ValueError, match="one dtype"):
        native.rope_and_store(qkv, positions, cos.bfloat16(), sin, rope_heads, kv_heads, slots, cache.kv[0])


def test_silu_mul_of_a_float32_model() -> None:
    gate_up = torch.randn(2, 96, generator=torch.Generator().manual_seed(4)) * 4
    got = native.silu_mul(gate_up)
    want = torch.nn.functional.silu(gate_up[:, :48]) * gate_up[:, 48:]
    assert got.dtype == torch.float32
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        native.silu_mul(gate_up.half())


def test_silu_mul_matches_torch_and_saturates_cleanly() -> None:
    gate_up = torch.cat([_bf16(2, 48, seed=4, scale=4.0), _bf16(2, 48, seed=5)], dim=-1)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -88.0]).bfloat16()
    want = torch.nn.functional.silu(gate_up[:, :48].float()) * gate_up[:, 48:].float()
    got = native.silu_mul(gate_up).float()
    assert not got.isnan().any()
    assert float((got - want).abs().max()) <= 1e-2 * float(want.abs().max())


def _q8_0_rows(n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random GGUF Q8_0 rows (34-byte blocks: float16 d, 32 int8) and the float32 weight they encode."""
    rng = np.random.default_rng(seed)
    g = k // 32
    d = (rng.random((n, g)) * 0.02 + 0.001).astype(np.float16)
    q = rng.integers(-127, 128, (n, g, 32), dtype=np.int8)
    rows = np.concatenate([d.view(np.uint8).reshape(n, g, 2), q.view(np.uint8)], axis=-1).reshape(n, -1)
    return rows, torch.from_numpy((q * d.astype(np.float32)[..., None]).reshape(n, k))


def test_q8_head_keeps_the_files_weights_and_multiplies_to_15_bits() -> None:
    from tickloom.engine.model.head import Q8Linear
    from tickloom.engine.model.quant import RawBlocks

    rows, w = _q8_0_rows(48, 128, seed=6)
    lin = Q8Linear.from_weight(RawBlocks("Q8_0", rows, (48, 128)))
    assert torch.equal(lin.dequantize(), w)  # the Q8_0 blocks as they are: no second rounding
    x = _bf16(9, 128, seed=7)
    x[0, :3] = torch.tensor([40.0, -25.0, 0.0])  # outlier channels, as the head's input has
    y = lin(x)
    ref = x.float() @ w.t()
    assert y.dtype == torch.float32
    # two 8-bit passes per activation: far finer than one (a 1/254 step of a 40.0 outlier would be 0.16)
    assert float((y - ref).abs().max()) < 2e-3 * float(ref.abs().max())
    assert torch.equal(lin(x[4:5]), y[4:5])  # a row's logits do not depend on its batch
    assert torch.equal(lin(torch.zeros(2, 128, dtype=torch.bfloat16)), torch.zeros(2, 48))


def test_q8_head_from_float_rounds_each_group_to_its_own_step() -> None:
    from tickloom.engine.model.head import Q8Linear

    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(8))
    w[0, 0] = 30.0  # one large weight coarsens its own group only
    deq = Q8Linear.from_weight(w).dequantize()
    step = w.reshape(32, 2, 32).abs().amax(-1, keepdim=True) / 127
    # half a step from rounding, plus up to 127 x the step's own float16 rounding (2^-11): under 0.6 steps
    assert bool(((deq - w).reshape(32, 2, 32).abs() <= step * 0.6).all())
    assert float((deq - w)[1:].abs().max()) < 0.02


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_the_forward_on_the_kernels_tracks_torchs_ops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      quant: str) -> None:
    """The same bfloat16 model with the kernels and with torch's ops (as on a CPU without them): prefill and
    decode logits agree up to the kernels' roundings (int8 activations in the int4 matmul)."""
    from test_model_reference import run_rows

    from tickloom.engine.model.batch import RowSpec
    from tickloom.engine.model.loaders import load_model
    from tickloom.engine.model.tiny import write_tiny_model

    d = write_tiny_model(tmp_path / "m", seed=9, hidden_size=128, intermediate_size=256)
    ids = list(range(3, 40))

    def logits_of(lm: Any) -> torch.Tensor:
        kv = lm.model.new_kv_cache(8, 16)
        prefill = run_rows(lm.model, kv, [RowSpec(0, 30, list(range(2)), True)], ids[:30])  # a prefill chunk
        decode = [run_rows(lm.model, kv, [RowSpec(p, 1, list(range(3)), True)], [ids[p]]) for p in range(30, 37)]
        return torch.cat([prefill, *decode])

    fast = load_model(d, dtype="bfloat16", quant=quant)
    logits = [logits_of(fast)]
    monkeypatch.setattr(native, "_load", lambda: (None, "off (test)"))
    plain = load_model(d, dtype="bfloat16", quant=quant)
    assert fast.model._native and not plain.model._native
    logits.append(logits_of(plain))
    err = float((logits[0] - logits[1]).norm() / logits[1].norm())
    assert err < (0.02 if quant == "none" else 0.06)  # seen: 0.012 and 0.029
    assert float((logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean()) >= 0.75


def test_bfloat16_rounding_is_to_nearest_even_and_keeps_specials() -> None:
    """The kernels round float32 to bfloat16 as torch does: ties to even, overflow to inf, inf and NaN kept (the
    AVX2 build rounds with integer arithmetic, so each case is a rule of its own)."""
    step = 2.0**-8  # half of bfloat16's spacing at 1.0
    x = torch.tensor([1.0, 1.0078125, -1.0, 3.0e38, float("inf"), float("nan"), 1.0, 0.0] * 2).bfloat16()
    add = torch.tensor([step, step, -step, 3.0e38, 1.0, 1.0, -float("inf"), -0.0] * 2).bfloat16()
    want = (x.float() + add.float()).bfloat16()
    assert want[0] == 1.0 and want[1] == 1.015625 and want[3] == float("inf")  # the cases are what they claim
    x, add = x.view(1, 16), add.view(1, 16)
    native.add_rms_norm(x, add, torch.ones(16), 1e-5)
    assert torch.equal(x.view(-1)[~want.isnan()], want[~want.isnan()])
    assert x.view(-1)[want.isnan()].isnan().all()


def test_matmul_sums_a_groups_largest_products_without_overflow() -> None:
    """Every nibble 15 against activations at the int8 limit: the largest sums a group can make (the AVX2 build
    adds a group's products in 16 bits, 30480 at most), exact in bfloat16 here."""
    n, k = 16, 64
    nibbles = np.full((n, k // 32, 16), 0xFF, dtype=np.uint8)
    s, z = np.ones((n, k // 32), np.float32), np.zeros((n, k // 32), np.float32)
    x = torch.tensor([[1.0] * k, [-1.0] * k]).bfloat16()
    y = native.matmul(x, packing.pack_tiles(nibbles, s, z), n)
    assert torch.equal(y.float(), torch.tensor([[15.0 * k] * n, [-15.0 * k] * n]))


def test_q8_head_takes_the_whole_int8_range() -> None:
    """A file's Q8_0 block may hold -128 (llama.cpp writes -127..127, a file need not): the AVX2 build reads
    |-128| as 128 unsigned, the AVX512 build offsets the activations instead; both must multiply it exactly."""
    from tickloom.engine.model.head import Q8Linear
    from tickloom.engine.model.quant import RawBlocks

    rows, w = _q8_0_rows(32, 64, seed=8)
    q = rows.reshape(32, 2, 34)[..., 2:].view(np.int8)
    q[:, :, :5] = -128
    q[:, :, 5:9] = 127
    d = rows.reshape(32, 2, 34)[..., :2].copy().view(np.float16).astype(np.float32)
    w = torch.from_numpy((q.astype(np.float32) * d).reshape(32, 64))
    lin = Q8Linear.from_weight(RawBlocks("Q8_0", rows, (32, 64)))
    assert torch.equal(lin.dequantize(), w)
    x = _bf16(3, 64, seed=9)
    ref = x.float() @ w.t()
    assert float((lin(x) - ref).abs().max()) < 2e-3 * float(ref.abs().max())


def test_a_prompts_logits_and_cache_do_not_depend_on_its_chunks_or_its_batch(tmp_path: Path) -> None:
    """On the kernels every query attends alone (``LlamaModel._attend_each_query``): a prompt prefilled whole, in
    chunks of any size, or beside another row gives the same bits, logits and cache alike (in bfloat16, torch's
    attention moved with the chunk's length, enough to change a token)."""
    from test_model_reference import run_rows

    from tickloom.engine.model.batch import RowSpec
    from tickloom.engine.model.loaders import load_model
    from tickloom.engine.model.tiny import write_tiny_model

    lm = load_model(write_tiny_model(tmp_path / "m", seed=4, hidden_size=128, intermediate_size=256),
                    dtype="bfloat16", quant="int4")
    assert lm.model._native
    ids = [(7 * i) % 250 + 3 for i in range(75)]

    def prefill(cuts: list[int], beside: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        kv = lm.model.new_kv_cache(12, 16)
        for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True):
            rows, toks = [RowSpec(a, b - a, list(range(5)), True)], ids[a:b]
            if beside:  # another request's chunk in the same step, its own blocks
                rows, toks = [RowSpec(0, 9, [6, 7], True), *rows], list(range(20, 29)) + toks
            out = run_rows(lm.model, kv, rows, toks)
        return out[-1], kv.kv[0][:, :5].clone()

    whole = prefill([])
    for cuts, beside in (([1], False), ([16, 17, 40], False), ([33], True), ([], True)):
        logits, cache = prefill(cuts, beside)
        assert torch.equal(logits, whole[0]), (cuts, beside)
        assert torch.equal(cache, whole[1]), (cuts, beside)


def _half_weight(kind: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random ``kind`` bits ``N x K`` in the kernel's tiles, and the float32 weight they encode."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    half = w.half() if kind == "F16" else w.bfloat16()
    return packing.pack_half_tiles(half.view(torch.int16).numpy().view(np.uint16)), half.float()


def test_half_tiles_hold_the_files_values_in_fours_of_rows() -> None:
    bits = np.arange(7 * 32, dtype=np.uint16).reshape(7, 32)
    tiles = packing.pack_half_tiles(bits)
    assert tiles.shape == (2, 2, 64)  # rows 4..6 and a zero row; 16 columns of 4 rows a chunk
    assert np.array_equal(tiles[0, 1, 16:32], bits[1, 16:32]) and not tiles[1, 0, 48:].any()
    assert np.array_equal(packing.unpack_half_tiles(tiles, 7), bits)


@pytest.mark.parametrize("kind", ["F16", "BF16"])
@pytest.mark.parametrize("m,n", [(1, 1), (1, 7), (3, 4), (4, 9), (6, 13), (9, 16)])
def test_half_matmul_is_the_float32_product_at_every_tile_remainder(kind: str, m: int, n: int) -> None:
    """Output rows go in fours and activation rows in fours: every remainder of both gives the float32 product."""
    tiles, w = _half_weight(kind, n, 48, seed=m * 100 + n)
    x = torch.randn(m, 48)
    torch.testing.assert_close(native.half_matmul(x, tiles, n, kind), (x.double() @ w.double().t()).float(),
                               atol=1e-5, rtol=1e-5)


def test_half_matmul_rows_do_not_depend_on_their_batch_or_the_threads() -> None:
    tiles, _ = _half_weight("F16", 37, 256, seed=1)
    x = torch.randn(11, 256)
    torch.set_num_threads(1)
    alone = [native.half_matmul(x[i : i + 1].contiguous(), tiles, 37, "F16") for i in range(11)]
    torch.set_num_threads(2)
    try:
        together = native.half_matmul(x, tiles, 37, "F16")
    finally:
        torch.set_num_threads(1)
    assert torch.equal(torch.cat(alone), together)


def test_half_matmul_names_what_it_cannot_take() -> None:
    tiles, _ = _half_weight("BF16", 16, 48, seed=2)
    with pytest.raises(ValueError, match="wants float32 M x K"):
        native.half_matmul(torch.randn(2, 48).bfloat16(), tiles, 16, "BF16")
    with pytest.raises(ValueError, match="wants float32 M x K"):
        native.half_matmul(torch.randn(2, 32), tiles, 16, "BF16")
    with pytest.raises(ValueError, match="wants float32 M x K"):
        native.half_matmul(torch.randn(2, 48), tiles, 17, "BF16")
