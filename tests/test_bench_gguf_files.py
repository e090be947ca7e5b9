"""The benchmarks' test GGUFs (tools/bench/gguf_files.py): what ``--gguf`` accepts, the random model's file (its
shape, its tokenizer and chat template, and that tickloom loads it), and llama.cpp's quantizer on it where the
``bench`` extra is installed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tickloom.engine.model.registry import smollm2_gguf_path
from tickloom.tools.bench import gguf_files
from tickloom.tools.cli import main

TINY = {"embedding_length": 64, "feed_forward_length": 128, "block_count": 2, "attention.head_count": 4,
        "attention.head_count_kv": 2}


def _bundled() -> Path:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("the bundled model's GGUF is not installed")
    return path


def test_resolve_takes_an_existing_path_as_it_is(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert gguf_files.resolve(str(f)) == f


def test_resolve_names_a_missing_file_and_the_sources() -> None:
    with pytest.raises(ValueError, match=r"'nope\.gguf': no such file.*bundled, random-1b"):
        gguf_files.resolve("nope.gguf")


def test_resolve_names_an_unknown_type() -> None:
    with pytest.raises(ValueError, match=r"type 'Q3_K' is not one of Q4_0.*BF16"):
        gguf_files.resolve("bundled:Q3_K")


def test_resolve_makes_nothing_for_a_cached_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TICKLOOM_CACHE", str(tmp_path))
    made = tmp_path / "bench-gguf" / "bundled-Q8_0.gguf"
    made.parent.mkdir()
    made.write_bytes(b"GGUF")
    assert gguf_files.resolve("bundled:Q8_0") == made


def test_cli_refuses_a_bad_gguf_with_its_name(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "model", "--against", "llama.cpp", "--gguf", "missing.gguf"])
    assert code != 0
    assert "missing.gguf" in capsys.readouterr().err


def test_random_model_has_the_shape_and_the_bundled_tokenizer(tmp_path: Path) -> None:
    import gguf

    bundled = _bundled()
    out = gguf_files.random_1b_f16(tmp_path, bundled, TINY, name="tiny")
    assert out.name == "tiny-F16.gguf" and not list(tmp_path.glob("*.part"))
    got, src = gguf.GGUFReader(out), gguf.GGUFReader(bundled)
    for key, value in TINY.items():
        assert int(got.fields[f"llama.{key}"].contents()) == value
    assert int(got.fields["llama.rope.dimension_count"].contents()) == 64 // 4  # the head size, as llama.cpp checks
    assert got.fields["tokenizer.chat_template"].contents() == src.fields["tokenizer.chat_template"].contents()
    assert got.fields["tokenizer.ggml.tokens"].contents() == src.fields["tokenizer.ggml.tokens"].contents()
    tensors = {t.name: t for t in got.tensors}
    assert len(tensors) == 2 + 9 * TINY["block_count"]
    assert tuple(tensors["blk.1.ffn_down.weight"].shape) == (128, 64)  # GGUF lists columns first
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert gguf_files.random_1b_f16(tmp_path, bundled, TINY, name="tiny") == out  # made once


def test_random_model_loads_and_decodes(tmp_path: Path) -> None:
    import torch

    from tickloom.engine.model.loaders import load_model
    from tickloom.tools.bench.accuracy import tickloom_greedy

    out = gguf_files.random_1b_f16(tmp_path, _bundled(), TINY, name="tiny")
    lm = load_model(out, dtype="float32", quant="none")
    assert (lm.config.hidden_size, lm.config.num_layers, lm.config.num_kv_heads) == (64, 2, 2)
    assert lm.tokenizer.chat_template is not None
    torch.manual_seed(0)
    tokens = tickloom_greedy(lm, [1, 2, 3], 4)
    assert len(tokens) == 4 and all(0 <= t < lm.config.vocab_size for t in tokens)


def test_llama_cpp_quantizes_the_random_model(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    import gguf

    src = gguf_files.random_1b_f16(tmp_path, _bundled(), TINY, name="tiny")
    out = tmp_path / "tiny-Q8_0.gguf"
    gguf_files.quantize(src, out, "Q8_0")
    assert not out.with_suffix(".part").exists()
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0


def test_a_failed_quantization_leaves_no_file(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    out = tmp_path / "bad-Q8_0.gguf"
    with pytest.raises(RuntimeError, match=r"quantizer failed on .*bad\.gguf -> Q8_0"):
        gguf_files.quantize(bad, out, "Q8_0")
    assert not out.exists() and not out.with_suffix(".part").exists()
