"""Issue 16: the quantized linear layers against their dequantized float32 reference; GGUF blocks packed as
they are; a quantized engine run replays ``identical``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import assert_replays

from tickloom.engine.model import native
from tickloom.engine.model.loaders import load_model, split_setting
from tickloom.engine.model.quant import (
    Int4Linear,
    Int8Linear,
    RawBlocks,
    join_linear,
    quantize_linear,
)
from tickloom.engine.model.quant_grouped import GroupedInt8Linear
from tickloom.engine.model.tiny import write_tiny_model


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 7, 32])
def test_int8_matches_its_dequantized_weight(m: int, act: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m)
    w, x = torch.randn(96, 64, generator=g), torch.randn(m, 64, generator=g)
    lin = Int8Linear.from_float(w)
    assert lin.q.dtype == torch.int8 and lin.scales.shape == (96,)
    ref = x @ lin.dequantize().t()
    assert _rel_err(lin(x.to(act)), ref) < 1e-2  # bfloat16 activations: ~3 significant digits
    assert _rel_err(lin.dequantize(), w) < 1e-2  # and the weight itself is close to the original


KERNELS = [False, pytest.param(True, marks=pytest.mark.skipif(not native.available(), reason=native.status()))]


@pytest.mark.parametrize("use_native", KERNELS, ids=["torch", "native"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 5, 32])
def test_int4_matches_its_dequantized_weight(m: int, group: int, use_native: bool) -> None:
    if use_native and group != 32:
        with pytest.raises(ValueError, match="groups of 32"):
            Int4Linear.from_float(torch.randn(64, 256), group, use_native=True)
        return
    g = torch.Generator().manual_seed(group + m)
    n, k = 64, 256
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    lin = Int4Linear.from_float(w, group, use_native=use_native)
    assert (lin.tiles is not None) == use_native and (lin.packed is not None) != use_native
    # the reference from q, scale and zero directly, not through the kernel
    wg = w.reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = (hi - lo) / 15
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15)
    if use_native:  # scale and zero kept as float16, as GGUF stores them
        s, z = scale.half().float(), lo.half().float()
    else:  # torch's form, rounded to bfloat16 like its kernel sees them
        sz = lin.scales_zeros.float()  # type: ignore[union-attr]
        s, z = sz[..., 0].t(), sz[..., 1].t() - 8 * sz[..., 0].t()
    deq = q * s[..., None] + z[..., None]
    ref = x @ deq.reshape(n, k).t()
    assert _rel_err(lin(x.bfloat16()), ref) < 1e-2
    assert _rel_err(lin.dequantize(), deq.reshape(n, k)) < (1e-6 if use_native else 1e-2)
    assert _rel_err(deq.reshape(n, k), w) < 0.15  # 4 bits: ~8% rms error on Gaussian weights


def _q4_blocks(kind: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random GGUF Q4_0/Q4_1 rows and the float32 weight they encode (by the GGUF formulas)."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    d = (rng.random((n, nb)) * 0.1 + 0.01).astype(np.float16)
    m = (-rng.random((n, nb)) * 0.5).astype(np.float16)
    q = rng.integers(0, 16, (n, nb, 32), dtype=np.uint8)
    packed = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
    parts = [d.view(np.uint8).reshape(n, nb, 2)]
    if kind == "Q4_1":
        parts.append(m.view(np.uint8).reshape(n, nb, 2))
    rows = np.concatenate([*parts, packed], axis=-1).reshape(n, -1)
    df = d.astype(np.float32)[..., None]
    w = q * df + m.astype(np.float32)[..., None] if kind == "Q4_1" else (q.astype(np.float32) - 8) * df
    return rows, torch.from_numpy(w.reshape(n, k).astype(np.float32))


@pytest.mark.parametrize("use_native", KERNELS, ids=["torch", "native"])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_pack_exactly(kind: str, use_native: bool) -> None:
    rows, w = _q4_blocks(kind, 48, 128, seed=3)
    assert torch.equal(RawBlocks(kind, rows, (48, 128)).dequantize(), w)
    lin = Int4Linear.from_gguf_blocks(rows, kind, use_native=use_native)
    assert lin.group == 32
    if use_native:  # the GGUF file's own float16 scales and offsets: exactly its weight
        assert torch.equal(lin.dequantize(), w)
    else:  # up to bfloat16 rounding of (scale, zero): the sign conventions hold
        assert _rel_err(lin.dequantize(), w) < 1e-2
    x = torch.randn(3, 128)
    assert _rel_err(lin(x.bfloat16()), x @ w.t()) < 2e-2


def test_fused_blocks_and_dense_fallback() -> None:
    a, wa = _q4_blocks("Q4_1", 32, 64, seed=1)
    b, wb = _q4_blocks("Q4_1", 16, 64, seed=2)
    lin = join_linear([RawBlocks("Q4_1", a, (32, 64)), RawBlocks("Q4_1", b, (16, 64))], None, "int4",
                      torch.bfloat16)
    assert lin.out_features == 48
    assert _rel_err(lin.dequantize(), torch.cat([wa, wb])) < 1e-2  # type: ignore[attr-defined]
    assert isinstance(quantize_linear(torch.randn(16, 40), None, "int4", torch.bfloat16), Int8Linear)  # 40 % 32
    assert isinstance(quantize_linear(torch.randn(8, 64), None, "int4", torch.bfloat16), Int8Linear)  # 8 % 16


def test_q8_0_head_moves_each_value_by_under_a_step() -> None:
    """Half a step from rounding onto the row's scale, at most a quarter step more from that scale's bfloat16
    rounding (127 steps x 2^-9)."""
    rng = np.random.default_rng(4)
    n, nb = 32, 4
    d = (rng.random((n, nb)) * 0.02 + 0.001).astype(np.float16)
    q = rng.integers(-127, 128, (n, nb, 32), dtype=np.int8)
    rows = np.concatenate([d.view(np.uint8).reshape(n, nb, 2), q.view(np.uint8)], axis=-1).reshape(n, -1)
    w = RawBlocks("Q8_0", rows, (n, nb * 32)).dequantize()
    assert torch.allclose(w, torch.from_numpy((q * d.astype(np.float32)[..., None]).reshape(n, -1)))
    lin = quantize_linear(RawBlocks("Q8_0", rows, (n, nb * 32)), None, "int8", torch.bfloat16)
    assert isinstance(lin, Int8Linear)
    step = lin.scales.float()[:, None]
    assert bool(((lin.dequantize() - w).abs() <= step * 0.76).all())


def test_setting_string() -> None:
    assert split_setting("bfloat16+int4", None) == ("bfloat16", "int4")
    assert split_setting("float32", None) == ("float32", None)
    with pytest.raises(ValueError):
        split_setting("bfloat16+int4", "int8")


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_tiny_model_tracks_float32(tmp_path: Path, quant: str) -> None:
    d = write_tiny_model(tmp_path / "m", seed=5, hidden_size=128, intermediate_size=256)
    ref = load_model(d, dtype="float32")
    got = load_model(d, dtype="bfloat16", quant=quant)
    assert got.fingerprint == f"{ref.fingerprint}+{quant}"
    assert got.model.weight_bytes() < ref.model.weight_bytes() / (3 if quant == "int8" else 5)
    kv_a, kv_b = ref.model.new_kv_cache(8, 16), got.model.new_kv_cache(8, 16)
    from test_model_reference import run_rows

    from tickloom.engine.model.batch import RowSpec

    ids = list(range(3, 60))
    a = run_rows(ref.model, kv_a, [RowSpec(0, len(ids), list(range(4)), True)], ids)
    b = run_rows(got.model, kv_b, [RowSpec(0, len(ids), list(range(4)), True)], ids)
    assert _rel_err(b, a) < (0.05 if quant == "int8" else 0.5)  # random weights: logits close, not argmax


async def test_quantized_engine_run_replays(tmp_path: Path) -> None:
    import trio

    from tickloom import Engine, EngineConfig, SamplingParams

    d = write_tiny_model(tmp_path / "m", seed=3, hidden_size=128, intermediate_size=256)
    log = tmp_path / "q.tlog"
    config = EngineConfig(model=str(d), dtype="bfloat16", quant="int4", max_seq_len=64, num_blocks=64,
                          log_path=str(log))
    async with Engine.open(config) as engine, trio.open_nursery() as nursery:
        for i in range(4):
            params = SamplingParams(max_tokens=6, temperature=0.8, seed=i, ignore_eos=True)
            nursery.start_soon(engine.complete, [5 + i, 9, 11 + i], params)
    assert_replays(log)


def test_a_layer_takes_one_kernels_weight_not_both_nor_neither() -> None:
    made = Int4Linear.from_float(torch.randn(16, 64), 32, use_native=False)
    assert made.packed is not None and made.scales_zeros is not None and made.tiles is None
    tiles = torch.zeros(1, 2, 320, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not both"):
        Int4Linear(64, 16, 32, None, torch.bfloat16, tiles=tiles, packed=made.packed, scales_zeros=made.scales_zeros)
    with pytest.raises(ValueError, match="not both"):
        Int4Linear(64, 16, 32, None, torch.bfloat16)
    with pytest.raises(ValueError, match="not both"):  # torch's form needs its scales too
        Int4Linear(64, 16, 32, None, torch.bfloat16, packed=made.packed)
    assert Int4Linear.from_tiles(tiles, None).tiles is tiles
    q, s = torch.zeros(2, 32, 16, dtype=torch.int8), torch.ones(2, 16)
    with pytest.raises(ValueError, match="not both"):
        GroupedInt8Linear(64, 16, 32, None, torch.float32, tiles=tiles, q=q, s=s)
    with pytest.raises(ValueError, match="not both"):
        GroupedInt8Linear(64, 16, 32, None, torch.float32)
    with pytest.raises(ValueError, match="not both"):
        GroupedInt8Linear(64, 16, 32, None, torch.float32, q=q)
    layer = GroupedInt8Linear(64, 16, 32, None, torch.float32, q=q, s=s)
    assert (layer.in_features, layer.out_features, layer.tiles) == (64, 16, None)
