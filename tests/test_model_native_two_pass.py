"""Two 8-bit passes of the activations in the 4-, 5- and 6-bit kernels (``native.matmul(passes=2)``,
``cpu_kernels_common.h``): the value rounded to 8 bits per group of 32, then its rounding residual on a scale of its
own, both multiplied by weights read once. The down projection asks for them (``LayerWeights``): its input has a
few values far above the rest of their group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tickloom.engine.model import native, packing

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")

N, K = 48, 256


def _tiles(bits: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``bits``-bit tiles and the float32 ``N x K`` weight they hold."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 2**bits, (N, K), dtype=np.uint8)
    s = (rng.random((N, K // (16 if bits == 6 else 32))) * 0.02 + 0.001).astype(np.float16).astype(np.float32)
    z = (-(2 ** (bits - 1)) * s + rng.normal(0, 0.01, s.shape)).astype(np.float16).astype(np.float32)
    if bits == 4:
        low = q.reshape(N, -1, 32)
        tiles = packing.pack_tiles(low[..., :16] | (low[..., 16:] << 4), s, z)
        w = low.astype(np.float32) * s[..., None] + z[..., None]
    else:
        tiles = packing.pack_wide_tiles(q, s, None if bits == 6 else z, bits)
        group = K // s.shape[1]
        offset = -32.0 * s if bits == 6 else z
        w = q.reshape(N, -1, group).astype(np.float32) * s[..., None] + offset[..., None]
    return tiles, torch.from_numpy(w.reshape(N, K))


def _outliers(m: int, seed: int) -> torch.Tensor:
    """Rows like the down projection's input: most values small, one in each group of 32 twenty times larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g)
    x[:, ::32] *= 20.0
    return x.bfloat16()


def _error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).norm() / ref.norm())


@pytest.mark.parametrize("bits", [4, 5, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9])
def test_two_passes_give_the_float32_product_to_about_15_bits(bits: int, m: int) -> None:
    """At every remainder of the row tiling (8 rows a pass over the weights, then 1..7): one pass leaves the small
    values of a group with an outlier a few levels of 8 bits; the residual's pass brings the product to within
    float32 summation and the residual's own rounding (about 1/127 of 1/127 of the group's largest value)."""
    tiles, w = _tiles(bits, seed=bits * 10 + m)
    x = _outliers(m, seed=m)
    ref = x.float() @ w.t()
    one = native.matmul(x, tiles, N, torch.float32, bits=bits)
    two = native.matmul(x, tiles, N, torch.float32, bits=bits, passes=2)
    assert _error(two, ref) < 2e-4
    assert _error(one, ref) > 20 * _error(two, ref)


@pytest.mark.parametrize("bits", [4, 5, 6])
def test_two_passes_round_to_bfloat16_as_the_float32_sums_do(bits: int) -> None:
    tiles, _ = _tiles(bits, seed=bits)
    x = _outliers(5, seed=bits)
    two = native.matmul(x, tiles, N, torch.float32, bits=bits, passes=2)
    assert torch.equal(native.matmul(x, tiles, N, torch.bfloat16, bits=bits, passes=2), two.bfloat16())


@pytest.mark.parametrize("bits", [4, 5, 6])
def test_a_rows_two_pass_result_does_not_depend_on_its_batch_or_the_threads(bits: int) -> None:
    """The residual's rows sit after all of the first pass's in the scratch (rows M..2M-1): a row's sums must not
    depend on M, or on which rows share its tile of eight."""
    tiles, _ = _tiles(bits, seed=40 + bits)
    x = _outliers(11, seed=40 + bits)
    whole = native.matmul(x, tiles, N, torch.float32, bits=bits, passes=2)
    for i in range(11):
        alone = native.matmul(x[i : i + 1].contiguous(), tiles, N, torch.float32, bits=bits, passes=2)
        assert torch.equal(alone, whole[i : i + 1]), i
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(native.matmul(x, tiles, N, torch.float32, bits=bits, passes=2), whole)
    finally:
        torch.set_num_threads(before)


def test_exactly_representable_activations_leave_no_residual() -> None:
    """Values that one pass rounds exactly (integers up to 127 in a group whose largest is 127) have a zero
    residual, whose group has no scale to divide by: the second pass adds nothing, not NaN."""
    tiles, _ = _tiles(4, seed=7)
    x = torch.randint(-127, 128, (3, K), generator=torch.Generator().manual_seed(7)).float()
    x[:, ::32] = 127.0
    x[2] = 0.0
    xb = x.bfloat16()
    one = native.matmul(xb, tiles, N, torch.float32)
    two = native.matmul(xb, tiles, N, torch.float32, passes=2)
    assert torch.equal(one, two)
    assert torch.equal(two[2], torch.zeros(N))


def test_other_pass_counts_are_refused_by_name() -> None:
    tiles, _ = _tiles(4, seed=1)
    with pytest.raises(ValueError, match="passes 3"):
        native.matmul(_outliers(1, seed=1), tiles, N, passes=3)
