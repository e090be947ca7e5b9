"""The forward's fast paths against their plain definitions: the lazily committed KV pool, RMSNorm through
layer_norm, rope through roll, the fbgemm LM head, numpy int4 packing, the mapped Q8_0 embedding; and a quantized
engine run that ``replay --full`` finds identical."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch

from tickloom.engine.model import int4pack
from tickloom.engine.model.embedding import Embedding
from tickloom.engine.model.file_pages import drop_file_pages
from tickloom.engine.model.head import DynInt8Linear, fbgemm_available, int8_rows
from tickloom.engine.model.kv_cache import PagedKVCache, zeroed_pool
from tickloom.engine.model.llama import apply_rope, norm_weight2, rms_norm, rope_tables
from tickloom.engine.model.quant import (
    RawBlocks,
    gguf_q8_0,
)

torch.set_num_threads(1)


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * mmap.PAGESIZE


def test_kv_pool_starts_zeroed_writable_and_uncommitted() -> None:
    before = _rss()
    pool, mapping = zeroed_pool(64 << 20, torch.bfloat16, torch.device("cpu"))  # 128 MiB
    assert mapping is not None and pool.numel() == 64 << 20 and pool.dtype == torch.bfloat16
    assert _rss() - before < 16 << 20  # not touched, so not resident
    assert not bool(pool[::4096].any())
    pool[12345] = 3.5
    pool[-1] = -1.0
    assert float(pool[12345]) == 3.5 and float(pool[-1]) == -1.0
    empty, none = zeroed_pool(0, torch.float32, torch.device("cpu"))
    assert empty.numel() == 0 and none is None


def test_paged_cache_writes_gathers_and_copies_in_the_host_layout() -> None:
    kv = PagedKVCache(2, 6, 4, 2, 8, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    new = torch.randn(5, 4, 8, generator=g)  # 5 tokens x (2 K heads, 2 V heads) x dim
    slots = torch.tensor([0, 1, 5, 22, 23])
    kv.write(1, slots, new)
    flat_k = kv.k[1].reshape(-1, 2, 8)  # the host view: blocks x block x heads x dim
    assert torch.equal(flat_k[slots], new[:, :2]) and torch.equal(kv.v[1].reshape(-1, 2, 8)[slots], new[:, 2:])
    k, v = kv.gather(1, torch.tensor([5, 0]))
    assert k.shape == (2, 2, 4, 8) and k.is_contiguous() and v.is_contiguous()
    assert torch.equal(k[:, 0, 2], new[3, :2]) and torch.equal(v[:, 1, 1], new[1, 2:])
    out_k, out_v = kv.copy_blocks_out([5, 0])
    assert out_k.shape == (2, 2, 4, 2, 8)
    assert torch.equal(out_k[1, 0, 2], new[3, :2]) and torch.equal(out_v[1, 1, 0], new[0, 2:])
    other = PagedKVCache(2, 6, 4, 2, 8, torch.float32, torch.device("cpu"))
    other.copy_blocks_in([3, 4], out_k, out_v)
    assert torch.equal(other.kv[1][:, 3], kv.kv[1][:, 5]) and torch.equal(other.kv[0][:, 4], kv.kv[0][:, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_through_layer_norm_is_rms_norm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(7, 96, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    xf = x.float()
    ref = w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5))
    got = rms_norm(x, norm_weight2(w), 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


def test_rope_by_roll_is_rotate_half() -> None:
    g = torch.Generator().manual_seed(2)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    cos, sin = rope_tables(inv, 40, torch.float32, torch.device("cpu"))
    pos = torch.tensor([0, 3, 39])
    x = torch.randn(3, 5, 16, generator=g)
    angles = pos[:, None].float() * inv.float()[None]
    c, s = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2 = x[..., :8], x[..., 8:]
    ref = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    got = apply_rope(x.clone(), cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


needs_fbgemm = pytest.mark.skipif(not fbgemm_available(), reason="torch has no fbgemm here")


def _resident_kib(path: Path) -> int:
    """This process's resident KiB of the mappings of ``path`` (``/proc/self/smaps``)."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="utf-8") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = head[-1] == str(path)
            elif inside and line.startswith("Rss:"):
                total += int(head[1])
    return total


def test_a_layers_file_pages_leave_the_resident_set_and_read_back_the_same(tmp_path: Path) -> None:
    """``drop_file_pages(view, whole=False)``, as a load calls it after each layer: the whole pages inside the view
    leave the resident set (the pages it only shares with its neighbours stay), the bytes read back unchanged; a
    view that is not one run of bytes, or not of a file mapping, is left alone."""
    data = np.random.default_rng(0).integers(0, 256, 64 * 4096, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    path.write_bytes(data.tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    view = mapped[4096 + 100 : 40 * 4096 + 50].reshape(-1, 2)
    assert int(mapped.sum()) == int(data.sum())  # every page read
    before = _resident_kib(path)
    assert before >= 64 * 4
    assert drop_file_pages(view, whole=False)
    after = _resident_kib(path)
    assert before - after == (40 - 2) * 4  # pages 2..39: the whole ones inside the view
    assert np.array_equal(np.asarray(view).ravel(), data[4096 + 100 : 40 * 4096 + 50])
    assert not drop_file_pages(mapped[::2], whole=False) and not drop_file_pages(np.zeros(8), whole=False)


@needs_fbgemm
def test_dyn_int8_head_matches_its_weight_and_ignores_the_batch() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 96, generator=g) * 0.05
    q, scales = int8_rows(w)
    lin = DynInt8Linear(q, scales)
    deq = q.float() * scales[:, None]
    x = torch.randn(9, 96, generator=g)
    x[:, 5] *= 20  # an outlier channel, as the head's input has: one 8-bit step per row would blur the rest
    ref = x @ deq.t()
    got = lin(x.bfloat16())
    assert got.dtype == torch.float32 and got.shape == (9, 200)
    # bfloat16 input rounding (~2^-9) dominates; the two 8-bit passes add ~1e-4
    assert float((got - ref).norm() / ref.norm()) < 3e-3
    assert float((lin(x) - ref).norm() / ref.norm()) < 5e-4
    alone = torch.cat([lin(x[i : i + 1]) for i in range(9)])
    assert torch.equal(alone, lin(x))  # per-row scales, int32 accumulation: no row depends on another
    biased = DynInt8Linear(q, scales, torch.arange(200.0))
    torch.testing.assert_close(biased(x) - lin(x), torch.arange(200.0).expand(9, 200), rtol=0, atol=1e-3)
    assert torch.equal(lin(torch.zeros(2, 96)), torch.zeros(2, 200))


@pytest.mark.parametrize("n", [128, 960, 48])
def test_numpy_int4_packing_is_torchs(n: int) -> None:
    rng = np.random.default_rng(n)
    qs = rng.integers(0, 256, (n, 4, 16), dtype=np.uint8)  # 4 GGUF blocks of 32 per row
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)
    want = int4pack._INT4_PACK(torch.from_numpy(q.astype(np.int32)), 2)
    assert torch.equal(int4pack.pack(q), want)
    assert torch.equal(int4pack.pack_nibbles(qs), want)  # 48 rows: not a multiple of the block, torch packs
    if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2"):
        assert int4pack.block_rows() in (64, 32)


def _q8_0_rows(n: int, blocks: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    d = (rng.random((n, blocks)) * 0.02 + 0.001).astype(np.float16)
    q = rng.integers(-127, 128, (n, blocks, 32), dtype=np.int8)
    return np.concatenate([d.view(np.uint8).reshape(n, blocks, 2), q.view(np.uint8)], axis=-1).reshape(n, -1)


def test_q8_0_embedding_reads_rows_from_the_file_mapping(tmp_path: Path) -> None:
    rows = _q8_0_rows(64, 3, seed=5)
    path = tmp_path / "emb.bin"
    path.write_bytes(b"\0" * 100 + rows.tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="r")[100:].reshape(64, -1)
    emb = Embedding(RawBlocks("Q8_0", mapped, (64, 96)), torch.bfloat16)
    assert emb.nbytes() == 0 and emb.table is None
    ids = torch.tensor([3, 63, 3, 0])
    d8, q8 = gguf_q8_0(rows)
    ref = torch.from_numpy((q8 * d8[..., None]).reshape(64, -1))[ids].bfloat16()
    assert torch.equal(emb(ids), ref)
    emb.release_pages()  # drops the pages read; the next lookup faults them back in from the file
    assert torch.equal(emb(ids), ref)
    assert drop_file_pages(mapped) and not drop_file_pages(np.zeros(8)) and not drop_file_pages(rows)


@needs_fbgemm
async def test_quantized_engine_run_replays_full(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A quantized run (int4 layers and an int8 head: on tickloom's CPU kernels where the CPU has them) re-run by
    ``replay --full`` gives the same tokens."""
    import trio

    from tickloom import Engine, EngineConfig, SamplingParams
    from tickloom.engine.model.tiny import write_tiny_model
    from tickloom.tools.cli import main

    d = write_tiny_model(tmp_path / "m", seed=4, hidden_size=128, intermediate_size=256)
    log = tmp_path / "q.tlog"
    config = EngineConfig(model=str(d), dtype="bfloat16", quant="int4", max_seq_len=64, num_blocks=64,
                          log_path=str(log), prefix_caching=False)
    async with Engine.open(config) as engine, trio.open_nursery() as nursery:
        for i in range(4):
            params = SamplingParams(max_tokens=8, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
            nursery.start_soon(engine.complete, [5 + i, 9, 11 + i, 7, 3], params)
    assert main(["replay", str(log), "--full"]) == 0
    out = capsys.readouterr().out
    assert "identical (full)" in out and " 0 failed steps" in out
