"""The 5- and 6-bit kernels (GGUF Q5_0, Q5_1, Q5_K and Q6_K as the file has them: ``packing.pack_wide_tiles``,
``pack_q6_tiles``,
``matmul(bits=...)``, ``WideIntLinear``): their tiles hold every value, their sums are exact integer sums of the
weights' values times the int8 activations (with a scale and offset per 32, or per 16 for 6 bits), a row's result
does not depend on its batch, and the layer is chosen for those types only."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_model_gguf_types import k_blocks

from tickloom.engine.model import gguf_quants, native, packing
from tickloom.engine.model.quant import GroupedInt8Linear, Int4Linear, RawBlocks, join_linear, quantize_linear
from tickloom.engine.model.quant_grouped import SplitLinear, WideIntLinear

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")


@dataclasses.dataclass
class _Weights:
    """Random values below ``2 ** bits`` and their scales: ``w = s q + z`` per 32 (5 bits, float16-exact ``s`` and
    ``z``), or ``w = s (q - 32)`` per 16 (6 bits: ``z`` None; ``s = d sc``, Q6_K's int8 ``sc`` per 16, every value
    and sign, times a float16 ``d`` per 256, exact in float32)."""

    q: np.ndarray
    s: np.ndarray
    z: np.ndarray | None
    sc: np.ndarray | None = None
    d: np.ndarray | None = None

    def tiles(self, values: np.ndarray | None = None) -> torch.Tensor:
        """The kernel's tiles of these weights (or of ``values`` in place of ``q``, with the same scales)."""
        q = self.q if values is None else values
        if self.sc is None or self.d is None:
            assert self.z is not None
            return packing.pack_wide_tiles(q, self.s, self.z, 5)
        return packing.pack_q6_tiles(q, self.sc, self.d)


def _weights(n: int, k: int, seed: int, bits: int = 5) -> _Weights:
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 2**bits, (n, k), dtype=np.uint8)
    if bits == 6:
        sc = rng.integers(-128, 128, (n, k // 16)).astype(np.int8)
        d = (rng.random((n, k // 256)) * 2e-4 + 1e-5).astype(np.float16).astype(np.float32)
        return _Weights(q, d.repeat(16, axis=1) * sc.astype(np.float32), None, sc, d)
    s = (rng.random((n, k // 32)) * 0.02 + 0.001).astype(np.float16).astype(np.float32)
    z = (-16 * s + rng.normal(0, 0.01, s.shape)).astype(np.float16).astype(np.float32)
    return _Weights(q, s, z)


def _reference(x: torch.Tensor, q: np.ndarray, s: np.ndarray, z: np.ndarray | None) -> torch.Tensor:
    """The kernel's arithmetic: activations rounded to int8 per group of 32 as the kernel rounds them (float32
    ``x * (127 / max|x|)`` to nearest even, step ``max|x| / 127``), then ``dx * (s * sum q qx + z * sum qx)`` per
    group in float64."""
    group = q.shape[1] // s.shape[1]
    if z is None:
        z = -32.0 * s
    xf = x.float().reshape(x.shape[0], -1, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, 1.0), 0.0)
    qx = torch.round(xf * inv).double()
    dx = (amax / 127.0).double().repeat_interleave(32 // group, dim=1)  # per group of the weights
    qx = qx.reshape(x.shape[0], -1, group)
    qg = torch.from_numpy(q.astype(np.float64)).reshape(q.shape[0], -1, group)
    dots = torch.einsum("mgk,ngk->mng", qx, qg)
    sums = qx.sum(-1)[:, None, :]
    return (dx.squeeze(-1)[:, None, :] * (torch.from_numpy(s).double() * dots + torch.from_numpy(z).double() * sums)
            ).sum(-1)


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    """bfloat16 rows whose int8 rounding is exact (integers / 128, each group's largest 127 / 128): no value sits
    near a rounding tie, where float32's last bit decides, so the reference can be exact."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (m, k // 32, 32), generator=g)
    q[..., 0] = 127
    return (q.float() / 128).reshape(m, k).bfloat16()


def test_wide_tiles_hold_every_value() -> None:
    w = _weights(48, 96, seed=1, bits=5)
    tiles = w.tiles()
    assert tiles.shape == (3, 3, packing.WIDE_TILE_BYTES[5])
    q, s, z = packing.unpack_wide_tiles(tiles, 5)
    assert np.array_equal(q, w.q) and np.array_equal(s, w.s) and np.array_equal(z, w.z)


def test_6_bit_tiles_hold_every_value_and_the_files_scales_in_the_files_size() -> None:
    """Q6_K's q, int8 sc and float16 d come back as they went in, and the tiles take the file's 210 bytes per 256
    weights (float16 scales per 16 took 224)."""
    w = _weights(48, 512, seed=1, bits=6)
    tiles = w.tiles()
    assert tiles.numel() == 48 * 512 // 256 * 210
    q, sc, d = packing.unpack_q6_tiles(tiles)
    assert np.array_equal(q, w.q) and np.array_equal(sc, w.sc) and np.array_equal(d, w.d)
    with pytest.raises(ValueError, match="multiple of 256"):
        packing.pack_q6_tiles(w.q[:, :480], w.sc[:, :30], w.d[:, :1])
    with pytest.raises(ValueError, match="pack_q6_tiles"):
        packing.pack_wide_tiles(w.q, w.s, None, 6)


def test_a_6_bit_matrix_whose_k_is_not_a_multiple_of_256_is_refused_by_the_kernel() -> None:
    w = _weights(16, 512, seed=2, bits=6)
    x = _activations(1, 480, seed=2)
    with pytest.raises(ValueError, match="K=480"):
        native.matmul(x, w.tiles(), 16, torch.float32, bits=6)


@pytest.mark.parametrize("bits", [5, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 17])
def test_wide_matmul_is_the_exact_integer_sum_at_every_row_tile(m: int, bits: int) -> None:
    """Every value (each high bit included, in both nibbles of a byte) counts, and each half group of a 6-bit tile
    gets its own scale and offset; one or two rows a pass, eight, and the rest, each their own code path."""
    k = 160 if bits == 5 else 768  # Q6_K's super-blocks of 256: three, so that each row block's d changes
    w = _weights(64, k, seed=m, bits=bits)
    x = _activations(m, k, seed=m)
    top = 2**bits - 1
    for values in (w.q, np.where(w.q >= 16, w.q, top).astype(np.uint8)):  # wrong high bits would show in the second
        y = native.matmul(x, w.tiles(values), 64, torch.float32, bits=bits)
        ref = _reference(x, values, w.s, w.z)
        torch.testing.assert_close(y.double(), ref, atol=1e-5 * float(ref.abs().max()), rtol=0)


@pytest.mark.parametrize("bits", [5, 6])
def test_wide_rows_do_not_depend_on_their_batch_or_the_threads_and_bf16_rounds_the_float32_sums(bits: int) -> None:
    tiles = _weights(128, 256, seed=4, bits=bits).tiles()
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    whole = native.matmul(x, tiles, 128, torch.float32, bits=bits)
    for i in range(11):
        assert torch.equal(native.matmul(x[i : i + 1].contiguous(), tiles, 128, torch.float32, bits=bits),
                           whole[i : i + 1])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(native.matmul(x, tiles, 128, torch.float32, bits=bits), whole)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(native.matmul(x, tiles, 128, bits=bits), whole.bfloat16())


def _gguf_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    import gguf

    if kind in ("Q5_K", "Q6_K"):
        return k_blocks(kind, n, k, seed)
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return np.ascontiguousarray(gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind))).view(
        np.uint8).reshape(n, -1)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_5_and_6_bit_gguf_types_become_wide_layers_with_the_files_values(kind: str) -> None:
    """Under the default ("int4": the file's integers as they are) a 5- or 6-bit type keeps its bits: the layer's
    weight is the file's: exactly for Q5_0, Q5_1 (whose d and m are float16) and Q6_K (its int8 sc and float16 d
    kept as they are), up to d sc and dmin m rounded to float16 for Q5_K."""
    data = _gguf_blocks(kind, 48, 512, seed=7)
    lin = quantize_linear(RawBlocks(kind, data, (48, 512)), None, "int4", torch.bfloat16)
    bits = 6 if kind == "Q6_K" else 5
    assert isinstance(lin, WideIntLinear) and lin.bits == bits
    assert lin.nbytes() == 48 * (512 * packing.WIDE_TILE_BYTES[5] // 512 if bits == 5 else 2 * 210)
    want = torch.from_numpy(gguf_quants.dequantize(kind, data))
    got = lin.dequantize()
    if kind == "Q5_K":  # d * sc and dmin * m rounded to float16, as the int4 path does for Q4_K
        torch.testing.assert_close(got, want, atol=2e-3 * float(want.abs().max()), rtol=0)
    else:
        assert torch.equal(got, want)
    x = torch.randn(3, 512).bfloat16()
    assert torch.equal(lin.forward_f32(x).bfloat16(), lin(x))
    # the int8 setting keeps its grouped int8 form, and so do float32 activations (the kernel takes bfloat16)
    assert isinstance(quantize_linear(RawBlocks(kind, data, (48, 512)), None, "int8", torch.bfloat16),
                      GroupedInt8Linear)
    f32 = quantize_linear(RawBlocks(kind, data, (48, 512)), None, "int4", torch.float32)
    assert isinstance(f32, GroupedInt8Linear)
    torch.testing.assert_close(f32.dequantize(), want, atol=2e-3 * float(want.abs().max()), rtol=0)


def test_a_k_m_projection_joins_its_5_bit_parts_and_keeps_the_rest_apart() -> None:
    """Q5_K q and k join into one 5-bit layer; a Q6_K v beside them is a 6-bit layer; a Q4_K part stays int4."""
    q, k, v = _gguf_blocks("Q5_K", 32, 512, 1), _gguf_blocks("Q5_K", 16, 512, 2), _gguf_blocks("Q5_K", 16, 512, 3)
    joined = join_linear([RawBlocks("Q5_K", q, (32, 512)), RawBlocks("Q5_K", k, (16, 512))], None, "int4",
                         torch.bfloat16)
    assert isinstance(joined, WideIntLinear) and joined.out_features == 48 and joined.bits == 5
    six = k_blocks("Q6_K", 16, 512, 4)
    four = k_blocks("Q4_K", 16, 512, 5)
    split = join_linear([RawBlocks("Q5_K", q, (32, 512)), RawBlocks("Q6_K", six, (16, 512)),
                         RawBlocks("Q4_K", four, (16, 512)), RawBlocks("Q5_K", v, (16, 512))], None, "int4",
                        torch.bfloat16)
    assert isinstance(split, SplitLinear)
    assert [type(p) for p in split.parts] == [WideIntLinear, WideIntLinear, Int4Linear, WideIntLinear]
    assert [getattr(p, "bits", 4) for p in split.parts] == [5, 6, 4, 5]
    x = torch.randn(2, 512).bfloat16()
    want = torch.cat([torch.from_numpy(gguf_quants.dequantize(kind, d)) for kind, d in
                      (("Q5_K", q), ("Q6_K", six), ("Q4_K", four), ("Q5_K", v))])
    ref = x.float() @ want.t()
    torch.testing.assert_close(split(x).float(), ref, atol=3e-2 * float(ref.abs().max()), rtol=2e-2)
