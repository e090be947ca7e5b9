"""Structured outputs on the device side: compiling a logged constraint (``events.Structured``) with llguidance, and
keeping one grammar matcher per bound request that carries one.

The executor asks, before a step's forward pass, for the allowed-token masks of its constrained rows
(``Constraints.start_masks``); llguidance fills them on its own threads while the model runs, and ``MaskJob.wait``
hands them over as one bool tensor. After sampling, ``Constraints.forced`` says which tokens the constraint forces
next (a JSON key, a closing brace), so the executor can accept them without a forward pass each.

A matcher's state is a pure function of (constraint, tokens): every call names the request's output tokens, and
the matcher is rolled back, rebuilt or advanced to exactly those, so preemption, a stop-string truncation, a replay
or a discarded run-ahead row can never leave it out of step with the log.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from tickloom.engine.model.tokenizer import TokenizerWrapper
from tickloom.events.types import Structured

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_FORMAT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How a ``json`` or ``json_object`` constraint lays its JSON out: ``json.dumps``'s own separators and no other
whitespace. Flexible whitespace lets a small model pad forever with newlines, and a fixed layout is what makes a
key or a closing brace a forced token. A schema's own ``x-guidance`` options override these."""


class StructuredError(ValueError):
    """A constraint that does not compile, or costs more than ``ConstraintLimits`` allows. The message names the
    field (``structured.json``, ``structured.regex``, ``structured.choice``, ``structured.grammar``) and, where the
    engine reports one, the position."""


@dataclass(frozen=True)
class ConstraintLimits:
    """Bounds on what one constraint may cost: its size, its compilation and each mask step. A constraint past
    them is refused by ``Constraints.check`` with a ``StructuredError``; none can stall the executor."""

    max_text_chars: int = 1 << 20
    """A schema's, regex's or grammar's text, or a choice list's strings together, at most this many characters."""
    max_repeat: int = 10_000
    """A ``{n}`` or ``{n,m}`` repetition count at most this (llguidance unrolls one lazily, but a mask step over
    ``x{1000000}`` takes seconds and no fuel bounds it)."""
    max_grammar_size: int = 100_000
    """Symbols in the compiled grammar's productions (llguidance's default, 500 000, takes seconds to refuse)."""
    initial_lexer_fuel: int = 1_000_000
    """llguidance's budget for building the lexer's regexes (about 50 000 a millisecond)."""
    step_lexer_fuel: int = 200_000
    """llguidance's lexer budget for one mask step (about 14 000 a millisecond)."""
    step_max_items: int = 50_000
    """Earley items one mask step may make (about 20 000 a millisecond)."""
    max_lexer_states: int = 100_000
    """Lexer states one grammar may build (1-2 KB each)."""
    max_cached: int = 256
    """Compiled grammars kept (least recently used out first)."""
    mask_threads: int | None = None
    """Threads llguidance fills masks on (None: its default, 80% of the CPUs up to 32)."""

    def parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(
            max_grammar_size=self.max_grammar_size, initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel, step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states, verbose_errors=False)


_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_LARK_AT = re.compile(r"^(?:at )?(\d+)\((\d+)\): (.*)")


def _field(spec: Structured) -> str:
    return "structured.json" if spec.kind == "json_object" else f"structured.{spec.kind}"


def _describe(error: str, *, wrapped: bool) -> str:
    """llguidance's error, made short: the first line, with the position it gives as line and column. A regex
    error points into the pattern (a column); a Lark error into the grammar (line and column), unless the grammar
    was made here around the user's text (``wrapped``), where its position means nothing to them."""
    lines = error.splitlines() or [""]
    start = next((i for i, line in enumerate(lines) if line.endswith("regex parse error:")), None)
    if start is not None:
        pattern, caret = [*lines[start + 1:start + 3], "", ""][:2]
        reason = next((line[len("error: "):] for line in lines[start:] if line.startswith("error: ")), lines[0])
        column = caret.find("^") - 3 if caret.strip().startswith("^") else -1
        where = f" (at column {column})" if column > 0 and "\n" not in pattern else ""
        return f"invalid regex {pattern.strip()!r}: {reason}{where}"
    found = _LARK_AT.match(lines[0])
    if found is None:
        return lines[0][:500]
    row, col, reason = found.groups()
    return reason[:500] if wrapped else f"{reason[:500]} (at line {row}, column {col})"


def _grammar_of(spec: Structured) -> str:
    """The llguidance grammar for a constraint (not yet checked), or ``StructuredError`` where conversion fails."""
    name = _field(spec)
    try:
        if spec.kind == "json":
            return str(llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_FORMAT))
        if spec.kind == "json_object":
            return str(llguidance.LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=JSON_FORMAT))
    except ValueError as exc:
        raise StructuredError(f"{name}: {exc}") from exc
    if spec.kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(spec.text))
    if spec.kind == "choice":
        if not spec.choices:
            raise StructuredError("structured.choice: no choices")
        lark = "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choices)
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    if spec.kind != "grammar":
        raise StructuredError(f"structured: unknown kind {spec.kind!r}")
    text = spec.text
    if "::=" in text:  # GBNF/EBNF, llama.cpp's form
        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # the converter reports bad GBNF as GbnfToLarkError and, on odd input, others
            raise StructuredError(f"structured.grammar: not a GBNF grammar: {exc}") from exc
    return str(llguidance.LLMatcher.grammar_from_lark(text))


@dataclass
class _Bound:
    """One bound request's matcher, and the output tokens it has consumed (a prefix of the last ones given)."""

    pristine: llguidance.LLMatcher
    matcher: llguidance.LLMatcher
    consumed: list[int]
    rejected: bool = False
    """The last tokens given went past ``consumed`` with one the grammar refuses."""

    def sync(self, tokens: Sequence[int]) -> None:
        """Bring the matcher to exactly ``tokens``: roll back (or rebuild) to the common prefix, consume the rest."""
        common = len(self.consumed)
        if list(tokens[:common]) != self.consumed:  # the usual case, a longer history, is one C-speed compare
            common = 0
            limit = min(len(self.consumed), len(tokens))
            while common < limit and self.consumed[common] == tokens[common]:
                common += 1
        if self.matcher.is_error():  # an error state is never left, not even by a rollback
            self.matcher, self.consumed, common = self.pristine.deep_copy(), [], 0
        elif common < len(self.consumed):
            if not self.matcher.rollback(len(self.consumed) - common):
                self.matcher, self.consumed, common = self.pristine.deep_copy(), [], 0
            else:
                del self.consumed[common:]
        rest = [int(t) for t in tokens[common:]]
        taken = self.matcher.try_consume_tokens(rest) if rest else 0
        self.consumed.extend(rest[:taken])
        self.rejected = taken < len(rest)

    @property
    def only_eos(self) -> bool:
        """The row allows EOS alone: the constraint is complete, or the tokens broke it."""
        return self.rejected or self.matcher.is_error() or self.matcher.is_stopped()


class MaskJob:
    """Allowed-token masks being filled on worker threads (``Constraints.start_masks``)."""

    def __init__(self, future: Future[torch.Tensor], owner: Constraints) -> None:
        self._future = future
        self._owner = owner

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> torch.Tensor:
        """The masks: bool ``[len(rows), vocab_size]``, True = allowed. EOS is allowed only where the constraint
        may end; where it is complete, or its matcher is in error (a token the grammar refuses reached it, e.g. by a
        stop-string truncation), only EOS is. An exception in the workers is raised here."""
        try:
            return self._future.result()
        finally:
            if self._owner._pending is self:
                self._owner._pending = None


def fill_masks(executor: llguidance.LLExecutor, matchers: list[tuple[llguidance.LLMatcher, int]],
               bitmask: torch.Tensor) -> None:
    """llguidance's parallel mask fill, one bit per token, into ``bitmask`` (int32 [rows, words]); it releases the
    GIL. A module function, so a test can hold it to see the caller go on meanwhile."""
    if matchers:
        executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


class Constraints:
    """Grammar matchers of the bound requests that carry a constraint, for one tokenizer. Not thread-safe except
    where said: the executor's one thread calls it. A ``MaskJob`` left unwaited is waited for by the next call."""

    def __init__(self, tokenizer: TokenizerWrapper, vocab_size: int, eos_token_ids: Sequence[int],
                 limits: ConstraintLimits = ConstraintLimits()) -> None:
        """``vocab_size`` is the model's (its logits' width): ids past the tokenizer's are never allowed.
        ``eos_token_ids`` end a constrained output (the tokenizer's when empty); the first is the one ``forced``
        appends."""
        given = list(eos_token_ids) or list(tokenizer.eos_token_ids)  # the model's, else the tokenizer's
        eos = [int(t) for t in given if 0 <= int(t) < vocab_size]
        if not eos:
            raise ValueError(f"structured outputs need an EOS token id below the vocabulary's size {vocab_size} "
                             f"(got {given})")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos)
        self.limits = limits
        self.tokenizer = llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=tokenizer.vocab_size,
                                                eos_token=list(eos))
        self._parser_limits = limits.parser_limits()
        self._cache: OrderedDict[tuple[str, str, tuple[str, ...]], llguidance.LLMatcher] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._bound: dict[str, _Bound] = {}
        self._executor = llguidance.LLExecutor(num_threads=limits.mask_threads)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tickloom-masks")
        self._pending: MaskJob | None = None
        self._eos = torch.tensor(self.eos_token_ids, dtype=torch.long)

    def close(self) -> None:
        """Stop the mask worker thread (after the job in flight)."""
        self._settle()
        self._worker.shutdown(wait=True)

    # -- compiling ----------------------------------------------------------------------------------------------

    def check(self, spec: Structured) -> None:
        """Compile ``spec`` (cached), or raise ``StructuredError`` naming the field and, where the engine gives one,
        the position. Thread-safe: the API may call it at submit, before anything is logged."""
        self._compiled(spec)

    def _compiled(self, spec: Structured) -> llguidance.LLMatcher:
        key = (spec.kind, spec.text, tuple(spec.choices))
        with self._cache_lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        matcher = self._compile(spec)  # outside the lock: a check at submit never holds up the executor's binds
        with self._cache_lock:
            matcher = self._cache.setdefault(key, matcher)
            self._cache.move_to_end(key)
            while len(self._cache) > self.limits.max_cached:
                self._cache.popitem(last=False)
            return matcher

    def _compile(self, spec: Structured) -> llguidance.LLMatcher:
        name = _field(spec)
        size = len(spec.text) + sum(len(choice) for choice in spec.choices)
        if size > self.limits.max_text_chars:
            raise StructuredError(f"{name} is {size} characters, more than {self.limits.max_text_chars}")
        for found in _REPEAT.finditer(spec.text):
            count = max(int(n) for n in found.groups() if n)
            if count > self.limits.max_repeat:
                raise StructuredError(f"{name}: the repetition {found.group(0)} at character {found.start() + 1} "
                                      f"counts past {self.limits.max_repeat}")
        grammar = _grammar_of(spec)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._parser_limits)
        if not matcher.is_error():
            matcher.compute_bitmask()  # the first step, within the step limits, and the lexer warmed for binds
        if matcher.is_error():
            wrapped = spec.kind in ("regex", "choice") or "::=" in spec.text
            raise StructuredError(f"{name}: {_describe(matcher.get_error(), wrapped=wrapped)}")
        return matcher

    # -- bound requests -----------------------------------------------------------------------------------------

    def bind(self, request_id: str, spec: Structured) -> None:
        """Give ``request_id`` a fresh matcher for ``spec`` (``StructuredError`` if it does not compile)."""
        self._settle()
        pristine = self._compiled(spec)
        self._bound[request_id] = _Bound(pristine, pristine.deep_copy(), [])

    def release(self, request_id: str) -> None:
        self._settle()
        self._bound.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._bound

    def __len__(self) -> int:
        return len(self._bound)

    @property
    def cached(self) -> int:
        """Compiled grammars in the cache now (at most ``limits.max_cached``)."""
        with self._cache_lock:
            return len(self._cache)

    def start_masks(self, rows: Sequence[tuple[str, Sequence[int]]]) -> MaskJob:
        """Sync each row's matcher to its output tokens (those before the position being sampled; one row a
        request), then fill the rows' masks on worker threads, the GIL released, so the caller can run the forward
        pass meanwhile. A row whose matcher is in error (a token the grammar refuses reached it, e.g. by a
        stop-string truncation) allows only EOS; nothing about one constraint raises here. The matchers belong to
        the job until ``MaskJob.wait`` (any other call here waits for it first)."""
        self._settle()
        bound: list[_Bound] = []
        for request_id, tokens in rows:
            entry = self._bound.get(request_id)
            if entry is None:
                raise KeyError(f"request {request_id!r} has no constraint bound")
            if any(entry is other for other in bound):
                raise ValueError(f"request {request_id!r} has two rows; a step samples a request once")
            entry.sync(tokens)
            bound.append(entry)
        job = MaskJob(self._worker.submit(self._masks, bound), self)
        self._pending = job
        return job

    def _masks(self, bound: list[_Bound]) -> torch.Tensor:
        words = (self.tokenizer.vocab_size + 31) // 32
        bitmask = torch.zeros((len(bound), words), dtype=torch.int32)
        only_eos = [entry.only_eos for entry in bound]
        fill_masks(self._executor, [(e.matcher, i) for i, e in enumerate(bound) if not only_eos[i]], bitmask)
        shifts = torch.arange(8, dtype=torch.uint8)
        bits = (bitmask.view(torch.uint8).unsqueeze(-1) >> shifts) & 1
        width = min(self.vocab_size, self.tokenizer.vocab_size)
        masks = torch.zeros((len(bound), self.vocab_size), dtype=torch.bool)
        masks[:, :width] = bits.reshape(len(bound), words * 32)[:, :width].bool()
        masks[:, self._eos] = False
        for i, entry in enumerate(bound):
            if only_eos[i]:
                masks[i] = False
            if only_eos[i] or entry.matcher.is_accepting():
                masks[i, self._eos] = True
        return masks

    def forced(self, request_id: str, outputs: Sequence[int], limit: int) -> list[int]:
        """The tokens, at most ``limit``, that the constraint forces after ``outputs`` (ending with the token just
        sampled), in order: a JSON key, a closing brace. When the constraint is then complete the list ends with
        one EOS id. [] when nothing is forced, or when ``outputs`` broke the constraint. The matcher keeps them
        consumed: the next call syncs it back if they are not taken."""
        self._settle()
        entry = self._bound[request_id]
        entry.sync(outputs)
        if limit <= 0 or entry.rejected or entry.matcher.is_error():
            return []
        tokens = [int(t) for t in entry.matcher.compute_ff_tokens()[:limit]]
        taken = entry.matcher.try_consume_tokens(tokens) if tokens else 0
        entry.consumed.extend(tokens[:taken])
        del tokens[taken:]
        if len(tokens) < limit and entry.matcher.is_stopped() and not entry.matcher.is_error():
            tokens.append(self.eos_token_ids[0])
        return tokens

    def _settle(self) -> None:
        if self._pending is not None:
            self._pending.wait()
