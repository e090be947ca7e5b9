"""``tickloom bench model``: this runner's decode/prefill throughput against transformers ``generate``.

Both run in one process, on the same prompts and weights, with ``torch.set_num_threads(1)`` (unless
``--threads`` says otherwise). Greedy decoding; eos never stops either side.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.model.executor import ModelExecutor
from engine.model.loaders import LoadedModel, load_model
from engine.model.registry import resolve_model
from engine.model.tiny import write_tiny_model


class _Greedy:
    temperature = 0.0
    top_k = 0
    top_p = 1.0
    min_p = 0.0
    repetition_penalty = 1.0
    presence_penalty = 0.0
    frequency_penalty = 0.0
    min_tokens = 0
    logprobs = False
    top_logprobs = 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["tiny-bench", "smollm2-135m"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=2, help="runs per measurement; the fastest counts")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")


def _model_dir(name: str, tmp: Path) -> Path:
    if name == "tiny-bench":
        return write_tiny_model(tmp / "tiny-bench", "tiny-bench", seed=0)
    return resolve_model(name)


def _ours(lm: LoadedModel, prompts: list[list[int]], new_tokens: int, block_size: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds for new_tokens - 1 steps) for one batch."""
    b, plen = len(prompts), len(prompts[0])
    per_req = -(-(plen + new_tokens) // block_size)
    ex = ModelExecutor(lm.model, num_blocks=b * per_req + 1, block_size=block_size)
    spec = _Greedy()
    rids = [f"r{i}" for i in range(b)]
    tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(b)]
    for rid in rids:
        ex.bind(rid, spec, 0, plen, [])
    t0 = time.perf_counter()
    res = ex.run_step(
        rids,
        [0] * b,
        [plen] * b,
        [t for p in prompts for t in p],
        [0] * b,
        [0] * b,
        [per_req] * b,
        [x for t in tables for x in t],
    )
    t1 = time.perf_counter()
    last = res.token_ids
    for k in range(1, new_tokens):
        res = ex.run_step(rids, [plen + k - 1] * b, [1] * b, last, [k] * b, [per_req] * b, [0] * b, [])
        last = res.token_ids
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def _hf(ref: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    kw: dict[str, Any] = {"do_sample": False, "pad_token_id": 0, "attention_mask": mask}
    with torch.no_grad():
        t0 = time.perf_counter()
        ref.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        ref.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        t2 = time.perf_counter()
    return t1 - t0, max((t2 - t1) - (t1 - t0), 1e-9)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            d = _model_dir(name, Path(tmp))
            lm = load_model(d, dtype="float32")
            ref = None
            if not args.no_hf:
                import transformers

                ref = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
                ref.train(False)
            rng = random.Random(0)
            vocab = min(lm.config.vocab_size, lm.tokenizer.vocab_size)
            for b in args.batch_sizes:
                prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(b)]
                _ours(lm, prompts[:1], 3, args.block_size)  # warm-up
                runs = [_ours(lm, prompts, args.new_tokens, args.block_size) for _ in range(args.repeat)]
                pre, dec = min(r[0] for r in runs), min(r[1] for r in runs)
                row: dict[str, Any] = {
                    "model": name,
                    "batch": b,
                    "prefill_tok_s": b * args.prompt_len / pre,
                    "decode_tok_s": b * (args.new_tokens - 1) / dec,
                }
                if ref is not None:
                    _hf(ref, prompts[:1], 2)  # warm-up
                    hruns = [_hf(ref, prompts, args.new_tokens) for _ in range(args.repeat)]
                    hpre, hdec = min(r[0] for r in hruns), min(r[1] for r in hruns)
                    row["hf_prefill_tok_s"] = b * args.prompt_len / hpre
                    row["hf_decode_tok_s"] = b * (args.new_tokens - 1) / hdec
                    row["decode_speedup"] = row["decode_tok_s"] / row["hf_decode_tok_s"]
                rows.append(row)
                _print_row(row)
    return rows


def _print_row(row: dict[str, Any]) -> None:
    parts = [f"{row['model']:>14} b={row['batch']:<3}"]
    parts.append(f"prefill {row['prefill_tok_s']:9.1f} tok/s")
    parts.append(f"decode {row['decode_tok_s']:8.1f} tok/s")
    if "hf_decode_tok_s" in row:
        parts.append(f"| hf prefill {row['hf_prefill_tok_s']:9.1f} decode {row['hf_decode_tok_s']:8.1f}")
        parts.append(f"| decode x{row['decode_speedup']:.2f}")
    print("  ".join(parts), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
