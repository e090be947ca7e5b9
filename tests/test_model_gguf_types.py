"""GGUF weight types read as the file has them: for each type, tickloom's decoding of the blocks equals the ``gguf``
package's reference dequantizer (``gguf.quants.dequantize``, the oracle), and the layer each type becomes under a
quantized setting multiplies by that weight (Q4_0/Q4_1/Q4_K as int4, Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 as grouped int8,
16-bit floats as floats)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as reference

from tickloom.engine.model import gguf_quants, native
from tickloom.engine.model.embedding import Embedding
from tickloom.engine.model.quant import (
    GroupedInt8Linear,
    HalfLinear,
    Int4Linear,
    Int8Linear,
    RawBlocks,
    SplitLinear,
    join_linear,
    quantize_linear,
)

QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16")
"""The types ``gguf.quants.quantize`` writes; the K-quants' blocks are built by hand (``k_blocks``)."""
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
ALL = (*QUANTIZABLE, *K_QUANTS)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def k_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """``n`` rows of ``k / 256`` random ``kind`` blocks: random integers, scales and mins, with small float16
    super-block scales (random bytes there could be inf or NaN)."""
    rng = np.random.default_rng(seed)
    size = gguf_quants.BLOCKS[kind][0]
    b = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    d = _f16_bytes(rng.uniform(1e-4, 2e-3, (n, k // 256)))
    if kind == "Q6_K":
        b[..., 208:210] = d
    else:
        b[..., 0:2] = d
        b[..., 2:4] = _f16_bytes(rng.uniform(1e-4, 2e-3, (n, k // 256)))
    return b.reshape(n, -1)


@pytest.fixture
def torch_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers as torch runs them (exact in float32), also on a CPU where tickloom's kernels run (those keep the
    scales in float16: ``test_grouped_int8_on_the_native_kernel``)."""
    monkeypatch.setattr(native, "available", lambda: False)


def blocks(kind: str, n: int = 48, k: int = 512, seed: int = 0) -> np.ndarray:
    if kind in K_QUANTS:
        return k_blocks(kind, n, k, seed)
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return np.ascontiguousarray(gguf.quants.quantize(w, Q[kind])).view(np.uint8).reshape(n, -1)


def oracle(kind: str, data: np.ndarray) -> torch.Tensor:
    raw = data.view(np.float16) if kind == "F16" else data
    return torch.from_numpy(np.asarray(reference(raw, Q[kind]), dtype=np.float32).reshape(data.shape[0], -1))


@pytest.mark.parametrize("kind", ALL)
def test_dequantize_equals_the_reference(kind: str) -> None:
    data = blocks(kind)
    assert data.shape[1] == gguf_quants.row_bytes(kind, 512)
    got = RawBlocks(kind, data, (48, 512)).dequantize()
    assert torch.equal(got, oracle(kind, data)), kind  # the same float32 arithmetic, so the same bits


def test_k_blocks_use_every_integer() -> None:
    """The hand-built blocks cover the types' ranges (a decoder that dropped a high bit would still pass a test
    whose integers never set it)."""
    for kind, lo, hi in (("Q4_K", 0, 15), ("Q5_K", 0, 31), ("Q6_K", -32, 31)):
        q, s, z, group = gguf_quants.int8_fields(kind, k_blocks(kind, 16, 512, 1))
        assert (int(q.min()), int(q.max())) == (lo, hi), kind
        assert group == (16 if kind == "Q6_K" else 32) and (z is None) == (kind == "Q6_K")
        assert len(np.unique(s)) > 100


@pytest.mark.parametrize("kind", ("Q4_0", "Q4_1", "Q4_K"))
def test_4_bit_types_pack_into_int4(kind: str, torch_kernels: None) -> None:
    data = blocks(kind)
    want = oracle(kind, data)
    lin = quantize_linear(RawBlocks(kind, data, (48, 512)), None, "int4", torch.bfloat16)
    assert isinstance(lin, Int4Linear)
    nibbles, s, z = gguf_quants.int4_fields(kind, data)
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.float32)
    exact = torch.from_numpy((q * s[..., None] + z[..., None]).reshape(48, -1))
    torch.testing.assert_close(exact, want, atol=1e-6, rtol=1e-6)  # the fields hold the weight itself
    # The layer holds them exactly but for the scale and offset, rounded to bfloat16 (torch's kernel: w = (q - 8) s
    # + (z + 8 s)) or float16 (tickloom's), and ``dequantize`` reads them back through a bfloat16 matmul: each
    # weight moves by at most a half step of those three roundings.
    zero = z + 8 * s
    bound = ((np.abs(q - 8) * np.abs(s[..., None]) + np.abs(zero[..., None])) * 2.0**-8).reshape(48, -1)
    bound = torch.from_numpy(bound) + want.abs() * 2.0**-8
    assert bool(((lin.dequantize() - want).abs() <= bound).all())
    # seeded: the 8-bit activations put one of some draws' 144 sums just past the tolerance
    x = torch.randn(3, 512, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(lin(x).float(), x.float() @ lin.dequantize().t(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("kind", ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"))
def test_5_6_8_bit_types_are_grouped_int8_exactly(kind: str, torch_kernels: None) -> None:
    data = blocks(kind)
    want = oracle(kind, data)
    lin = quantize_linear(RawBlocks(kind, data, (48, 512)), None, "int4", torch.bfloat16)
    assert isinstance(lin, GroupedInt8Linear) and lin.q is not None and lin.q.dtype == torch.int8
    assert torch.equal(lin.dequantize(), want)  # the file's integers and scales, nothing rounded again
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    ref = x.float() @ want.t()
    torch.testing.assert_close(lin(x).float(), ref, atol=2e-2 * float(ref.abs().max()), rtol=1e-2)
    xf = torch.randn(2, 512)  # float32 activations: the float32 matmul, rounded to bfloat16 at the end
    torch.testing.assert_close(lin(xf), (xf @ want.t()).bfloat16().float(), atol=1e-5, rtol=1e-2)
    assert lin.nbytes() < want.numel() * 2  # smaller than a 16-bit copy


def test_int8_setting_keeps_its_per_row_form_for_q8_0_and_groups_the_rest() -> None:
    assert isinstance(quantize_linear(RawBlocks("Q8_0", blocks("Q8_0"), (48, 512)), None, "int8", torch.bfloat16),
                      Int8Linear)
    lin = quantize_linear(RawBlocks("Q6_K", blocks("Q6_K"), (48, 512)), None, "int8", torch.bfloat16)
    assert isinstance(lin, GroupedInt8Linear)


@pytest.mark.parametrize("kind", ("F16", "BF16"))
def test_16_bit_floats_stay_floats(kind: str) -> None:
    data = blocks(kind)
    w = RawBlocks(kind, data, (48, 512))
    assert w.nbytes() == 48 * 512 * 2
    dense = quantize_linear(w, None, "none", torch.float32)
    assert torch.equal(dense.dequantize() if hasattr(dense, "dequantize") else dense.weight, oracle(kind, data))


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")
@pytest.mark.parametrize("kind", ("F16", "BF16"))
def test_16_bit_floats_are_read_in_place_by_a_float32_model(kind: str) -> None:
    """A float32 model keeps an F16/BF16 matrix as the file's 16-bit values (the same bytes, no float32 copy) and
    multiplies it as the float32 model would; a bfloat16 model keeps it in bfloat16 (an F16 file's values rounded
    once), on the same kernel."""
    data = blocks(kind)
    bias = torch.randn(48)
    lin = quantize_linear(RawBlocks(kind, data, (48, 512)), bias, "none", torch.float32)
    assert isinstance(lin, HalfLinear) and torch.equal(lin.dequantize(), oracle(kind, data))
    assert lin.nbytes() == 48 * 512 * 2 + 48 * 4
    x = torch.randn(3, 2, 512)
    want = (x.double() @ oracle(kind, data).double().t() + bias.double()).float()
    got = lin(x)
    assert got.shape == (3, 2, 48) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    in_bf16 = quantize_linear(RawBlocks(kind, data, (48, 512)), None, "none", torch.bfloat16)
    assert isinstance(in_bf16, HalfLinear) and in_bf16.kind == "BF16"  # a bfloat16 model's weights: bfloat16
    assert torch.equal(in_bf16.dequantize(), oracle(kind, data).bfloat16().float())


def test_16_bit_fused_parts_join_into_one_half_layer_without_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """q, k and v in F16 join into one layer in q, k, v order: a ``HalfLinear`` where the kernels run, else the
    dense float32 weight (the same numbers)."""
    parts = [blocks("F16", n, 512, seed) for n, seed in ((32, 1), (16, 2), (16, 3))]
    want = torch.cat([oracle("F16", p) for p in parts])
    raws = [RawBlocks("F16", p, (p.shape[0], 512)) for p in parts]
    lin = join_linear(raws, None, "none", torch.float32)
    x = torch.randn(5, 512)
    if native.available():
        assert isinstance(lin, HalfLinear) and lin.out_features == 64
        torch.testing.assert_close(lin(x), x @ want.t(), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(native, "available", lambda: False)
    dense = join_linear(raws, None, "none", torch.float32)
    assert not isinstance(dense, HalfLinear) and torch.equal(dense.weight, want)


def test_a_mixed_fused_projection_keeps_each_part_exact(torch_kernels: None) -> None:
    """A Q4_K_M layer: q and k in Q4_K, v in Q6_K. q and k join as int4, v stays grouped int8; the outputs are in
    q, k, v order."""
    q, k, v = blocks("Q4_K", 32, 512, 1), blocks("Q4_K", 16, 512, 2), blocks("Q6_K", 16, 512, 3)
    parts = [RawBlocks("Q4_K", q, (32, 512)), RawBlocks("Q4_K", k, (16, 512)), RawBlocks("Q6_K", v, (16, 512))]
    bias = torch.randn(64)
    lin = join_linear(parts, [bias[:32], bias[32:48], bias[48:]], "int4", torch.bfloat16)
    assert isinstance(lin, SplitLinear) and [type(p) for p in lin.parts] == [Int4Linear, GroupedInt8Linear]
    want = torch.cat([oracle("Q4_K", q), oracle("Q4_K", k), oracle("Q6_K", v)])
    x = torch.randn(2, 512)
    ref = x @ want.t() + bias
    torch.testing.assert_close(lin(x.bfloat16()).float(), ref, atol=3e-2 * float(ref.abs().max()), rtol=2e-2)
    # Q5_K (groups of 32, an offset) beside Q6_K (groups of 16, none): one grouped layer, still exact
    a, b = blocks("Q5_K", 16, 512, 4), blocks("Q6_K", 32, 512, 5)
    both = join_linear([RawBlocks("Q5_K", a, (16, 512)), RawBlocks("Q6_K", b, (32, 512))], None, "int4",
                       torch.bfloat16)
    assert isinstance(both, GroupedInt8Linear) and both.group == 16
    assert torch.equal(both.dequantize(), torch.cat([oracle("Q5_K", a), oracle("Q6_K", b)]))


@pytest.mark.parametrize("kind", ("Q4_K", "Q6_K", "Q8_0", "F16", "BF16"))
def test_embedding_rows_are_looked_up_from_the_blocks(kind: str) -> None:
    data = blocks(kind, 64, 256)
    emb = Embedding(RawBlocks(kind, data, (64, 256)), torch.float32)
    assert emb.table is None and emb.nbytes() == 0
    ids = torch.tensor([5, 0, 63, 5])
    assert torch.equal(emb(ids), oracle(kind, data)[ids])


@pytest.mark.parametrize("kind", ("Q6_K", "Q4_K", "Q5_0", "F16"))
def test_a_block_head_quantizes_per_row_a_slice_at_a_time_as_a_float_one_would(kind: str) -> None:
    """The LM head's per-row int8 form of a GGUF head (a Q4_K_M file's is Q6_K) is made ``chunk`` rows at a time
    (no float32 copy of the whole head) with the float path's rounding, bit for bit."""
    from tickloom.engine.model.head import int8_rows

    w = RawBlocks(kind, blocks(kind, 100, 512), (100, 512))
    q, s = int8_rows(w, chunk=32)
    whole = Int8Linear.from_float(w.dequantize(), act=torch.float32)
    assert torch.equal(q, whole.q) and torch.equal(s, whole.scales)


@pytest.mark.parametrize("kind", ("Q5_1", "Q6_K"))
def test_grouped_int8_gives_one_product_at_any_batch(kind: str) -> None:
    """Few rows take the group-by-group path, many the dequantized weight's: both are the float32 product."""
    data = blocks(kind, 64, 512)
    want = oracle(kind, data)
    lin = GroupedInt8Linear.from_gguf_blocks(data, kind, act=torch.float32, use_native=False)
    for m in (1, 8, 9, 40):
        x = torch.randn(m, 512)
        torch.testing.assert_close(lin(x), x @ want.t(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ("Q5_0", "Q5_1", "Q5_K", "Q8_0"))
def test_grouped_int8_on_the_native_kernel(kind: str) -> None:
    """Groups of 32 in tickloom's 8-bit kernel's form: the file's integers, the scales rounded to float16 (the
    form is numpy, checked everywhere; the matmul only where the kernel runs)."""
    data = blocks(kind, 64, 512)
    want = oracle(kind, data)
    lin = GroupedInt8Linear.from_gguf_blocks(data, kind, use_native=True)
    assert lin.tiles is not None and lin.q is None
    q, s, z, _ = gguf_quants.int8_fields(kind, data)
    s16 = s.astype(np.float16).astype(np.float32)
    exact16 = (s16[..., None] * q.reshape(64, -1, 32).astype(np.float32)).reshape(64, -1)
    if z is not None:
        exact16 += np.repeat(z, 32, axis=1)
    assert torch.equal(lin.dequantize(), torch.from_numpy(exact16))
    torch.testing.assert_close(lin.dequantize(), want, atol=float(want.abs().max()) * 2.0**-10, rtol=0)
    if not native.available():
        return
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    ref = x.float() @ want.t()
    torch.testing.assert_close(lin(x).float(), ref, atol=2e-2 * float(ref.abs().max()), rtol=1e-2)


def test_the_native_heads_form_takes_blocks_a_slice_at_a_time() -> None:
    """``Q8Linear`` (the LM head on tickloom's 8-bit kernel; its form is numpy, built on any CPU): Q5_0 blocks as
    they are, a Q6_K head rounded per 32 a slice of rows at a time exactly as its whole float32 weight would be."""
    from tickloom.engine.model.head import Q8Linear

    q5 = blocks("Q5_0", 64, 512)
    assert torch.equal(Q8Linear.from_weight(RawBlocks("Q5_0", q5, (64, 512))).dequantize(), oracle("Q5_0", q5))
    q6 = RawBlocks("Q6_K", blocks("Q6_K", 64, 512), (64, 512))
    sliced = Q8Linear.from_weight(q6, chunk=16)
    assert torch.equal(sliced.tiles, Q8Linear.from_weight(q6.dequantize()).tiles)
    torch.testing.assert_close(sliced.dequantize(), q6.dequantize(), atol=float(q6.dequantize().abs().max()) / 127,
                               rtol=0)
