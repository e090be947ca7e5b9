"""``tickloom bench model``: this runner's decode/prefill throughput against transformers ``generate``, or with
``--against llama.cpp`` against llama-cpp-python on the same GGUF.

Both run in one process, on the same prompts, with ``torch.set_num_threads(1)`` (``--threads`` takes a list;
against llama.cpp the default is 1 and 2, and 128 new tokens instead of 32). Greedy decoding; eos never stops
either side. ``--settings`` lists the weight settings to run (``dtype+quant``: ``float32+none``, ``bfloat16+none``,
``bfloat16+int8``, ``bfloat16+int4``; ``default`` is the model's own).

With llama.cpp, runs alternate (ours, theirs, ours, ...), the median of ``--repeat`` counts, and each batch-1 row
shows the physical limit: the weight bytes one token reads (every projection and the LM head; not the few
embedding rows, nor the KV cache, a few MiB at these lengths) over the memory bandwidth measured with the same
thread count (a large torch reduction: reading is what a decode step does to its weights), and the fraction of it
reached. A child process per setting measures resident memory (the model loaded, a 4096-token KV cache) and the
warm load time (from before the first tickloom import, torch already imported, to a model and cache in hand).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tickloom.engine.core.blocks import blocks_holding
from tickloom.engine.model.convert import float32_checkpoint
from tickloom.engine.model.executor import ModelExecutor
from tickloom.engine.model.loaders import LoadedModel, load_model
from tickloom.engine.model.tables import step_of
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.events import SamplingSpec
from tickloom.events.commands import BindRequest
from tickloom.tools.cli import CliError
from tickloom.tools.progress import progress_note


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["tiny-bench", "smollm2-135m"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=None, help="default: 32; 128 against llama.cpp")
    p.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1; 1 and 2 against llama.cpp")
    p.add_argument("--settings", nargs="+", default=["default"], help="dtype+quant settings (default: the model's)")
    p.add_argument("--against", choices=["transformers", "llama.cpp"], default="transformers")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=2, help="runs per measurement; the fastest counts")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--gguf", nargs="+", default=None, metavar="FILE",
                   help="instead of --models: GGUF files, or test files SOURCE:TYPE (bundled:Q4_K_M, random-1b:Q4_0; "
                        "made once by llama.cpp's quantizer: bench/gguf_files)")
    p.add_argument("--accuracy", action="store_true",
                   help="instead: top-1 agreement and KL against the float32 model of the same file (bench/accuracy)")
    p.add_argument("--accuracy-prompts", type=int, default=200, metavar="N",
                   help="with --accuracy: chat prompts of 48 tokens each (1-320; default 200)")


def _model_dir(name: str, tmp: Path) -> Path:
    """A float32 Hugging Face-format directory of the model, for transformers (a GGUF's, dequantized into ``tmp``:
    the cache keeps only its config and tokenizer)."""
    if name == "tiny-bench":
        return write_tiny_model(tmp / "tiny-bench", "tiny-bench", seed=0)
    return float32_checkpoint(name, tmp / "float32")


def _ours(lm: LoadedModel, prompts: list[list[int]], new_tokens: int, block_size: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds for new_tokens - 1 steps) for one batch."""
    b, plen = len(prompts), len(prompts[0])
    per_req = blocks_holding(plen + new_tokens, block_size)
    ex = ModelExecutor(lm.model, num_blocks=b * per_req + 1, block_size=block_size)
    spec = SamplingSpec(temperature=0.0)
    rids = [f"r{i}" for i in range(b)]
    tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(b)]
    for rid in rids:
        ex.bind(BindRequest(rid, spec, 0, plen, []))
    t0 = time.perf_counter()
    res = ex.run_step(step_of(
        rids,
        [0] * b,
        [plen] * b,
        [t for p in prompts for t in p],
        [0] * b,
        [0] * b,
        [per_req] * b,
        [x for t in tables for x in t],
    ))
    t1 = time.perf_counter()
    last = res.token_ids
    for k in range(1, new_tokens):
        res = ex.run_step(step_of(rids, [plen + k - 1] * b, [1] * b, last, [k] * b, [per_req] * b, [0] * b, []))
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
    if args.gguf:
        from tickloom.tools.bench.gguf_files import resolve

        try:
            args.models = [str(resolve(spec)) for spec in args.gguf]
        except ValueError as exc:
            raise CliError(str(exc)) from None
    if args.accuracy:
        from tickloom.tools.bench import accuracy

        return accuracy.run(args)
    if args.against == "llama.cpp":
        return run_llamacpp(args)
    args.new_tokens = args.new_tokens or 32
    torch.set_num_threads((args.threads or [1])[0])
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
                progress_note(f"{name}, batch {b}")
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


def memory_bandwidth(nbytes: int = 256 << 20, repeat: int = 5) -> float:
    """Bytes per second read by a reduction over a large tensor (far larger than any cache), the best of
    ``repeat``, with torch's current thread count."""
    src = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


_FOOTPRINT = """
import json, sys, time, torch
torch.set_num_threads(1)
t = time.perf_counter()
from tickloom.engine.model.loaders import load_model
d, q = sys.argv[2].split("+") if sys.argv[2] != "default" else (None, None)
lm = load_model(sys.argv[1], dtype=d, quant=q)
kv = lm.model.new_kv_cache(4096 // 16, 16)
load = time.perf_counter() - t
rss = int(open("/proc/self/statm").read().split()[1]) * 4096
print(json.dumps({"load_s": load, "rss": rss, "setting": f"{lm.model.dtype}+{lm.model.quant}"}))
"""


def footprint(model: str, setting: str) -> dict[str, Any]:
    """Load time (imports included) and RSS with the model and a 4096-token KV cache, in a fresh process."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FOOTPRINT, model, setting], capture_output=True, text=True,
                         check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def run_llamacpp(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every setting of every GGUF-backed model against llama.cpp, threads x batch, alternating runs."""
    from tickloom.engine.model.registry import DEFAULT_MODEL, smollm2_gguf_path
    from tickloom.tools.bench import llamacpp as bench_llamacpp

    new_tokens = args.new_tokens or 128
    thread_counts = args.threads or [1, 2]
    have = bench_llamacpp.available()
    if not have:
        print(f"llama.cpp: llama_cpp is not importable; to compare, {bench_llamacpp.INSTALL_HINT}", flush=True)
    bw = {}
    for threads in thread_counts:
        torch.set_num_threads(threads)
        bw[threads] = memory_bandwidth()
    print("memory bandwidth (torch read): " + ", ".join(f"{t} thread{'s' if t > 1 else ''} {b / 1e9:.1f} GB/s"
                                                       for t, b in bw.items()), flush=True)
    rows: list[dict[str, Any]] = []
    for name in args.models:
        gguf = smollm2_gguf_path() if name == DEFAULT_MODEL else (Path(name) if name.endswith(".gguf") else None)
        if gguf is None:
            print(f"{name}: not a GGUF model, skipped (llama.cpp runs GGUF files)", flush=True)
            continue
        theirs, note = bench_llamacpp.runner_for(gguf) if have else (None, None)
        if note:
            print(note, flush=True)
        if theirs is not None:
            fp = bench_llamacpp.footprint(gguf, extra_buffers=theirs.extra_buffers)
            print(f"llama.cpp: RSS {fp['rss'] / 2**20:.0f} MiB, load {fp['load_s']:.2f} s", flush=True)
        for setting in args.settings:
            d, q = setting.split("+") if setting != "default" else (None, None)
            lm = load_model(name, dtype=d, quant=q)  # first, so that the footprint's load is not a file's first
            fp = footprint(name, setting)  # (a new GGUF's first load also fingerprints its weights, once)
            wbytes = lm.model.weight_bytes()
            print(f"{name} {fp['setting']}: RSS {fp['rss'] / 2**20:.0f} MiB, load {fp['load_s']:.2f} s, "
                  f"weights read per token {wbytes / 2**20:.0f} MiB", flush=True)
            rng = random.Random(0)
            vocab = min(lm.config.vocab_size, lm.tokenizer.vocab_size)
            for threads in thread_counts:
                torch.set_num_threads(threads)
                for b in args.batch_sizes:
                    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(b)]
                    _ours(lm, prompts[:1], 3, args.block_size)  # warm-up
                    if theirs is not None:
                        theirs.decode(prompts[:1], 3, threads)
                    ours_t, theirs_t = [], []
                    for _ in range(args.repeat):
                        ours_t.append(_ours(lm, prompts, new_tokens, args.block_size)[1])
                        if theirs is not None:
                            theirs_t.append(theirs.decode(prompts, new_tokens, threads)[1])
                    row: dict[str, Any] = {"model": name, "setting": fp["setting"], "threads": threads, "batch": b,
                                           "decode_tok_s": b * (new_tokens - 1) / _median(ours_t),
                                           "rss": fp["rss"], "load_s": fp["load_s"]}
                    if b == 1:
                        row["limit_tok_s"] = bw[threads] / wbytes
                    if theirs_t:
                        row["llamacpp_tok_s"] = b * (new_tokens - 1) / _median(theirs_t)
                        row["ratio"] = row["decode_tok_s"] / row["llamacpp_tok_s"]
                    rows.append(row)
                    _print_llamacpp_row(row)
    return rows


def _print_llamacpp_row(row: dict[str, Any]) -> None:
    parts = [f"{row['setting']:>16} t={row['threads']} b={row['batch']:<3} decode {row['decode_tok_s']:8.1f} tok/s"]
    if "llamacpp_tok_s" in row:
        parts.append(f"| llama.cpp {row['llamacpp_tok_s']:8.1f} | x{row['ratio']:.2f}")
    if "limit_tok_s" in row:
        parts.append(f"| batch-1 limit {row['limit_tok_s']:7.1f} ({row['decode_tok_s'] / row['limit_tok_s']:.0%})")
    print("  ".join(parts), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
