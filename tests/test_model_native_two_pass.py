"""Two 8-bit passes of the activations in the 4-, 5- and 6-bit kernels (``native.matmul(passes=2)``,
``cpu_kernels_common.h``): the value rounded to 8 bits per group of 32, then its rounding residual on a scale of its
own, in the groups whose step is far above the row's others, both multiplied by weights read once. The down
projection asks for them (``LayerWeights``): its input has a few values far above the rest of their group."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_model_gguf_sources import write_k_gguf

from tickloom.engine.model import native, packing
from tickloom.engine.model.batch import RowSpec, build_step_batch
from tickloom.engine.model.loaders import load_model
from tickloom.engine.model.quant import Int4Linear
from tickloom.engine.model.quant_grouped import SplitLinear, WideIntLinear
from tickloom.engine.model.tiny import write_tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")

N, K = 48, 512  # two of Q6_K's super-blocks of 256


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
    elif bits == 5:
        tiles = packing.pack_wide_tiles(q, s, z, bits)
        w = q.reshape(N, -1, 32).astype(np.float32) * s[..., None] + z[..., None]
    else:  # Q6_K's scales: an int8 per 16 times a float16 per 256
        sc = rng.integers(-128, 128, (N, K // 16)).astype(np.int8)
        d = (rng.random((N, K // 256)) * 2e-4 + 1e-5).astype(np.float16).astype(np.float32)
        tiles = packing.pack_q6_tiles(q, sc, d)
        s = d.repeat(16, axis=1) * sc.astype(np.float32)
        w = (q.reshape(N, -1, 16).astype(np.float32) - 32.0) * s[..., None]
    return tiles, torch.from_numpy(w.reshape(N, K))


def _outliers(m: int, seed: int) -> torch.Tensor:
    """Rows like the down projection's input: most values small, a few groups with a value far above the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g)
    for row in range(m):
        for group in torch.randperm(K // 32, generator=g)[:2].tolist():
            x[row, 32 * group + row % 32] *= 25.0
    return x.bfloat16()


def _rounded(x: torch.Tensor, second_pass: str) -> tuple[np.ndarray, np.ndarray]:
    """What the kernel multiplies: each group of 32 rounded to 8 bits on its step d = max|x| / 127 (float32, to
    nearest even), plus its residual rounded the same way in the groups ``second_pass`` says ("none", "all", or
    "above": those whose step is above 1.5 times the root mean square of the row's steps). Float64, and the mask of
    the groups that got a second pass."""
    f32 = np.float32
    v = x.float().numpy().reshape(x.shape[0], -1, 32)

    def step(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        amax = np.abs(values).max(-1, keepdims=True)
        d = (amax / f32(127)).astype(f32)
        inv = np.where(amax > 0, f32(127) / np.where(amax > 0, amax, f32(1)), f32(0)).astype(f32)
        return d, np.rint((values * inv).astype(f32))

    d, q = step(v)
    r = (v - (d * q).astype(f32)).astype(f32)
    d2, q2 = step(r)
    if second_pass == "none":
        chosen = np.zeros(d.shape[:2], dtype=bool)
    elif second_pass == "all":
        chosen = np.ones(d.shape[:2], dtype=bool)
    else:
        chosen = np.zeros(d.shape[:2], dtype=bool)
        for row in range(d.shape[0]):
            total = f32(0)
            for g in range(d.shape[1]):  # in group order, float32, as the kernel sums
                total = f32(total + f32(d[row, g, 0] * d[row, g, 0]))
            limit = f32(1.5) * np.sqrt(f32(total / f32(d.shape[1])))
            chosen[row] = d[row, :, 0] > limit
    eff = d.astype(np.float64) * q + np.where(chosen[..., None], d2.astype(np.float64) * q2, 0.0)
    return eff.reshape(x.shape), chosen


def _error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("bits", [4, 5, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9])
def test_the_second_pass_goes_to_the_groups_whose_step_is_above_one_and_a_half_rms(bits: int, m: int) -> None:
    """At every remainder of the row tiling (8 rows a pass over the weights, then 1..7): the kernel's sums are the
    weights times the activations rounded once, plus the residual rounded again in exactly the groups whose step
    is above 1.5 times the rms of the row's steps, to float32 summation; not the product with a second pass in
    every group, nor in none."""
    tiles, w = _tiles(bits, seed=bits * 10 + m)
    x = _outliers(m, seed=m)
    two = native.matmul(x, tiles, N, torch.float32, bits=bits, passes=2)
    one = native.matmul(x, tiles, N, torch.float32, bits=bits)
    wd = w.double()
    above, chosen = _rounded(x, "above")
    assert chosen.any() and not chosen.all()
    for rule, y in (("above", two), ("none", one)):
        assert _error(y, torch.from_numpy(_rounded(x, rule)[0]) @ wd.t()) < 2e-6, rule
    others = torch.from_numpy(_rounded(x, "all")[0]) @ wd.t(), torch.from_numpy(_rounded(x, "none")[0]) @ wd.t()
    for ref in others:
        assert _error(two, ref) > 20 * _error(two, torch.from_numpy(above) @ wd.t())


@pytest.mark.parametrize("bits", [4, 6])
def test_the_second_pass_brings_the_chosen_groups_to_about_15_bits(bits: int) -> None:
    """A row whose every group but one is zero: that group's step is the only one above the limit, and its product
    is the float32 one to the residual's rounding (1/127 of 1/127 of its largest value), where one pass leaves
    1/254 of it."""
    tiles, w = _tiles(bits, seed=3)
    x = torch.zeros(1, K)
    x[0, 64:96] = torch.randn(32, generator=torch.Generator().manual_seed(3))
    x[0, 70] = 30.0
    x = x.bfloat16()
    ref = x.double() @ w.double().t()
    two = native.matmul(x, tiles, N, torch.float32, bits=bits, passes=2)
    one = native.matmul(x, tiles, N, torch.float32, bits=bits)
    assert _error(two, ref) < 1e-4 < _error(one, ref)


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


@pytest.fixture(scope="module")
def tiny_256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", hidden_size=256, intermediate_size=512,
                            num_heads=4, num_kv_heads=2, seed=11)


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_1", "Q6_K"])
def test_every_projection_takes_two_passes(kind: str, tiny_256: Path, tmp_path: Path) -> None:
    """Every projection on an integer kernel gets the second pass (q/k/v, o, gate/up and down): in a forward, the
    q/k/v projection's output (bfloat16, through ``__call__``) and the down projection's (float32, added to the
    residual stream through ``forward_f32``) are the two-pass products of their inputs, and on rows with a wide
    group each projection's output is the two-pass product, which differs from one pass."""
    names = ("qkv", "wo", "w13", "w2")
    gguf = write_k_gguf(tiny_256, tmp_path / "m.gguf", {f"{n}.weight": kind for n in (
        "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}, default="Q4_0")
    model = load_model(gguf, quant="int4").model
    for layer in model.layers:
        for name in names:
            proj = getattr(layer, name)
            assert isinstance(proj, Int4Linear | WideIntLinear) and proj.passes == 2, name
    seen: dict[str, list[torch.Tensor]] = {}

    def spy(name: str) -> object:
        inner = getattr(model.layers[0], name)

        class Spy:
            in_features, out_features, bias = inner.in_features, inner.out_features, None

            def __call__(self, x: torch.Tensor) -> torch.Tensor:
                y = inner(x)
                seen[name] = [x, y.float()]
                return y

            def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
                y = inner.forward_f32(x)
                seen[name] = [x, y]
                return y

        return Spy()

    spied = {name: getattr(model.layers[0], name) for name in ("qkv", "w2")}
    for name in spied:
        setattr(model.layers[0], name, spy(name))
    model.layers_changed()  # the spies are not kernels: the layer loop runs
    gqa = model.cfg.num_heads // model.cfg.num_kv_heads
    model.forward(build_step_batch([RowSpec(0, 12, [0], True)], list(range(30, 42)), 16, gqa, model.device),
                  model.new_kv_cache(2, 16))
    for name, inner in spied.items():
        x, y = seen[name]
        bits = inner.bits if isinstance(inner, WideIntLinear) else 4

        def product(passes: int, inner: Int4Linear | WideIntLinear = inner, x: torch.Tensor = x,
                    bits: int = bits) -> torch.Tensor:
            return native.matmul(x, inner.tiles, inner.out_features, torch.float32, bits=bits, passes=passes)

        assert torch.equal(y, product(2).bfloat16().float() if name == "qkv" else product(2)), name
    # the forward's inputs here may have no group far above the rest; rows that do tell the passes apart
    g = torch.Generator().manual_seed(5)
    for name in names:
        proj = getattr(model.layers[1], name)
        x = torch.randn(3, proj.in_features, generator=g)
        x[:, 7] *= 25.0
        x = x.bfloat16()
        bits = proj.bits if isinstance(proj, WideIntLinear) else 4
        one, two = (native.matmul(x, proj.tiles, proj.out_features, bits=bits, passes=p) for p in (1, 2))
        assert torch.equal(proj(x), two) and not torch.equal(two, one), name


@pytest.mark.parametrize(("qk", "v"), [("Q4_0", "Q6_K"), ("Q5_0", "Q4_0")])
def test_a_split_projections_parts_take_two_passes(qk: str, v: str, tiny_256: Path, tmp_path: Path) -> None:
    """A Q4_K_M-like file's q/k beside a v of another type is a ``SplitLinear`` of two kernels' layers: each part
    gets the second pass, and the split projection's output on rows with a wide group is the parts' two-pass
    products side by side."""
    gguf = write_k_gguf(tiny_256, tmp_path / "m.gguf",
                        {"attn_q.weight": qk, "attn_k.weight": qk, "attn_v.weight": v}, default="Q4_0")
    model = load_model(gguf, quant="int4").model
    for layer in model.layers:
        assert isinstance(layer.qkv, SplitLinear) and len(layer.qkv.parts) == 2
        assert all(isinstance(p, Int4Linear | WideIntLinear) and p.passes == 2 for p in layer.qkv.parts)
    split = model.layers[0].qkv
    x = torch.randn(3, split.in_features, generator=torch.Generator().manual_seed(8))
    x[:, 7] *= 25.0
    x = x.bfloat16()

    def product(p: Int4Linear | WideIntLinear, passes: int) -> torch.Tensor:
        bits = p.bits if isinstance(p, WideIntLinear) else 4
        return native.matmul(x, p.tiles, p.out_features, bits=bits, passes=passes)

    two = torch.cat([product(p, 2) for p in split.parts], dim=-1)
    assert torch.equal(split(x), two) and not torch.equal(two, torch.cat([product(p, 1) for p in split.parts], -1))
