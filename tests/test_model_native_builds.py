"""Which build of tickloom's CPU kernels a CPU gets (``native.choose_build``), and that both sources compile to
the same functions wherever there is an x86-64 C compiler, whatever this CPU runs: the AVX512 source cannot run on
a CPU without AVX512, so compiling it is what CI can check of it there."""

from __future__ import annotations

import ctypes
import itertools
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from tickloom.engine.model import native, packing

AVX2 = {"avx", "avx2", "fma", "f16c", "sse4_2"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16"}
EXPORTS = ("int_matmul", "int_scratch_bytes", "q8_matmul", "q8_scratch_bytes", "paged_decode_attention",
           "attn_scratch_floats",
           "add_rms_norm", "add_rms_norm_f32", "rope_and_store", "silu_mul", "half_matmul",
           "paged_decode_attention_f32", "add_rms_norm_f32_out", "rope_and_store_f32", "silu_mul_f32",
           "run_layers", "layers_work_bytes")


def test_a_cpu_with_avx512_vnni_and_bf16_gets_the_avx512_build() -> None:
    build = native.choose_build(AVX512)
    assert build is not None and build.name == "avx512" and build.source.name == "cpu_kernels.c"


def test_avx512_without_vnni_or_bf16_gets_the_avx2_build() -> None:
    """Skylake-X has AVX512 F/BW/DQ/VL but neither VNNI nor BF16; AMD before Zen 4 has AVX2 alone."""
    for flags in (AVX512 - {"avx512_vnni"}, AVX512 - {"avx512_bf16"}, AVX2):
        build = native.choose_build(flags)
        assert build is not None and build.name == "avx2" and build.source.name == "cpu_kernels_avx2.c"


def test_no_build_without_avx2_fma_and_f16c() -> None:
    for missing in ("avx2", "fma", "f16c"):
        assert native.choose_build(AVX2 - {missing}) is None


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None,
                    reason="needs an x86-64 C compiler")
@pytest.mark.parametrize("name", ["avx512", "avx2"])
def test_each_source_compiles_and_exports_every_kernel(name: str, tmp_path: Path) -> None:
    build = next(b for b in native._BUILDS if b.name == name)
    out = tmp_path / f"{name}.so"
    subprocess.run(["cc", *build.flags, "-Wall", "-Werror", "-o", str(out), str(build.source)], check=True,
                   capture_output=True, text=True)
    lib = ctypes.CDLL(str(out))  # loading runs no AVX512 instruction, so this works on any x86-64 CPU
    assert all(hasattr(lib, fn) for fn in EXPORTS)


def _cpu_has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {f}" in flags for f in ("avx2", "fma", "f16c"))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None
                    or not _cpu_has_avx2() or not native.available(),
                    reason="needs an x86-64 C compiler, AVX2, and tickloom's kernels running")
def test_the_avx2_build_gives_the_running_builds_bits(tmp_path: Path) -> None:
    """Run the AVX2 build beside the one this CPU loaded (on an AVX512 CPU, the other source): the 4-, 5- and 6-bit
    matmuls give the same bits (exact integer sums, then the same float operations in the same order); the 16-bit
    one the same sums to float32 rounding; the 8-bit one the same bits (its lanes are reduced in another order)."""
    import numpy as np
    import torch

    build = next(b for b in native._BUILDS if b.name == "avx2")
    out = tmp_path / "avx2.so"
    subprocess.run(["cc", *build.flags, "-o", str(out), str(build.source)], check=True, capture_output=True, text=True)
    avx2 = native._Kernel(ctypes.CDLL(str(out)), "avx2")
    rng = np.random.default_rng(0)
    n, k, m = 48, 512, 5  # two of Q6_K's super-blocks of 256
    x = torch.randn(9, k)
    x[:, 3::37] *= 25.0  # a few groups far above the rest: the second pass takes those
    x = x.bfloat16()
    for bits in (4, 5, 6):
        q = rng.integers(0, 2**bits, (n, k), dtype=np.uint8)
        s = (rng.random((n, k // 32)) * 0.02).astype(np.float16).astype(np.float32)
        low = (q & 15).reshape(n, -1, 32)
        if bits == 6:  # Q6_K's int8 scale per 16 and float16 d per 256
            sc = rng.integers(-128, 128, (n, k // 16)).astype(np.int8)
            tiles = packing.pack_q6_tiles(q, sc, (rng.random((n, k // 256)) * 2e-4).astype(np.float32))
        else:
            tiles = (packing.pack_tiles(low[..., :16] | (low[..., 16:] << 4), s, -16 * s) if bits == 4
                     else packing.pack_wide_tiles(q, s, (-16 * s).astype(np.float32), bits))
        for rows, passes in itertools.product((1, 2, m, 9), (1, 2)):
            xs = x[:rows].contiguous()
            theirs = torch.empty(rows, n)
            scratch = torch.empty(avx2.int_scratch_bytes(rows, k, passes), dtype=torch.uint8)
            assert avx2.int_matmul(xs.data_ptr(), tiles.data_ptr(), theirs.data_ptr(), rows, n, k, scratch.data_ptr(),
                                   1, bits, passes, 1) == 0
            mine = native.matmul(xs, tiles, n, torch.float32, bits=bits, passes=passes)
            assert torch.equal(mine, theirs), (bits, rows, passes)
    q8 = rng.integers(-128, 128, (n, k), dtype=np.int8)  # -128 too: a byte GGUF's Q8_0 could hold
    tiles8 = packing.pack_q8_tiles(q8, (rng.random((n, k // 32)) * 0.02).astype(np.float32))
    for rows in (1, 2, m):
        xs = x[:rows].contiguous()
        theirs = torch.empty(rows, n)
        scratch = torch.empty(avx2.q8_scratch_bytes(rows, k), dtype=torch.uint8)
        assert avx2.q8_matmul(xs.data_ptr(), tiles8.data_ptr(), theirs.data_ptr(), rows, n, k, scratch.data_ptr(),
                              1) == 0
        assert torch.equal(native.q8_matmul(xs, tiles8, n), theirs), ("q8", rows)
    half = torch.randn(n, k).half()
    tiles16 = packing.pack_half_tiles(half.view(torch.int16).numpy().view(np.uint16))
    xf = torch.randn(m, k)
    theirs = torch.empty(m, n)
    assert avx2.half_matmul(xf.data_ptr(), tiles16.ctypes.data, theirs.data_ptr(), m, n, k, 1, 1) == 0
    torch.testing.assert_close(native.half_matmul(xf, tiles16, n, "F16"), theirs, atol=1e-5, rtol=1e-5)
