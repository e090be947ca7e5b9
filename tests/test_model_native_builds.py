"""Which build of tickloom's CPU kernels a CPU gets (``native.choose_build``), and that both sources compile to
the same functions wherever there is an x86-64 C compiler, whatever this CPU runs: the AVX512 source cannot run on
a CPU without AVX512, so compiling it is what CI can check of it there."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from tickloom.engine.model import native

AVX2 = {"avx", "avx2", "fma", "f16c", "sse4_2"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16"}
EXPORTS = ("q4_matmul", "q4_matmul_f32", "q4_scratch_bytes", "q8_matmul", "q8_scratch_bytes", "paged_decode_attention",
           "attn_scratch_floats", "add_rms_norm", "add_rms_norm_f32", "rope_and_store", "silu_mul")


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
