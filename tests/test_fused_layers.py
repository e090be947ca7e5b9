"""The decoder layers in one kernel call (``engine/model/fused.py``, ``cpu_kernels_layers.h``): the loop's logits
and cache to the bit for every projection kind, mixed steps and split projections; the loop kept for what it does
not take; each token's attention table."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from arch_gguf import write_gguf
from test_model_gguf_sources import write_k_gguf

from tickloom.engine.model import native
from tickloom.engine.model.batch import RowSpec, build_step_batch
from tickloom.engine.model.fused import FusedLayers, _kind, _proj, token_tables
from tickloom.engine.model.llama import LlamaModel
from tickloom.engine.model.loaders import load_model
from tickloom.engine.model.quant import Int4Linear
from tickloom.engine.model.quant_grouped import GroupedInt8Linear, HalfLinear, SplitLinear
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.engine.model.tp import AllReduced, shard_model

pytestmark = pytest.mark.skipif(not native.available(), reason=f"tickloom's CPU kernels: {native.status()}")

FILES: dict[str, tuple[Mapping[str, str], str]] = {
    "Q4_0": ({}, "Q4_0"),
    "Q4_1": ({}, "Q4_1"),
    "Q5_0": ({}, "Q5_0"),
    "Q5_1": ({}, "Q5_1"),
    "Q8_0": ({}, "Q8_0"),
    "Q4_K_M": ({"attn_v.weight": "Q6_K", "ffn_down.weight": "Q5_K"}, "Q4_K"),  # q/k/v in two parts
    "Q6_K": ({}, "Q6_K"),
    "three parts": ({"attn_k.weight": "Q8_0", "attn_v.weight": "Q5_1", "ffn_up.weight": "Q8_0"}, "Q4_0"),
}


@pytest.fixture(scope="module")
def tiny_256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", hidden_size=256, intermediate_size=512,
                            num_heads=4, num_kv_heads=2, seed=11)


def _steps(model: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of five steps and the cache after them: two prompts; a step mixing a prompt chunk between two decode
    rows (their tokens not adjacent); two rows decoding; one row alone; a chunk continuing a cached prompt."""
    gqa = model.cfg.num_heads // model.cfg.num_kv_heads
    kv = model.new_kv_cache(32, 16)

    def step(rows: list[RowSpec], tokens: list[int]) -> torch.Tensor:
        return model.forward(build_step_batch(rows, tokens, 16, gqa, model.device), kv)

    a, b, c = [0, 1, 2], [3], [4, 5]
    out = [step([RowSpec(0, 20, a, True), RowSpec(0, 5, b, True)], list(range(40, 65)))]
    out.append(step([RowSpec(20, 1, a, True), RowSpec(0, 7, c, True), RowSpec(5, 1, b, True)],
                    [7, *range(70, 77), 9]))
    out.append(step([RowSpec(21, 1, a, True), RowSpec(6, 1, b, True)], [11, 12]))
    out.append(step([RowSpec(22, 1, a, True)], [13]))
    out.append(step([RowSpec(7, 12, c, True)], list(range(80, 92))))
    return out, [t.clone() for t in kv.kv]


def _assert_fused_is_the_loop(model: Any) -> None:
    fused = model._fused
    assert fused is not None
    got, got_kv = _steps(model)
    model._fused = None
    want, want_kv = _steps(model)
    model._fused = fused
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {i}: logits differ by {(g - w).abs().max().item()}"
    assert all(torch.equal(g, w) for g, w in zip(got_kv, want_kv, strict=True))


@pytest.mark.parametrize("name", FILES)
def test_fused_layers_are_the_loop_to_the_bit(name: str, tiny_256: Path, tmp_path: Path) -> None:
    types, default = FILES[name]
    lm = load_model(write_k_gguf(tiny_256, tmp_path / "m.gguf", dict(types), default=default), quant="int4")
    _assert_fused_is_the_loop(lm.model)
    if name == "three parts":
        assert len(lm.model.layers[0].qkv.parts) == 3


@pytest.mark.parametrize("half", ("F16", "BF16"))
def test_a_16_bit_file_as_a_float32_model_fuses_to_the_bit(half: str, tiny_256: Path, tmp_path: Path) -> None:
    lm = load_model(write_k_gguf(tiny_256, tmp_path / "m.gguf", {}, default=half), dtype="float32", quant="none")
    assert lm.model.dtype == torch.float32
    _assert_fused_is_the_loop(lm.model)


@pytest.mark.skipif(native._load()[0] is None or native._kernel().bf16_matmul is None,
                    reason="bfloat16 pair products: the AVX512 build's")
def test_a_bfloat16_model_fuses_to_the_bit(tiny_256: Path) -> None:
    lm = load_model(tiny_256, dtype="bfloat16", quant="none")
    assert isinstance(lm.model.layers[0].qkv, HalfLinear)
    _assert_fused_is_the_loop(lm.model)


@pytest.fixture(scope="module")
def avx2_kernel(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The AVX2 build, compiled beside the running one (this CPU runs AVX2 code whichever build it loaded)."""
    build = next(b for b in native._BUILDS if b.name == "avx2")
    if not build.cpu_flags or not all(f in (native._cpu_flags() or set()) for f in build.cpu_flags):
        pytest.skip("this CPU lacks AVX2")
    out = tmp_path_factory.mktemp("avx2") / "avx2.so"
    subprocess.run([shutil.which("cc") or "cc", *build.flags, "-o", str(out), str(build.source)], check=True,
                   capture_output=True, text=True)
    return native._Kernel(ctypes.CDLL(str(out)), "avx2")


@pytest.mark.parametrize("name", ("Q8_0", "Q4_K_M", "three parts"))
def test_the_avx2_build_fuses_to_the_bit(name: str, avx2_kernel: Any, tiny_256: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_load", lambda: (avx2_kernel, "ready"))
    types, default = FILES[name]
    lm = load_model(write_k_gguf(tiny_256, tmp_path / "m.gguf", dict(types), default=default), quant="int4")
    assert native.variant() == "avx2"
    _assert_fused_is_the_loop(lm.model)


def test_the_loop_stays_for_what_the_kernels_do_not_take(tiny_256: Path, tmp_path: Path) -> None:
    dense = load_model(tiny_256, dtype="float32", quant="none").model  # float32 weights: torch's matmul
    assert dense._native and dense._fused is None
    lm = load_model(write_k_gguf(tiny_256, tmp_path / "m.gguf", {}, default="Q4_0"), quant="int4")
    model = lm.model
    assert model._fused is not None
    layer = model.layers[0]
    assert _kind(layer.wo, torch.bfloat16, True) == 4
    with_bias = Int4Linear.from_float(torch.randn(32, 256), 32, bias=torch.zeros(32))
    assert _kind(layer.wo, torch.float32, True) is None  # 4-bit tiles take bfloat16 activations only
    offsets = GroupedInt8Linear.__new__(GroupedInt8Linear)
    offsets.bias, offsets.out_features, offsets.tiles, offsets.z = None, 32, torch.zeros(1), torch.zeros(1)
    assert _kind(offsets, torch.bfloat16, True) is None
    bf16 = HalfLinear("BF16", torch.zeros(16, 32, dtype=torch.bfloat16).view(torch.int16).numpy().view("uint16"),
                      None)
    assert _kind(bf16, torch.bfloat16, True) == 18 and _kind(bf16, torch.bfloat16, False) is None
    assert _kind(bf16, torch.float32, False) == 16
    split = SplitLinear([layer.wo, layer.wo], None)
    assert _proj(split, torch.bfloat16, True, True, []) is not None
    assert _proj(split, torch.bfloat16, True, False, []) is None  # o, down: the loop adds rounded parts
    assert _proj(SplitLinear([layer.wo] * 4, None), torch.bfloat16, True, True, []) is None
    assert _proj(with_bias, torch.bfloat16, True, True, []) is not None  # q/k/v: Qwen2's
    assert _proj(with_bias, torch.bfloat16, True, False, []) is None  # o, down: their rounded output, again
    model._native = False
    assert FusedLayers.build(model) is None


def test_each_token_gets_its_rows_table_and_length() -> None:
    rows = [RowSpec(20, 1, [5, 6], True), RowSpec(0, 3, [9], True), RowSpec(4, 1, [7], True)]
    batch = build_step_batch(rows, [1, 2, 3, 4, 5], 16, 2, torch.device("cpu"))
    tables, lengths = token_tables(batch, 5)
    # a decode group pads short tables with their first block, a prompt's are padded here with block 0: read by no
    # row, which stops at its length
    assert tables.tolist() == [[5, 6], [9, 0], [9, 0], [9, 0], [7, 7]]
    assert lengths.tolist() == [21, 1, 2, 3, 5]
    decode = build_step_batch([RowSpec(3, 1, [1], True), RowSpec(30, 1, [2, 3], True)], [1, 2], 16, 2,
                              torch.device("cpu"))
    tables, lengths = token_tables(decode, 2)
    assert tables.tolist() == [[1, 1], [2, 3]] and lengths.tolist() == [4, 31]  # the group's own tensors


def test_a_length_past_the_table_is_refused(tiny_256: Path, tmp_path: Path) -> None:
    model = load_model(write_k_gguf(tiny_256, tmp_path / "m.gguf", {}, default="Q4_0"), quant="int4").model
    batch = build_step_batch([RowSpec(3, 1, [0], True)], [1], 16, 2, torch.device("cpu"))
    assert batch.groups[0].lengths is not None
    batch.groups[0].lengths.fill_(17)  # one block of 16 holds no 17th position
    with pytest.raises(ValueError, match="run_layers: a kernel refused the step"):
        model.forward(batch, model.new_kv_cache(4, 16))


def test_a_tensor_parallel_rank_keeps_the_loop_for_its_all_reduces(tiny_256: Path, tmp_path: Path) -> None:
    """``tp.py`` wraps o and down after the model is built; a fused call would go around the all-reduce."""
    seen: dict[str, Any] = {}

    def build(cfg: Any, tensors: Mapping[str, Any], dtype: torch.dtype, device: torch.device, quant: str) -> Any:
        seen.update(cfg=cfg, tensors=dict(tensors), dtype=dtype, device=device)
        return LlamaModel(cfg, tensors, dtype, device, quant)

    alone = load_model(write_k_gguf(tiny_256, tmp_path / "m.gguf", {}, default="Q4_0"), quant="int4", build=build)
    assert alone.model._fused is not None
    rank = shard_model(seen["cfg"], seen["tensors"], seen["dtype"], seen["device"], "int4", rank=0, world=2)
    assert isinstance(rank.layers[0].wo, AllReduced)
    assert rank._native and rank._fused is None
    one = shard_model(seen["cfg"], seen["tensors"], seen["dtype"], seen["device"], "int4", rank=0, world=1)
    assert one._fused is not None  # one rank: nothing wrapped


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2: Llama's layer with biases on q, k and v."""
    return write_tiny_model(tmp_path_factory.mktemp("qwen2") / "qwen2", architecture="qwen2", hidden_size=256,
                            intermediate_size=512, num_heads=4, num_kv_heads=2, seed=13)


@pytest.mark.parametrize(("quant", "dtype", "form"), [("int4", "bfloat16", Int4Linear),  # bias on the rounded out
                                                      ("none", "bfloat16", HalfLinear),  # on the float32 sums
                                                      ("none", "float32", HalfLinear)])
def test_q_k_v_biases_fuse_to_the_bit(quant: str, dtype: str, form: type, qwen2: Path, tmp_path: Path) -> None:
    if dtype == "float32":  # a float32 model takes 16-bit weights on the kernels: an F16 file's
        source: Path = write_gguf(qwen2, "qwen2", tmp_path / "q.gguf", half="F16")
    else:
        source = qwen2
    if form is HalfLinear and dtype == "bfloat16" and native._kernel().bf16_matmul is None:
        pytest.skip("bfloat16 pair products: the AVX512 build's")
    model = load_model(source, dtype=dtype, quant=quant).model
    assert isinstance(model.layers[0].qkv, form) and model.layers[0].qkv.bias is not None
    _assert_fused_is_the_loop(model)


def test_a_q8_file_with_biases_fuses_to_the_bit(qwen2: Path, tmp_path: Path) -> None:
    model = load_model(write_gguf(qwen2, "qwen2", tmp_path / "q8.gguf", q8=True), quant="int4").model
    assert isinstance(model.layers[0].qkv, GroupedInt8Linear) and model.layers[0].qkv.bias is not None
    _assert_fused_is_the_loop(model)


def test_a_split_projections_bias_fuses_to_the_bit(qwen2: Path) -> None:
    """A split q/k/v adds its bias, rounded to bfloat16, to the joined rounded outputs."""
    model = load_model(qwen2, quant="int4").model
    q_rows = model.cfg.q_size
    for layer in model.layers:
        w, bias = layer.qkv.dequantize(), layer.qkv.bias
        layer.qkv = SplitLinear([Int4Linear.from_float(w[:q_rows], 32), Int4Linear.from_float(w[q_rows:], 32)],
                                bias.float() + 1e-3)  # not a bfloat16 value: its rounding shows
    model.layers_changed()
    _assert_fused_is_the_loop(model)


def test_a_cache_run_layers_cannot_walk_is_refused(tiny_256: Path, tmp_path: Path) -> None:
    """``run_layers`` finds layer ``n`` at ``n`` layers past the first: a cache laid out otherwise is refused, not
    read out of bounds."""
    model = load_model(write_k_gguf(tiny_256, tmp_path / "m.gguf", {}, default="Q4_0"), quant="int4").model
    kv = model.new_kv_cache(4, 16)
    kv.kv = [kv.kv[0], *(t.clone() for t in kv.kv[1:])]  # the second layer elsewhere than after the first
    batch = build_step_batch([RowSpec(0, 1, [0], True)], [1], 16, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="layers one after another"):
        model.forward(batch, kv)
