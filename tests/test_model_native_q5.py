"""The 5-bit kernel (GGUF Q5_0, Q5_1, Q5_K as the file has them: ``native.pack_q5_tiles``, ``matmul(five=True)``,
``Int5Linear``): its tiles hold every value, its sums are exact integer sums of the weights' 5-bit values times the
int8 activations, a row's result does not depend on its batch, and the layer is chosen for those types only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_model_gguf_types import k_blocks

from tickloom.engine.model import gguf_quants, native
from tickloom.engine.model.quant import GroupedInt8Linear, Int4Linear, RawBlocks, join_linear, quantize_linear
from tickloom.engine.model.quant_grouped import Int5Linear, SplitLinear

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")


def _weights(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random 5-bit values, float16-exact s and z (``w = s q + z`` per 32)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 32, (n, k), dtype=np.uint8)
    s = (rng.random((n, k // 32)) * 0.02 + 0.001).astype(np.float16).astype(np.float32)
    z = (-16 * s + rng.normal(0, 0.01, s.shape)).astype(np.float16).astype(np.float32)
    return q, s, z


def _reference(x: torch.Tensor, q: np.ndarray, s: np.ndarray, z: np.ndarray) -> torch.Tensor:
    """The kernel's arithmetic: activations rounded to int8 per group of 32 as the kernel rounds them (float32
    ``x * (127 / max|x|)`` to nearest even, step ``max|x| / 127``), then ``dx * (s * sum q qx + z * sum qx)`` per
    group in float64."""
    xf = x.float().reshape(x.shape[0], -1, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, 1.0), 0.0)
    qx = torch.round(xf * inv).double()
    dx = (amax / 127.0).double()
    qg = torch.from_numpy(q.astype(np.float64)).reshape(q.shape[0], -1, 32)
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


def test_q5_tiles_hold_every_value() -> None:
    q, s, z = _weights(48, 96, seed=1)
    tiles = native.pack_q5_tiles(q, s, z)
    assert tiles.shape == (3, 3, native.Q5_TILE_BYTES)
    back = native.unpack_q5_tiles(tiles)
    assert np.array_equal(back[0], q) and np.array_equal(back[1], s) and np.array_equal(back[2], z)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 17])
def test_q5_matmul_is_the_exact_integer_sum_at_every_row_tile(m: int) -> None:
    """Every value 0..31 (the fifth bit included, in both nibbles of a byte) counts; one or two rows a pass, eight,
    and the rest, each their own code path."""
    q, s, z = _weights(64, 160, seed=m)
    x = _activations(m, 160, seed=m)
    y = native.matmul(x, native.pack_q5_tiles(q, s, z), 64, torch.float32, five=True)
    ref = _reference(x, q, s, z)
    torch.testing.assert_close(y.double(), ref, atol=1e-5 * float(ref.abs().max()), rtol=0)
    hi_only = np.where(q >= 16, q, 16).astype(np.uint8)  # wrong fifth bits would show here
    y_hi = native.matmul(x, native.pack_q5_tiles(hi_only, s, z), 64, torch.float32, five=True)
    ref_hi = _reference(x, hi_only, s, z)
    torch.testing.assert_close(y_hi.double(), ref_hi, atol=1e-5 * float(ref_hi.abs().max()), rtol=0)


def test_q5_rows_do_not_depend_on_their_batch_or_the_threads_and_bf16_rounds_the_float32_sums() -> None:
    q, s, z = _weights(128, 256, seed=4)
    tiles = native.pack_q5_tiles(q, s, z)
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    whole = native.matmul(x, tiles, 128, torch.float32, five=True)
    for i in range(11):
        assert torch.equal(native.matmul(x[i : i + 1].contiguous(), tiles, 128, torch.float32, five=True),
                           whole[i : i + 1])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(native.matmul(x, tiles, 128, torch.float32, five=True), whole)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(native.matmul(x, tiles, 128, five=True), whole.bfloat16())


def _gguf_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    import gguf

    if kind == "Q5_K":
        return k_blocks(kind, n, k, seed)
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return np.ascontiguousarray(gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind))).view(
        np.uint8).reshape(n, -1)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K"])
def test_5_bit_gguf_types_become_int5_layers_with_the_files_values(kind: str) -> None:
    """Under the default ("int4": the file's integers as they are) a 5-bit type keeps its five bits: the layer's
    weight is the file's, up to s and z rounded to float16 (exact for Q5_0 and Q5_1, whose d and m are float16)."""
    data = _gguf_blocks(kind, 48, 512, seed=7)
    lin = quantize_linear(RawBlocks(kind, data, (48, 512)), None, "int4", torch.bfloat16)
    assert isinstance(lin, Int5Linear) and lin.nbytes() == 48 * 512 * 384 // 512
    want = torch.from_numpy(gguf_quants.dequantize(kind, data))
    got = lin.dequantize()
    if kind == "Q5_K":  # d * sc and dmin * m rounded to float16, as the int4 path does for Q4_K
        torch.testing.assert_close(got, want, atol=2e-3 * float(want.abs().max()), rtol=0)
    else:
        assert torch.equal(got, want)
    x = torch.randn(3, 512).bfloat16()
    assert torch.equal(lin.forward_f32(x).bfloat16(), lin(x))
    # the int8 setting keeps its grouped int8 form
    assert isinstance(quantize_linear(RawBlocks(kind, data, (48, 512)), None, "int8", torch.bfloat16),
                      GroupedInt8Linear)


def test_a_q5_k_m_projection_joins_its_5_bit_parts_and_keeps_the_rest_apart() -> None:
    """Q5_K q and k join into one 5-bit layer; a Q6_K v beside them stays grouped int8; a Q4_K part stays int4."""
    q, k, v = _gguf_blocks("Q5_K", 32, 512, 1), _gguf_blocks("Q5_K", 16, 512, 2), _gguf_blocks("Q5_K", 16, 512, 3)
    joined = join_linear([RawBlocks("Q5_K", q, (32, 512)), RawBlocks("Q5_K", k, (16, 512))], None, "int4",
                         torch.bfloat16)
    assert isinstance(joined, Int5Linear) and joined.out_features == 48
    six = k_blocks("Q6_K", 16, 512, 4)
    four = k_blocks("Q4_K", 16, 512, 5)
    split = join_linear([RawBlocks("Q5_K", q, (32, 512)), RawBlocks("Q6_K", six, (16, 512)),
                         RawBlocks("Q4_K", four, (16, 512)), RawBlocks("Q5_K", v, (16, 512))], None, "int4",
                        torch.bfloat16)
    assert isinstance(split, SplitLinear)
    assert [type(p) for p in split.parts] == [Int5Linear, GroupedInt8Linear, Int4Linear, Int5Linear]
