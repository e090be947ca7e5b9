"""``tickloom bench model --accuracy``: how faithful each path is to the float32 model of the same file.

The reference is the float32 model of the GGUF (weights dequantized, float32 activations). It continues 200 chat
prompts (rendered with the model's chat template; 20 hand-written, the rest topics in templates) greedily for 48
tokens. Each path is then fed prompt + that continuation (teacher forcing), and at each of the 9,600 positions its
logits are compared with the reference's: top-1 agreement (its argmax equals the reference's) and KL(ref || path),
both averaged over all positions. Each path also decodes greedily on its own over the first 20 prompts; "kept" is
the mean number of tokens it produces before the first one that differs from the reference's continuation.

Why so many positions: two paths that differ only in rounding disagree with the reference at different near-ties,
and over the 960 positions of 20 prompts a change that only adds precision moved agreement by up to 0.008 either
way. Each path's difference from the float32-activation path is printed with its paired 95% interval, so a table
says what it resolves.

Paths: tickloom's default setting for the model, float32 activations on the same weights (``exact_activations``: the
integer layers' weights as they hold them, dequantized, in float32 matmuls; for a file whose scales the tiles keep
exactly this is the reference again but for the order of float operations, so what it differs by is what the tiles
round), and llama.cpp on the same file (when ``llama_cpp``, the ``bench`` extra, is importable). The model's forward
runs directly over a KV cache, without the engine.
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
from tickloom.engine.model.quant import DenseLinear, Linear
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
TEMPLATES = [
    "Tell me about {}.",
    "Explain {} to a ten-year-old.",
    "Write a short poem about {}.",
    "Give three facts about {}.",
    "What is the history of {}?",
    "Why do people find {} interesting?",
    "Write a two-sentence story about {}.",
    "What are common misconceptions about {}?",
    "How would you describe {} in one paragraph?",
    "What questions should I ask an expert on {}?",
]
TOPICS = [
    "the moon", "volcanoes", "honey bees", "the Roman Empire", "electric cars", "coffee", "the internet",
    "rainbows", "chess", "the deep ocean", "glaciers", "vaccines", "jazz music", "the pyramids of Giza",
    "solar panels", "octopuses", "bread baking", "the printing press", "black holes", "rain forests", "bicycles",
    "the human heart", "earthquakes", "origami", "the Olympic Games", "penguins", "recycling", "lighthouses",
    "the violin", "thunderstorms",
]
DEFAULT_PROMPTS = 200
KEPT_PROMPTS = 20
F32_ACT = "tickloom float32 act, same weights"


def chat_prompts(n: int) -> list[str]:
    """``n`` prompts: the 20 hand-written ones, then each template with each topic (up to 320 in all), ordered so
    that every prefix mixes templates and topics."""
    made = [TEMPLATES[(j + r) % len(TEMPLATES)].format(topic)
            for r in range(len(TEMPLATES)) for j, topic in enumerate(TOPICS)]
    every = PROMPTS + made
    if not 1 <= n <= len(every):
        raise ValueError(f"accuracy prompts: {n} asked, 1 to {len(every)} available")
    return every[:n]


Logits = Callable[[list[int]], torch.Tensor]
"""Token ids in, float32 logits out: one row per position (``len(ids) x vocab``)."""


# ---- metrics (pure; tests/test_bench_accuracy.py) ----

def agrees(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per position (row): whether ``other``'s argmax is ``ref``'s."""
    return ref.argmax(-1) == other.argmax(-1)


def kl_per_position(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) || softmax(other)) of each position (row), in nats, computed in float64."""
    lp = torch.log_softmax(ref.double(), -1)
    lq = torch.log_softmax(other.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def tokens_kept(ref: list[int], other: list[int]) -> int:
    """How many tokens ``other`` has before it first differs from ``ref``."""
    n = 0
    for a, b in zip(ref, other, strict=False):
        if a != b:
            break
        n += 1
    return n


# ---- drivers ----

def exact_activations(lm: LoadedModel) -> LoadedModel:
    """``lm`` (a float32 model) made the float32-activation path, in place: each projection and the LM head become
    float32 matmuls of the weights they hold, dequantized (a GGUF's integers and scales as the tiles keep them), so
    no matmul's input is rounded (tickloom's integer kernels round it to 8 bits per group of 32)."""
    model = lm.model
    if model.dtype != torch.float32:
        raise ValueError(f"exact_activations: a float32 model, not {model.dtype}")
    for layer in model.layers:
        for name in ("qkv", "wo", "w13", "w2"):
            setattr(layer, name, _dense(getattr(layer, name)))
    model.lm_head = _dense(model.lm_head)
    model.layers_changed()
    return lm


def _dense(linear: Linear) -> DenseLinear:
    bias = getattr(linear, "bias", None)
    bias = None if bias is None else bias.float()
    if isinstance(linear, DenseLinear):
        return DenseLinear(linear.weight.float(), bias)
    dequantize = getattr(linear, "dequantize", None)
    if dequantize is None:
        raise TypeError(f"exact_activations: {type(linear).__name__} cannot give its weight back")
    return DenseLinear(dequantize().float(), bias)


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


def tickloom_greedy_batch(lm: LoadedModel, prompts: list[list[int]], n: int, block_size: int = 16,
                          rows: int = 32) -> list[list[int]]:
    """``n`` greedy tokens after each prompt, ``rows`` prompts decoding side by side (the reference's
    continuations: one step per token for 32 prompts costs little more than for one)."""
    model = lm.model
    gqa = model.cfg.num_heads // model.cfg.num_kv_heads
    out: list[list[int]] = []
    for lo in range(0, len(prompts), rows):
        chunk = prompts[lo : lo + rows]
        sizes = [blocks_holding(len(p) + n, block_size) for p in chunk]
        kv = model.new_kv_cache(sum(sizes) + 1, block_size)
        tables, first = [], 0
        for size in sizes:
            tables.append(list(range(first, first + size)))
            first += size
        specs = [RowSpec(0, len(p), t, True) for p, t in zip(chunk, tables, strict=True)]
        batch = build_step_batch(specs, [tok for p in chunk for tok in p], block_size, gqa, model.device)
        made = [[int(t)] for t in model.forward(batch, kv).argmax(-1).tolist()]
        for _ in range(n - 1):
            specs = [RowSpec(len(p) + len(m) - 1, 1, t, True) for p, m, t in zip(chunk, made, tables, strict=True)]
            batch = build_step_batch(specs, [m[-1] for m in made], block_size, gqa, model.device)
            for m, t in zip(made, model.forward(batch, kv).argmax(-1).tolist(), strict=True):
                m.append(int(t))
        out += made
    return out


class LlamaCppLogits:
    """llama.cpp on the same GGUF: all-position logits of one sequence, and greedy decoding."""

    def __init__(self, gguf: Any, n_ctx: int = 1024) -> None:
        from tickloom.tools.bench.llamacpp import runner_for

        self.runner, self.note = runner_for(gguf)
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


def paired_difference(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Agreement ``a`` minus ``b`` (booleans per position, the same positions) and the half-width of its 95%
    interval, from the spread of the per-position differences (a paired test: positions where both paths agree,
    or both miss, carry no information; those where one does carry it all). Positions of one prompt are treated
    as independent, so the interval is somewhat narrow."""
    d = a.astype(np.float64) - b.astype(np.float64)
    if d.size < 2:
        return float(d.mean()) if d.size else 0.0, float("inf")
    return float(d.mean()), 1.96 * float(np.sqrt(d.var(ddof=1) / d.size))


class PathTally:
    """One path's per-position agreement and KL, and its greedy tokens kept per prompt."""

    def __init__(self) -> None:
        self.agree: list[np.ndarray] = []
        self.kl: list[np.ndarray] = []
        self.kept: list[int] = []

    def add(self, ref: torch.Tensor, other: torch.Tensor) -> None:
        self.agree.append(agrees(ref, other).numpy())
        self.kl.append(kl_per_position(ref, other).numpy())

    def agreement(self) -> np.ndarray:
        """Every position's agreement, in prompt order."""
        return np.concatenate(self.agree)

    def result(self) -> dict[str, Any]:
        agree = self.agreement()
        return {"positions": int(agree.size), "top1": float(agree.mean()), "kl": float(np.concatenate(self.kl).mean()),
                "kept": sum(self.kept) / max(len(self.kept), 1), "kept_prompts": len(self.kept)}


def measure(model: str = "smollm2-135m", new_tokens: int = NEW_TOKENS, prompts: list[str] | None = None,
            kept_prompts: int = KEPT_PROMPTS) -> dict[str, Any]:
    """The reference's continuations, then every path's scores against them, one prompt at a time (nothing of
    one prompt's logits is kept: 200 prompts' would be gigabytes). Greedy decoding for "kept" runs on the first
    ``kept_prompts`` prompts only; llama.cpp's is step by step."""
    from tickloom.engine.model.loaders import DEFAULT_SETTING, _source_gguf, default_setting, gguf_is_quantized
    from tickloom.tools.bench import llamacpp as bench_llamacpp
    from tickloom.tools.progress import progress_note

    prompts = chat_prompts(DEFAULT_PROMPTS) if prompts is None else prompts
    ref = load_model(model, dtype="float32", quant="none")
    ids = [tokenize(ref.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    progress_note(f"{model}: float32 reference, {len(ids)} prompts x {new_tokens} tokens")
    ref_tokens = tickloom_greedy_batch(ref, ids, new_tokens)
    ref_fwd = tickloom_logits(ref)
    notes: list[str] = []
    paths: list[tuple[str, dict[str, str]]] = []
    dt, q = default_setting(model, torch.device("cpu"))
    ref_is_default = q == "none" and dt in (None, "float32")  # the default is the reference itself
    if not ref_is_default:
        paths.append(("tickloom default", {}))
    source = _source_gguf(model)
    if (dt, q) != DEFAULT_SETTING and source is not None and gguf_is_quantized(source):
        # this CPU has no native bfloat16, so the default is float32; measure the setting a bfloat16 CPU gets too
        paths.append(("tickloom bf16-CPU default", {"dtype": DEFAULT_SETTING[0], "quant": DEFAULT_SETTING[1]}))
    if source is None or gguf_is_quantized(source):  # an F16/BF16 file's float32 activations are the reference
        paths.append((F32_ACT, {"dtype": "float32", "quant": "int4"}))
    runners: list[tuple[str, Logits, Callable[[list[int], int], list[int]]]] = []
    for label, kw in paths:
        lm = load_model(model, **kw)
        if label == F32_ACT:
            name = f"{label} (float32, {lm.model.quant} dequantized)"
            exact_activations(lm)
        else:
            name = f"{label} ({lm.model.dtype}+{lm.model.quant})".replace("torch.", "")
        runners.append((name, tickloom_logits(lm), lambda p, n, lm=lm: tickloom_greedy(lm, p, n)))
    lc: LlamaCppLogits | None = None
    if not bench_llamacpp.available():
        notes.append(f"llama.cpp skipped: llama_cpp is not importable ({bench_llamacpp.INSTALL_HINT})")
    elif source is None:
        notes.append(f"llama.cpp skipped: {model} has no GGUF file")
    else:
        lc = LlamaCppLogits(source)
        if lc.note:
            notes.append(lc.note)
        runners.append(("llama.cpp", lc.logits, lc.greedy))
    tallies = {name: PathTally() for name, _, _ in runners}
    try:
        for i, (p, cont) in enumerate(zip(ids, ref_tokens, strict=True)):
            if i % 20 == 0:
                progress_note(f"teacher forcing: prompt {i + 1} of {len(ids)}")
            forced = p + cont
            window = slice(len(p) - 1, len(p) - 1 + new_tokens)  # the logits that predict the continuation
            r = ref_fwd(forced)[window]
            for name, fwd, greedy in runners:
                tallies[name].add(r, fwd(forced)[window])
                if i < kept_prompts:
                    tallies[name].kept.append(tokens_kept(cont, greedy(p, new_tokens)))
    finally:
        if lc is not None:
            lc.close()
    rows: dict[str, dict[str, Any]] = {}
    if ref_is_default:
        rows["tickloom default (float32+none) = reference"] = {
            "positions": len(ids) * new_tokens, "top1": 1.0, "kl": 0.0, "kept": float(new_tokens),
            "kept_prompts": min(kept_prompts, len(ids))}
    base = next((t for name, t in tallies.items() if name.startswith(F32_ACT)), None)
    for name, t in tallies.items():
        rows[name] = t.result()
        if base is not None and t is not base:
            diff, half = paired_difference(t.agreement(), base.agreement())
            rows[name] |= {"vs_f32_act": diff, "vs_f32_act_95": half}
    return {"model": model, "gguf": str(source) if source else None, "prompts": len(ids), "new_tokens": new_tokens,
            "paths": rows, "notes": notes}


def print_table(result: dict[str, Any]) -> None:
    n = result["prompts"] * result["new_tokens"]
    kept = next(iter(result["paths"].values()))["kept_prompts"]
    print(f"{result['model']}: {result['prompts']} chat prompts x {result['new_tokens']} tokens = {n} positions, "
          f"against float32 (teacher-forced; 'kept' is free-running greedy tokens before the first difference, over "
          f"the first {kept} prompts; 'vs f32 act' is top-1 agreement minus the float32-activation path's, with "
          f"its 95% interval)", flush=True)
    width = max(42, *(len(name) for name in result["paths"]))
    print(f"{'path':<{width}} {'top-1 agreement':>15} {'mean KL':>10} {'kept':>6} {'vs f32 act':>18}")
    for name, r in result["paths"].items():
        vs = f"{r['vs_f32_act']:+.4f} +- {r['vs_f32_act_95']:.4f}" if "vs_f32_act" in r else ""
        print(f"{name:<{width}} {r['top1']:>15.4f} {r['kl']:>10.5f} {r['kept']:>6.1f} {vs:>18}")
    for note in result["notes"]:
        print(note)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Print each model's table; return one row per (model, path) (``--json`` prints them as JSON lines)."""
    from tickloom.tools.cli import CliError

    models = [m for m in args.models if m != "tiny-bench"] or ["smollm2-135m"]
    rows: list[dict[str, Any]] = []
    try:
        prompts = chat_prompts(getattr(args, "accuracy_prompts", DEFAULT_PROMPTS))
    except ValueError as exc:
        raise CliError(f"--accuracy-prompts: {exc}") from None
    for m in models:
        result = measure(m, prompts=prompts)
        print_table(result)
        rows += [{"model": m, "path": name, **r} for name, r in result["paths"].items()]
    return rows
