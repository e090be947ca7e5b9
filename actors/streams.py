"""Sans-I/O assembly of one request's client stream: tokens in, ``RequestOutput`` frames out.

``StreamAssembler`` is fed the core's ``EmitTokens`` entries for one request, in token-index order, and its
``Finish``. It does no I/O and reads no clock (callers pass ``now``), so it is tested without trio.

What it does, per token, always one token at a time (so nothing depends on how tokens were batched into ticks):

* **Incremental detokenization.** It decodes a short window of recent ids, ``ids[prefix:]``, and diffs it
  against the window's already-produced prefix ``ids[prefix:read]``; when the new text is clean the window
  slides forward (the scheme of vLLM's incremental detokenizer). Text ending in U+FFFD, an incomplete UTF-8
  sequence, is held back until a later token completes it. Cost per token is one or two decodes of the window,
  not of the whole output.
* **Reasoning/content split.** Text that appears with a token goes to ``reasoning_delta`` when that token's
  reasoning flag is set, and to ``text_delta`` otherwise.
* **Stop strings** (``SamplingSpec.stop``) are matched against the content text in token order. Content that
  could still be the start of a stop string is held back. A match completes at the token whose text holds the
  stop string's last character; from then on nothing more is delivered, and the text ends before the stop
  string (after it with ``include_stop_str_in_output``).
  A match that completes before ``min_tokens`` tokens is ignored, as the core ignores EOS and stop ids there.
* **The final frame** combines the core's ``Finish`` with the assembler's own match: the stream ends at the
  first terminal condition by token index, with precedence deciding a tie at one index, so the client's text,
  finish reason and usage never depend on how late the core learns of the match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tickloom.engine.core.status import FINISH_PRECEDENCE
from tickloom.engine.outputs import RequestOutput, RequestUsage
from tickloom.events.commands import Finish, PromptLogprobs
from tickloom.events.types import FinishReason, SamplingSpec

REPLACEMENT_CHAR = "\ufffd"



def _top_dict(token: int, logprob: float, ids: list[int] | None, lps: list[float] | None) -> dict[int, float]:
    """Token id -> logprob: the alternatives in their order (best first), then ``token`` if it is not among them."""
    found = {} if ids is None or lps is None else dict(zip(ids, lps, strict=True))
    if token not in found:
        found[token] = logprob
    return found


class StreamProtocolError(ValueError):
    """The assembler was fed tokens or a finish that contradict what it already saw (an engine bug)."""


class Detokenizer(Protocol):
    """What the assembler needs of a tokenizer (``engine.model.tokenizer.TokenizerWrapper`` is one)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class StreamAssembler:
    """Turns one request's tokens and finish into client frames. See the module docstring."""

    def __init__(
        self,
        request_id: str,
        spec: SamplingSpec,
        prompt_len: int,
        detokenizer: Detokenizer,
        submitted_at: float,
        *,
        output_id: str | None = None,
        index: int = 0,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self.request_id = request_id
        self.output_id = request_id if output_id is None else output_id
        """The ``request_id`` its frames carry: the id the client submitted (one of ``n`` choices has its own)."""
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        """The prompt, to name each position's token in ``prompt_logprobs`` (only kept when they are asked for)."""
        self.spec = spec
        self.prompt_len = prompt_len
        self._detok = detokenizer
        self._skip_special = spec.skip_special_tokens
        self.submitted_at = submitted_at
        self._stops: tuple[str, ...] = tuple(s for s in spec.stop if s)
        # Incremental detokenizer: ids[_prefix:_read] is the window's already-produced text, _prefix_text its decode.
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._prefix_text: str | None = ""
        self._last_reasoning = False
        # Content text not yet released: always a suffix of the content that is a proper prefix of a stop string.
        self._held = ""
        self._received = 0
        """Tokens seen, counting those ignored after a match."""
        self._reasoning_count = 0
        """Reasoning flags among the processed tokens (``len(self._ids)``)."""
        self.stop_index: int | None = None
        """The token index at which a stop string matched, once one has."""
        self._first_time: float | None = None
        self._last_time: float | None = None
        self.finished = False

    @property
    def processed(self) -> int:
        """Tokens taken into the stream (delivered to the client): up to and including a stop match."""
        return len(self._ids)

    # -- tokens ---------------------------------------------------------------------------------------------------

    def on_tokens(
        self,
        token_ids: list[int],
        token_indices: list[int],
        reasoning: list[bool],
        logprobs: list[float] | None,
        now: float,
        top: tuple[list[list[int]], list[list[float]]] | None = None,
        prompt: PromptLogprobs | None = None,
    ) -> tuple[list[RequestOutput], int | None]:
        """Take consecutive tokens; return the frame to deliver (if any) and a stop match's token index (if new).

        ``top`` holds the tokens' top-k alternatives (ids, logprobs), ``prompt`` the prompt logprobs that came
        with output 0 (see ``RequestOutput``)."""
        n = len(token_ids)
        if len(token_indices) != n or len(reasoning) != n or (logprobs is not None and len(logprobs) != n):
            raise StreamProtocolError(f"{self.request_id!r}: token columns differ in length")
        if self.finished:
            raise StreamProtocolError(f"{self.request_id!r}: tokens after the final frame")
        start = self._received
        if n and (token_indices[0] != start or token_indices[-1] != start + n - 1 or n > 2):
            for offset, index in enumerate(token_indices):
                if index != start + offset:
                    raise StreamProtocolError(
                        f"{self.request_id!r}: expected token index {start + offset}, got {index}"
                    )
        self._received += n
        if self.stop_index is not None or n == 0:
            return [], None
        text: list[str] = []
        reasoning_text: list[str] = []
        matched: int | None = None
        taken = 0
        for i in range(n):
            taken += 1
            flag = reasoning[i]
            self._ids.append(token_ids[i])
            self._reasoning_count += flag
            self._last_reasoning = flag
            delta = self._decode_step()
            if flag:
                if delta:
                    reasoning_text.append(delta)
                continue
            released, hit = self._content(delta)
            if released:
                text.append(released)
            if hit:
                matched = token_indices[i]
                self.stop_index = matched
                break
        if self._first_time is None:
            self._first_time = now
        self._last_time = now
        tops = None
        if logprobs is not None and self.spec.logprobs:
            tops = [_top_dict(token_ids[i], logprobs[i], None if top is None else top[0][i],
                              None if top is None else top[1][i]) for i in range(taken)]
        frame = RequestOutput(
            request_id=self.output_id,
            token_ids=token_ids[:taken],
            text_delta="".join(text),
            reasoning_delta="".join(reasoning_text),
            logprobs=None if logprobs is None else logprobs[:taken],
            top_logprobs=tops,
            prompt_logprobs=self._prompt_logprobs(prompt) if start == 0 else None,
            index=self.index,
        )
        return [frame], matched

    def _prompt_logprobs(self, prompt: PromptLogprobs | None) -> list[dict[int, float] | None] | None:
        """The first frame's ``prompt_logprobs``: None first, then one dict per prompt position (see ``RequestOutput``).

        None if they were not asked for, or the device reported none for a prompt of several tokens."""
        ids = self.prompt_token_ids
        if self.spec.prompt_logprobs is None or (prompt is None and self.prompt_len > 1):
            return None
        out: list[dict[int, float] | None] = [None]
        if prompt is not None:
            lps, top_ids, top_lps = prompt
            for p in range(1, min(len(lps) + 1, len(ids))):
                out.append(_top_dict(ids[p], lps[p - 1], top_ids[p - 1] if top_ids else None,
                                     top_lps[p - 1] if top_lps else None))
        return out

    def _decode_step(self) -> str:
        """Decode the newest token against the window; return the clean new text ("" while it ends in U+FFFD)."""
        ids = self._ids
        if self._prefix_text is None:
            self._prefix_text = self._detok.decode(ids[self._prefix : self._read], self._skip_special)
        prefix_text = self._prefix_text
        new_text = self._detok.decode(ids[self._prefix :], self._skip_special)
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._prefix = self._read
            self._read = len(ids)
            self._prefix_text = None
            return new_text[len(prefix_text) :]
        return ""

    def _content(self, delta: str) -> tuple[str, bool]:
        """Append content text; return the text now safe to release and whether a stop string completed."""
        if not self._stops:
            return delta, False
        held = self._held
        buf = held + delta
        if delta and len(self._ids) >= self.spec.min_tokens:
            best: tuple[int, int] | None = None  # (end, start) of the earliest-ending match that ends in delta
            for s in self._stops:
                pos = buf.find(s, max(0, len(held) - len(s) + 1))
                if pos >= 0 and (best is None or (pos + len(s), pos) < best):
                    best = (pos + len(s), pos)
            if best is not None:
                end, start = best
                self._held = ""
                return buf[: end if self.spec.include_stop_str_in_output else start], True
        keep = self._stop_prefix_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        best = 0
        size = len(buf)
        for s in self._stops:
            first = s[0]
            p = buf.find(first, max(0, size - len(s) + 1))
            while p != -1 and size - p > best:
                if s.startswith(buf[p:]):
                    best = size - p
                    break
                p = buf.find(first, p + 1)
        return best

    # -- finish ---------------------------------------------------------------------------------------------------

    def on_finish(self, finish: Finish, now: float) -> RequestOutput:
        """The last frame: held-back text, the finish reason and usage (see the module docstring)."""
        if self.finished:
            raise StreamProtocolError(f"{self.request_id!r}: a second finish")
        usage = finish.usage
        core_count = usage.completion_tokens
        if core_count > self._received:
            raise StreamProtocolError(
                f"{self.request_id!r}: finished after {core_count} tokens but only {self._received} arrived"
            )
        k = self.stop_index
        reason: FinishReason = finish.reason
        count = core_count
        reasoning_tokens = usage.reasoning_tokens
        if k is not None:
            j = core_count - 1
            if k < j or (k == j and FINISH_PRECEDENCE[finish.reason] < FINISH_PRECEDENCE["stop"]):
                reason, count, reasoning_tokens = "stop", k + 1, self._reasoning_count
            elif k > j:
                raise StreamProtocolError(
                    f"{self.request_id!r}: finished at token {j} before the stop match at {k} it delivered"
                )
        elif count != self.processed:
            raise StreamProtocolError(
                f"{self.request_id!r}: finished after {count} tokens but {self.processed} were delivered"
            )
        text, reasoning_text = self._flush() if k is None else ("", "")
        self.finished = True
        first, last = self._first_time, self._last_time
        ttft = None if first is None or count == 0 else first - self.submitted_at
        itl = None if first is None or last is None or count < 2 else (last - first) / (count - 1)
        return RequestOutput(
            request_id=self.output_id,
            index=self.index,
            token_ids=[],
            text_delta=text,
            reasoning_delta=reasoning_text,
            finished=True,
            finish_reason=reason,
            usage=RequestUsage(
                prompt_tokens=usage.prompt_tokens,
                cached_prompt_tokens=usage.cached_prompt_tokens,
                completion_tokens=count,
                reasoning_tokens=reasoning_tokens,
                time_to_first_token_s=ttft,
                mean_inter_token_latency_s=itl,
            ),
            error=finish.error if reason == "error" else None,
        )

    def _flush(self) -> tuple[str, str]:
        """Release everything held back: an incomplete trailing character as it decodes, and any stop prefix."""
        tail = ""
        if self._read < len(self._ids):
            if self._prefix_text is None:
                self._prefix_text = self._detok.decode(self._ids[self._prefix : self._read], self._skip_special)
            new_text = self._detok.decode(self._ids[self._prefix :], self._skip_special)
            tail = new_text[len(self._prefix_text) :]
            self._prefix = self._read = len(self._ids)
            self._prefix_text = None
        text = self._held
        self._held = ""
        if self._last_reasoning:
            return text, tail
        return text + tail, ""
