"""GGUF blocks packed into the kernels' tiles in C (``gguf_pack.pack_gguf``, ``cpu_kernels_pack.h``): for every
type it takes, the tiles are byte for byte those of the numpy path (``gguf_quants``' fields into ``packing``'s
packers, as the layers built them), whatever the scales (negative, zero, subnormal, huge; every 6-bit K-quant
scale and min), the shape, the thread count and the parts of a joined projection; what does not fit is refused by
name; and a model loads to the same logits either way."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from test_model_gguf_sources import write_k_gguf
from test_model_loaders import all_logits

from tickloom.engine.model import gguf_pack, gguf_quants, native
from tickloom.engine.model.head import Q8Linear
from tickloom.engine.model.loaders import load_model
from tickloom.engine.model.quant import Int4Linear, RawBlocks, join_linear
from tickloom.engine.model.quant_grouped import GroupedInt8Linear, WideIntLinear
from tickloom.engine.model.tiny import write_tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")

KINDS = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
_SPECIAL = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00,
                     0x1400, 0x9400], dtype=np.uint16)
"""float16 bits every test's scales include: both zeros, subnormals, the largest and smallest normals, +-1."""


def _halves(rng: np.random.Generator, count: int) -> np.ndarray:
    """``count`` finite float16s as ``count x 2`` bytes: half any finite bits (every sign and exponent, so products
    overflow and go subnormal too), half model-sized values of either sign; ``_SPECIAL`` first."""
    bits = rng.integers(0, 1 << 16, count, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] ^= 0x4000  # inf and NaN exponents made finite
    usual = (rng.standard_normal(count) * 1e-3).astype(np.float16).view(np.uint16)
    bits = np.where(rng.random(count) < 0.5, bits, usual)
    bits[: min(count, len(_SPECIAL))] = _SPECIAL[:count]
    return bits.view(np.uint8).reshape(count, 2)


def _k_scale_bytes(index: np.ndarray) -> np.ndarray:
    """The 12 bytes of 8 6-bit scales and 8 mins (``gguf_quants._k_scales_mins``' encoding) for super-blocks
    ``index``: scale j is ``(i + 9 j) % 64``, min j ``(3 i + 5 j + 1) % 64``, so any 64 consecutive super-blocks
    hold every value in every position."""
    j = np.arange(8)
    sc = ((index[:, None] + 9 * j) % 64).astype(np.uint8)
    m = ((3 * index[:, None] + 5 * j + 1) % 64).astype(np.uint8)
    out = np.empty((len(index), 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    out[:, 4:8] = m[:, :4] | (m[:, 4:] >> 4) << 6
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | (m[:, 4:] & 0x0F) << 4
    return out


def gguf_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """``n`` rows of random ``kind`` blocks, ``N x row bytes``: random integers and high bits, ``_halves`` scales
    (and mins), the K-quants' 6-bit scales and mins cycling through every value."""
    rng = np.random.default_rng(seed)
    size, per = gguf_quants.BLOCKS[kind]
    b = rng.integers(0, 256, (n * (k // per), size), dtype=np.uint8)
    at = 208 if kind == "Q6_K" else 0  # Q6_K: d last, its int8 scales (any byte) before it
    b[:, at : at + 2] = _halves(rng, len(b))
    if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
        b[:, 2:4] = _halves(rng, len(b))[::-1]
    if kind in ("Q4_K", "Q5_K"):
        b[:, 4:16] = _k_scale_bytes(np.arange(len(b)) + seed)
    return b.reshape(n, -1)


def test_the_test_blocks_hold_every_k_scale_and_min_and_the_special_scales() -> None:
    for kind in ("Q4_K", "Q5_K"):
        b = gguf_blocks(kind, 16, 1024, seed=3).reshape(64, -1)
        sc, m = gguf_quants._k_scales_mins(b[:, 4:16])
        for j in range(8):
            assert set(sc[:, j].tolist()) == set(range(64)) and set(m[:, j].tolist()) == set(range(64))
        assert set(_SPECIAL.tolist()) <= set(b[:, 0:2].copy().view(np.uint16)[:, 0].tolist())


def numpy_tiles(parts: list[tuple[str, np.ndarray]]) -> torch.Tensor:
    """The tiles the numpy path makes of GGUF tensors stacked along the output axis (``gguf_pack`` switched off):
    the layer ``join_linear`` builds, as the loader builds it."""
    ws = [RawBlocks(kind, data, (data.shape[0], data.shape[1] // gguf_quants.BLOCKS[kind][0] *
                                 gguf_quants.BLOCKS[kind][1])) for kind, data in parts]
    with pytest.MonkeyPatch.context() as mp, np.errstate(over="ignore"):  # huge scales: z = -8 d overflows
        mp.setattr(gguf_pack, "enabled", lambda: False)
        layer = join_linear(list(ws), None, "int4", torch.bfloat16)
    tiles = getattr(layer, "tiles", None)
    assert isinstance(tiles, torch.Tensor), type(layer)
    return tiles


SHAPES = [(16, 256), (48, 512), (160, 768), (32, 1024)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_c_tiles_equal_the_numpy_tiles_byte_for_byte(kind: str, n: int, k: int) -> None:
    data = gguf_blocks(kind, n, k, seed=n + k)
    fast = gguf_pack.pack_gguf([(kind, data)])
    want = numpy_tiles([(kind, data)])
    unit = 256 if kind == "Q6_K" else 32  # Q6_K: a super-block of 8 tiles and its d
    assert fast.dtype == torch.uint8 and fast.shape == want.shape == (n // 16, k // unit, want.shape[2])
    assert torch.equal(fast, want)


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0", "Q8_0"])
def test_groups_of_32_need_no_whole_super_block(kind: str) -> None:
    data = gguf_blocks(kind, 32, 96, seed=5)
    assert torch.equal(gguf_pack.pack_gguf([(kind, data)]), numpy_tiles([(kind, data)]))


@pytest.mark.parametrize("kinds", [("Q4_0", "Q4_K", "Q4_1"), ("Q5_K", "Q5_0", "Q5_1"), ("Q8_0", "Q8_0", "Q8_0"),
                                   ("Q6_K", "Q6_K", "Q6_K"),
                                   ("Q4_K", "Q4_K"), ("Q5_1", "Q5_1", "Q5_1")])
def test_joined_parts_of_different_row_counts_fill_their_own_row_blocks(kinds: tuple[str, ...]) -> None:
    """q/k/v or gate/up: each part's tiles at its rows, parts of one type or several (the loader's two paths: one
    type joins without a copy of the bytes, several as a run), equal to the numpy path's joined layer."""
    rows = [64, 16, 48][: len(kinds)]
    parts = [(kind, gguf_blocks(kind, n, 512, seed=i)) for i, (kind, n) in enumerate(zip(kinds, rows, strict=True))]
    fast = gguf_pack.pack_gguf(parts)
    assert fast.shape[0] == sum(rows) // 16
    assert torch.equal(fast, numpy_tiles(parts))
    at = 0
    for kind, data in parts:  # and each part's tiles are its own packing
        assert torch.equal(fast[at : at + data.shape[0] // 16], gguf_pack.pack_gguf([(kind, data)]))
        at += data.shape[0] // 16


def test_the_layers_take_the_c_tiles_where_the_kernels_run() -> None:
    """``join_linear`` builds the same layers with the tiles from C (the loader's path) as the numpy path."""
    cases: list[tuple[list[str], type]] = [(["Q4_0", "Q4_K"], Int4Linear), (["Q4_1", "Q4_1"], Int4Linear),
                                           (["Q5_0", "Q5_K"], WideIntLinear), (["Q5_K"], WideIntLinear),
                                           (["Q6_K", "Q6_K"], WideIntLinear), (["Q6_K"], WideIntLinear),
                                           (["Q8_0", "Q8_0"], GroupedInt8Linear), (["Q8_0"], GroupedInt8Linear)]
    for kinds, cls in cases:
        ws = [RawBlocks(kind, gguf_blocks(kind, 32 * (i + 1), 256, seed=i), (32 * (i + 1), 256))
              for i, kind in enumerate(kinds)]
        bias = torch.randn(sum(w.shape[0] for w in ws))
        layer = join_linear(list(ws), [bias[:32], bias[32:]] if len(ws) == 2 else [bias], "int4", torch.bfloat16)
        assert isinstance(layer, cls), (kinds, type(layer))
        assert (layer.out_features, layer.in_features) == (bias.shape[0], 256)
        assert torch.equal(layer.tiles, numpy_tiles([(w.kind, w.data) for w in ws]))  # type: ignore[attr-defined]
        x = torch.randn(3, 256).bfloat16()
        with pytest.MonkeyPatch.context() as mp, np.errstate(over="ignore"):
            mp.setattr(gguf_pack, "enabled", lambda: False)
            slow = join_linear(list(ws), [bias[:32], bias[32:]] if len(ws) == 2 else [bias], "int4", torch.bfloat16)
        torch.testing.assert_close(layer(x), slow(x), rtol=0, atol=0, equal_nan=True)  # huge scales make inf, NaN


def test_a_float16_model_keeps_its_activations() -> None:
    """Under float16 activations grouped Q8_0 packs in C and keeps float16; int4 takes torch's kernel, no tiles."""
    x = torch.randn(2, 256).half()
    for kind in ("Q8_0", "Q4_0"):
        ws = [RawBlocks(kind, gguf_blocks(kind, 32, 256, seed=4), (32, 256))]
        fast = join_linear(list(ws), None, "int4", torch.float16)
        with pytest.MonkeyPatch.context() as mp, np.errstate(over="ignore"):
            mp.setattr(gguf_pack, "enabled", lambda: False)
            slow = join_linear(list(ws), None, "int4", torch.float16)
        assert type(fast) is type(slow) and fast.act == slow.act == torch.float16  # type: ignore[attr-defined]
        y = fast(x)
        assert y.dtype == torch.float16
        torch.testing.assert_close(y, slow(x), rtol=0, atol=0, equal_nan=True)


def test_a_q8_0_head_and_a_single_q8_0_layer_pack_in_c() -> None:
    data = gguf_blocks("Q8_0", 48, 256, seed=9)
    head = Q8Linear.from_weight(RawBlocks("Q8_0", data, (48, 256)))
    assert (head.out_features, head.in_features) == (48, 256)
    assert torch.equal(head.tiles, numpy_tiles([("Q8_0", data)]))
    layer = GroupedInt8Linear.from_gguf_blocks(data, "Q8_0")
    assert layer.tiles is not None and torch.equal(layer.tiles, head.tiles) and layer.z is None and layer.q is None


@pytest.mark.parametrize("kind", ["Q6_K", "Q4_K", "Q4_0", "Q5_K", "F16", "float"])
def test_a_head_of_another_type_rounds_to_the_8_bit_tiles_in_c_as_numpy_does(kind: str) -> None:
    """``Q8Linear.from_weight`` of a head that is not Q8_0 (a Q4_0 file's Q6_K embedding): each group of 32 of the
    dequantized rows rounded to int8 on its own step, in C chunk by chunk, the bytes of the numpy/torch rounding;
    ties (values at half a step), an all-zero group and a float tensor included."""
    n, k = 80, 512
    if kind == "float":
        rng = np.random.default_rng(3)
        f = rng.standard_normal((n, k)).astype(np.float32)
        f[0, :32] = 0.0
        f[1, :32] = np.arange(32) - 15.5  # halves: 127 / 16 steps put several values at exact ties
        w: torch.Tensor | RawBlocks = torch.from_numpy(f)
    elif kind == "F16":
        data = (np.random.default_rng(4).standard_normal((n, k)) * 0.1).astype(np.float16).view(np.uint8)
        w = RawBlocks(kind, data.reshape(n, -1), (n, k))
    else:
        w = RawBlocks(kind, gguf_blocks(kind, n, k, seed=6), (n, k))
    with np.errstate(over="ignore", invalid="ignore"):
        fast = Q8Linear.from_weight(w, chunk=32)  # chunks of 32 rows: two row blocks each, and a last one
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gguf_pack, "enabled", lambda: False)
            slow = Q8Linear.from_weight(w, chunk=32)
    assert torch.equal(fast.tiles, slow.tiles)
    with pytest.raises(ValueError, match="rows in 16s"):
        native.pack_q8_from_float(np.zeros((24, 64), np.float32), torch.empty(1, 2, 576, dtype=torch.uint8))


def test_threads_split_the_row_blocks_to_the_same_bytes() -> None:
    before = torch.get_num_threads()
    for kind in KINDS:
        data = gguf_blocks(kind, 128, 512, seed=11)
        one = gguf_pack.pack_gguf([(kind, data)])
        try:
            torch.set_num_threads(2)
            assert torch.equal(gguf_pack.pack_gguf([(kind, data)]), one), kind
        finally:
            torch.set_num_threads(before)


def test_rows_with_a_stride_are_read_where_they_are() -> None:
    """A tensor's rows as a view into a wider buffer (as rows of a file's mapping can be) pack as the rows would."""
    data = gguf_blocks("Q4_K", 32, 512, seed=2)
    wide = np.zeros((32, data.shape[1] + 40), dtype=np.uint8)
    wide[:, 8 : 8 + data.shape[1]] = data
    view = wide[:, 8 : 8 + data.shape[1]]
    assert not view.flags.c_contiguous
    assert torch.equal(gguf_pack.pack_gguf([("Q4_K", view)]), gguf_pack.pack_gguf([("Q4_K", data)]))


@pytest.mark.skipif(shutil.which("cc") is None or native.variant() != "avx512", reason="runs the AVX2 build beside "
                    "the AVX512 one")
def test_the_avx2_build_packs_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build = next(b for b in native._BUILDS if b.name == "avx2")
    out = tmp_path / "avx2.so"
    subprocess.run(["cc", *build.flags, "-o", str(out), str(build.source)], check=True, capture_output=True, text=True)
    data = {kind: gguf_blocks(kind, 48, 512, seed=13) for kind in KINDS}
    running = {kind: gguf_pack.pack_gguf([(kind, d)]) for kind, d in data.items()}
    avx2 = native._Kernel(ctypes.CDLL(str(out)), "avx2")
    monkeypatch.setattr(native, "_kernel", lambda: avx2)
    for kind, d in data.items():
        assert torch.equal(gguf_pack.pack_gguf([(kind, d)]), running[kind]), kind


BAD: list[tuple[str, Callable[[], object], str]] = [
    ("rows", lambda: gguf_pack.pack_gguf([("Q4_0", gguf_blocks("Q4_0", 24, 64, 0))]), r"24 rows.*sixteens"),
    ("joined rows", lambda: gguf_pack.pack_gguf([("Q4_0", gguf_blocks("Q4_0", 16, 64, 0)),
                                                 ("Q4_0", gguf_blocks("Q4_0", 8, 64, 0))]), r"8 rows"),
    ("widths", lambda: gguf_pack.pack_gguf([("Q5_0", gguf_blocks("Q5_0", 16, 64, 0)),
                                            ("Q5_1", gguf_blocks("Q5_1", 16, 96, 0))]),
     r"input sizes differ \(\[64, 96\]\)"),
    ("families", lambda: gguf_pack.pack_gguf([("Q4_0", gguf_blocks("Q4_0", 16, 256, 0)),
                                              ("Q5_K", gguf_blocks("Q5_K", 16, 256, 0))]),
     r"\['Q4_0', 'Q5_K'\] do not make one kind of tile"),
    ("type", lambda: gguf_pack.pack_gguf([("Q3_K", np.zeros((16, 110), np.uint8))]), r"\['Q3_K'\]"),
    ("partial block", lambda: gguf_pack.pack_gguf([("Q8_0", np.zeros((16, 50), np.uint8))]),
     r"Q8_0 data \(16, 50\) uint8 is not N x whole 34-byte blocks"),
    ("dtype", lambda: gguf_pack.pack_gguf([("Q8_0", np.zeros((16, 34), np.int8))]), r"int8"),
    ("no parts", lambda: gguf_pack.pack_gguf([]), r"no parts"),
    ("out shape", lambda: native.pack_gguf_tiles("Q4_0", gguf_blocks("Q4_0", 16, 64, 0),
                                                 torch.empty(1, 3, 320, dtype=torch.uint8)),
     r"Q4_0 blocks \(16, 36\).*do not fill tiles \(1, 3, 320\): want uint8 \(16, 54\)"),
    ("out tile bytes", lambda: native.pack_gguf_tiles("Q5_0", gguf_blocks("Q5_0", 16, 64, 0),
                                                      torch.empty(1, 2, 320, dtype=torch.uint8)),
     r"out \(1, 2, 320\) torch.uint8 is not contiguous uint8 tiles of 384 bytes \(Q5_0\)"),
    ("out kind", lambda: native.pack_gguf_tiles("Q3_K", np.zeros((16, 110), np.uint8),
                                                torch.empty(1, 8, 320, dtype=torch.uint8)), r"no tiles for Q3_K"),
    ("q6 out", lambda: native.pack_gguf_tiles("Q6_K", np.zeros((16, 210), np.uint8),
                                              torch.empty(1, 8, 416, dtype=torch.uint8)),
     r"not contiguous uint8 tiles of 3360 bytes \(Q6_K\)"),
]


@pytest.mark.parametrize(("what", "call", "message"), BAD, ids=[b[0] for b in BAD])
def test_what_does_not_fit_is_refused_by_name(what: str, call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


MIXES = {
    "runs": {"attn_q.weight": "Q4_0", "attn_k.weight": "Q4_K", "attn_v.weight": "Q4_1", "attn_output.weight": "Q8_0",
             "ffn_gate.weight": "Q5_0", "ffn_up.weight": "Q5_K", "ffn_down.weight": "Q5_1",
             "output.weight": "Q8_0", "token_embd.weight": "Q8_0"},
    "joined": {"attn_q.weight": "Q8_0", "attn_k.weight": "Q8_0", "attn_v.weight": "Q8_0", "attn_output.weight": "Q5_K",
               "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q4_1", "ffn_down.weight": "Q5_0",
               "output.weight": "Q6_K", "token_embd.weight": "Q4_0"},
}
"""Two files' types: q/k/v and gate/up as runs of different types, and as parts of one type each."""


@pytest.fixture(scope="module")
def tiny_256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", hidden_size=256, intermediate_size=512,
                            num_heads=4, num_kv_heads=2, seed=7)


@pytest.mark.parametrize("mix", list(MIXES))
def test_a_gguf_model_gives_the_same_logits_packed_in_c_as_in_numpy(mix: str, tiny_256: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TICKLOOM_CACHE", str(tmp_path / "cache"))
    path = write_k_gguf(tiny_256, tmp_path / f"tiny-{mix}.gguf", MIXES[mix], default="Q4_K")
    packed: list[str] = []
    real = gguf_pack.pack_gguf

    def counting(parts: list[tuple[str, np.ndarray]]) -> torch.Tensor:
        packed.extend(kind for kind, _ in parts)
        return real(parts)

    monkeypatch.setattr(gguf_pack, "pack_gguf", counting)
    fast = load_model(path, quant="int4")
    assert set(packed) == {k for k in MIXES[mix].values() if k != "Q6_K"} - ({"Q4_0"} if mix == "joined" else set())
    monkeypatch.setattr(gguf_pack, "enabled", lambda: False)
    slow = load_model(path, quant="int4")
    ids = [3, 17, 99, 250, 4, 61, 7]
    with torch.inference_mode():
        a, b = all_logits(fast, ids), all_logits(slow, ids)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b)


def _thp_eligible(address: int) -> bool | None:
    """``THPeligible`` of the mapping holding ``address`` (``/proc/self/smaps``), None where it is not shown."""
    inside = False
    with open("/proc/self/smaps", encoding="utf-8") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and ":" not in head[0]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("THPeligible:"):
                return head[1] == "1"
    return None


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
                    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
                    reason="no transparent huge pages here")
def test_the_tiles_buffers_may_take_huge_pages() -> None:
    """Tiles are streamed once a step: their buffers are asked for transparent huge pages (numpy's allocation does
    ask; under THP "madvise" torch's does not), and so are the tiles ``pack_gguf`` and the head make."""
    from tickloom.engine.model import packing

    buf = packing.tile_buffer(64, 1 << 20)
    assert _thp_eligible(buf.data_ptr() + buf.numel() // 2)  # the middle: the aligned part is a mapping of its own
    tiles = gguf_pack.pack_gguf([("Q4_0", gguf_blocks("Q4_0", 1024, 8192, seed=1))])  # 5 MB of tiles
    assert _thp_eligible(tiles.data_ptr() + tiles.numel() // 2)
