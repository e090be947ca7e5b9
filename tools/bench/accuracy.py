"""``tickloom bench model --accuracy``: how faithful each path is to the float32 model of the same file.

The reference is the float32 model of the GGUF (weights dequantized, float32 activations). It continues 20 chat
prompts (rendered with the model's chat template) greedily for 48 tokens. Each path is then fed prompt + that
continuation (teacher forcing), and at each of the 48 positions its logits are compared with the reference's:
top-1 agreement (its argmax equals the reference's) and KL(ref || path), both averaged over all positions. Each
path also decodes greedily on its own; "kept" is the mean number of tokens it produces before the first one that
differs from the reference's continuation.

Paths: tickloom's default setting for the model, float32 activations on the same int4 weights, and llama.cpp on the
same file (when ``llama_cpp``, the ``bench`` extra, is importable). The model's forward runs directly over a KV
cache, without the engine.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tickloom.engine.core.blocks import blocks_holding
from tickloom.engine.model.batch import RowSpec, build_step_batch
from tickloom.engine.model.loaders import LoadedModel, load_model
from tickloom.prompts import tokenize

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "What is 17 times 23?",
    "Give me three tips for sleeping better.",
    "Who wrote Pride and Prejudice?",
    "Translate 'good morning' into Spanish.",
    "What does a CPU do?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
    "How do I boil an egg?",
    "What is the difference between weather and climate?",
    "Write a short thank-you note to a teacher.",
    "What is a prime number?",
    "Suggest a name for a small bakery.",
    "How many legs does a spider have?",
    "What is the boiling point of water in Fahrenheit?",
    "Summarize the story of Cinderella in one sentence.",
    "What are the benefits of regular exercise?",
]
NEW_TOKENS = 48

Logits = Callable[[list[int]], torch.Tensor]
"""Token ids in, float32 logits out: one row per position (``len(ids) x vocab``)."""


# ---- metrics (pure; tests/test_bench_accuracy.py) ----

def top1_agreement(ref: torch.Tensor, other: torch.Tensor) -> float:
    """Fraction of positions (rows) where ``other``'s argmax is ``ref``'s."""
    return float((ref.argmax(-1) == other.argmax(-1)).float().mean())


def mean_kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(other)), in nats, computed in float64."""
    lp = torch.log_softmax(ref.double(), -1)
    lq = torch.log_softmax(other.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def tokens_kept(ref: list[int], other: list[int]) -> int:
    """How many tokens ``other`` has before it first differs from ``ref``."""
    n = 0
    for a, b in zip(ref, other, strict=False):
        if a != b:
            break
        n += 1
    return n


# ---- drivers ----

def tickloom_logits(lm: LoadedModel, block_size: int = 16) -> Logits:
    """All-position logits of one sequence, one prefill over a fresh KV cache."""
    model = lm.model

    def run(ids: list[int]) -> torch.Tensor:
        blocks = blocks_holding(len(ids), block_size)
        kv = model.new_kv_cache(blocks + 1, block_size)
        row = RowSpec(0, len(ids), list(range(blocks)), True, all_logits=True)
        batch = build_step_batch([row], ids, block_size, model.cfg.num_heads // model.cfg.num_kv_heads, model.device)
        return model.forward(batch, kv)

    return run


def tickloom_greedy(lm: LoadedModel, prompt: list[int], n: int, block_size: int = 16) -> list[int]:
    """``n`` greedy tokens after ``prompt``: a prefill, then one decode step per token over the same cache."""
    model = lm.model
    gqa = model.cfg.num_heads // model.cfg.num_kv_heads
    blocks = blocks_holding(len(prompt) + n, block_size)
    kv = model.new_kv_cache(blocks + 1, block_size)
    table = list(range(blocks))
    batch = build_step_batch([RowSpec(0, len(prompt), table, True)], prompt, block_size, gqa, model.device)
    out = [int(model.forward(batch, kv)[-1].argmax())]
    while len(out) < n:
        row = RowSpec(len(prompt) + len(out) - 1, 1, table, True)
        batch = build_step_batch([row], [out[-1]], block_size, gqa, model.device)
        out.append(int(model.forward(batch, kv)[-1].argmax()))
    return out


class LlamaCppLogits:
    """llama.cpp on the same GGUF: all-position logits of one sequence, and greedy decoding."""

    def __init__(self, gguf: Any, n_ctx: int = 1024) -> None:
        from tickloom.tools.bench.llamacpp import LlamaCppRunner

        self.runner = LlamaCppRunner(gguf)
        self.lc = self.runner.lc
        p = self.lc.llama_context_default_params()
        p.n_ctx = p.n_batch = p.n_ubatch = n_ctx
        p.n_threads = p.n_threads_batch = torch.get_num_threads()
        self.ctx = self.lc.llama_init_from_model(self.runner.model, p)
        self.batch = self.lc.llama_batch_init(n_ctx, 0, 1)

    def _decode(self, ids: list[int], start: int, all_logits: bool) -> torch.Tensor:
        b = self.batch
        for i, tok in enumerate(ids):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, start + i, 1
            b.seq_id[i][0] = 0
            b.logits[i] = all_logits or i == len(ids) - 1
        b.n_tokens = len(ids)
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        rows = range(len(ids)) if all_logits else [len(ids) - 1]
        nv = self.runner.n_vocab
        return torch.from_numpy(np.stack([
            np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(nv,)).copy() for i in rows]))

    def _clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def logits(self, ids: list[int]) -> torch.Tensor:
        self._clear()
        return self._decode(ids, 0, True)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        self._clear()
        out = [int(self._decode(prompt, 0, False)[-1].argmax())]
        while len(out) < n:
            out.append(int(self._decode([out[-1]], len(prompt) + len(out) - 1, False)[-1].argmax()))
        return out

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)


def score(ref_logits: list[torch.Tensor], ref_tokens: list[list[int]], logits: list[torch.Tensor],
          tokens: list[list[int]]) -> dict[str, float]:
    """The table's numbers for one path: each list holds one entry per prompt (``NEW_TOKENS`` positions)."""
    r, o = torch.cat(ref_logits), torch.cat(logits)
    kept = [tokens_kept(a, b) for a, b in zip(ref_tokens, tokens, strict=True)]
    return {"positions": r.shape[0], "top1": top1_agreement(r, o), "kl": mean_kl(r, o),
            "kept": sum(kept) / len(kept)}


def measure(model: str = "smollm2-135m", new_tokens: int = NEW_TOKENS,
            prompts: list[str] = PROMPTS) -> dict[str, Any]:
    """The reference's continuations, then every path's scores against them."""
    from tickloom.engine.model.loaders import DEFAULT_SETTING, _source_gguf, default_setting, gguf_is_quantized
    from tickloom.tools.bench import llamacpp as bench_llamacpp
    from tickloom.tools.progress import progress_note

    ref = load_model(model, dtype="float32", quant="none")
    ids = [tokenize(ref.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    progress_note(f"{model}: float32 reference, {len(ids)} prompts x {new_tokens} tokens")
    ref_tokens = [tickloom_greedy(ref, p, new_tokens) for p in ids]
    forced = [p + c for p, c in zip(ids, ref_tokens, strict=True)]

    def window(p: list[int], full: torch.Tensor) -> torch.Tensor:
        return full[len(p) - 1 : len(p) - 1 + new_tokens]  # the logits that predict the continuation's tokens

    ref_fwd = tickloom_logits(ref)
    ref_logits = [window(p, ref_fwd(f)) for p, f in zip(ids, forced, strict=True)]
    del ref, ref_fwd
    rows: dict[str, dict[str, float]] = {}
    notes: list[str] = []
    paths: list[tuple[str, dict[str, str]]] = []
    dt, q = default_setting(model, torch.device("cpu"))
    if q == "none" and dt in (None, "float32"):  # the default is the reference itself (a CPU without bfloat16)
        rows["tickloom default (float32+none) = reference"] = score(ref_logits, ref_tokens, ref_logits, ref_tokens)
    else:
        paths.append(("tickloom default", {}))
    source = _source_gguf(model)
    if (dt, q) != DEFAULT_SETTING and source is not None and gguf_is_quantized(source):
        # this CPU has no native bfloat16, so the default is float32; measure the setting a bfloat16 CPU gets too
        paths.append(("tickloom bf16-CPU default", {"dtype": DEFAULT_SETTING[0], "quant": DEFAULT_SETTING[1]}))
    if source is None or gguf_is_quantized(source):  # an F16/BF16 file's float32 activations are the reference
        paths.append(("tickloom float32 act + int4", {"dtype": "float32", "quant": "int4"}))
    for label, kw in paths:
        lm = load_model(model, **kw)
        name = f"{label} ({lm.model.dtype}+{lm.model.quant})".replace("torch.", "")
        progress_note(name)
        fwd = tickloom_logits(lm)
        rows[name] = score(ref_logits, ref_tokens, [window(p, fwd(f)) for p, f in zip(ids, forced, strict=True)],
                           [tickloom_greedy(lm, p, new_tokens) for p in ids])
    gguf = _source_gguf(model)
    if not bench_llamacpp.available():
        notes.append(f"llama.cpp skipped: llama_cpp is not importable ({bench_llamacpp.INSTALL_HINT})")
    elif gguf is None:
        notes.append(f"llama.cpp skipped: {model} has no GGUF file")
    else:
        progress_note("llama.cpp")
        lc = LlamaCppLogits(gguf)
        try:
            rows["llama.cpp"] = score(ref_logits, ref_tokens,
                                      [window(p, lc.logits(f)) for p, f in zip(ids, forced, strict=True)],
                                      [lc.greedy(p, new_tokens) for p in ids])
        finally:
            lc.close()
    return {"model": model, "gguf": str(gguf) if gguf else None, "prompts": len(ids), "new_tokens": new_tokens,
            "paths": rows, "notes": notes}


def print_table(result: dict[str, Any]) -> None:
    print(f"{result['model']}: {result['prompts']} chat prompts x {result['new_tokens']} tokens, against float32 "
          f"(teacher-forced; 'kept' is free-running greedy tokens before the first difference)", flush=True)
    print(f"{'path':<42} {'top-1 agreement':>15} {'mean KL':>10} {'kept':>6}")
    for name, r in result["paths"].items():
        print(f"{name:<42} {r['top1']:>15.4f} {r['kl']:>10.5f} {r['kept']:>6.1f}")
    for note in result["notes"]:
        print(note)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Print each model's table; return one row per (model, path) (``--json`` prints them as JSON lines)."""
    models = [m for m in args.models if m != "tiny-bench"] or ["smollm2-135m"]
    rows: list[dict[str, Any]] = []
    for m in models:
        result = measure(m)
        print_table(result)
        rows += [{"model": m, "path": name, **r} for name, r in result["paths"].items()]
    return rows
