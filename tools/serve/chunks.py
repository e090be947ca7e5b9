"""The chunks of a streamed answer (``chat.completion.chunk`` or ``text_completion`` events) and the body of a
whole one, built from the choices' ``RequestOutput`` frames."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tickloom import EngineError, RequestOutput
from tickloom.tools.serve import scoring, tool_calls, translate
from tickloom.tools.serve.openai_types import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    DeltaFunction,
    DeltaToolCall,
    OpenAIError,
    PromptLogprobs,
    ToolCall,
)
from tickloom.tools.serve.scoring import EchoedPrompt
from tickloom.tools.serve.sse import DONE, EventSink, event
from tickloom.tools.serve.tool_calls import CallReader, JsonCalls, Piece, ToolPlan
from tickloom.tools.serve.translate import Choice, Decode, OpenAIRequest

log = logging.getLogger("tickloom.serve")


class ChunkWriter:
    """Builds the chunks of a streamed answer and the body of a whole one."""

    def __init__(self, req: OpenAIRequest, rid: str, created: int, model_name: str, token_text: Decode,
                 echoes: Sequence[EchoedPrompt] = (), prompt_tokens: int = 0,
                 tool_plan: ToolPlan | None = None) -> None:
        self.model_name = model_name
        self.echoes = list(echoes)
        """With ``echo``, each prompt as the engine took it (a whole answer only)."""
        self.echo_only = isinstance(req, CompletionRequest) and req.echo and req.max_tokens == 0
        """``max_tokens=0``: the engine made one token, which the answer leaves out."""
        self.prompt_k = req.prompt_logprobs
        self.n = req.n
        self.token_text = token_text
        self.req = req
        self.chat = isinstance(req, ChatCompletionRequest)
        self.rid = rid
        self.created = created
        self.include_reasoning = not isinstance(req, ChatCompletionRequest) or req.include_reasoning
        """Chat's ``include_reasoning`` (vLLM's): false leaves ``reasoning_content`` out."""
        self.want_logprobs = req.logprobs is not None if isinstance(req, CompletionRequest) else req.logprobs
        self.top_k = 0 if isinstance(req, CompletionRequest) else req.top_logprobs or 0
        """Chat's ``top_logprobs``: the alternatives listed per token."""
        options = req.stream_options
        self.include_usage = options is not None and bool(options.include_usage)
        self.continuous_usage = options is not None and bool(options.continuous_usage_stats)
        """Usage in every chunk: ``prompt_tokens`` (the prompts' tokens) and the tokens sent so far."""
        self.prompt_tokens = prompt_tokens
        self.sent_tokens = 0
        self.offsets: dict[int, int] = {}
        self.tool_plan = tool_plan
        """With tools: each choice's text is read for calls (``tool_calls``)."""
        self.readers: dict[int, CallReader] = {}

    def _chat_chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.rid, object="chat.completion.chunk", created=self.created,
                                   model=self.model_name, choices=choices)

    async def start(self, sink: EventSink, count: int) -> None:
        if self.chat:
            first = [ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""), logprobs=None,
                                     finish_reason=None) for i in range(count)]
            await sink.write(event(self._chat_chunk(first)))

    async def frame(self, sink: EventSink, choice: Choice, out: RequestOutput) -> None:
        # With ``echo``, a choice's first chunk starts with the prompt (text, and logprobs if asked for).
        echo_now = bool(self.echoes) and choice.index not in self.offsets and bool(out.token_ids or out.finished)
        if self.echo_only and not (echo_now or out.finished):
            return
        generated = not self.echo_only
        logprobs = translate.frame_logprobs(out) if self.want_logprobs and out.token_ids and generated else None
        reasoning = out.reasoning_delta if self.include_reasoning else ""
        finish = out.finish_reason if out.finished else None
        content, calls = out.text_delta, Piece()
        if self.chat and self.tool_plan is not None:
            content, calls, finish = self._read_calls(choice.index, out, finish)
        if not (content or reasoning or out.finished or logprobs or echo_now or calls.calls):
            return
        decode = self.token_text
        self.sent_tokens += len(out.token_ids) if generated else 0
        usage = translate.running_usage(self.prompt_tokens, self.sent_tokens) if self.continuous_usage else None
        if self.chat:
            delta = Delta(content=content or None, reasoning_content=reasoning or None,
                          tool_calls=_tool_deltas(calls) or None)
            lp = None if logprobs is None else translate.chat_logprobs(out.token_ids, logprobs, decode,
                                                                         translate.frame_tops(out), self.top_k)
            chunk: Any = self._chat_chunk([ChatChunkChoice(index=choice.index, delta=delta, logprobs=lp,
                                                           finish_reason=finish)])
            chunk.usage = usage
        else:
            text = out.text_delta if generated else ""
            offset = self.offsets.get(choice.index, 0)
            prompt_text, prompt_lp = "", None
            if echo_now:
                echoed = self.echoes[choice.index // self.n]
                prompt_text, offset = echoed.text, len(echoed.text)
                if self.want_logprobs:
                    prompt_lp = scoring.echo_logprobs(echoed, choice.prompt_logprobs, decode)
            clp = None if logprobs is None else translate.completion_logprobs(out.token_ids, logprobs, decode,
                                                                               offset, translate.frame_tops(out))
            if prompt_lp is not None:
                clp = prompt_lp if clp is None else scoring.joined(prompt_lp, clp)
            self.offsets[choice.index] = offset + len(text)
            chunk = Completion(id=self.rid, object="text_completion", created=self.created,
                               model=self.model_name, usage=usage,
                               choices=[CompletionChoice(index=choice.index, text=prompt_text + text, logprobs=clp,
                                                         finish_reason=finish)])
        await sink.write(event(chunk))
        if finish == "error":
            await sink.write(event(OpenAIError(500, f"choice {choice.index} failed: {out.error}",
                                               type="server_error", code="request_failed").body_struct()))

    def _read_calls(self, index: int, out: RequestOutput, finish: str | None) -> tuple[str, Piece, str | None]:
        """A frame's text through its choice's call reader: the content to send, the call pieces, the finish
        (``tool_calls`` where the choice made calls that parse and the engine said ``stop``)."""
        assert self.tool_plan is not None
        reader = self.readers.get(index)
        if reader is None:
            reader = self.readers[index] = self.tool_plan.reader()
        piece = reader.feed(out.text_delta)
        if out.finished:
            tail = reader.finish()
            piece.content += tail.content
            piece.calls += tail.calls
            complete = not isinstance(reader, JsonCalls) or reader.parsed()
            if finish == "stop" and reader.count and complete:
                finish = "tool_calls"
        return piece.content, piece, finish

    async def end(self, sink: EventSink, choices: Sequence[Choice], n: int, errors: Sequence[EngineError]) -> None:
        """After the last frame: an engine crash's error event, or the usage chunk (if asked for); then DONE."""
        if self.echo_only:
            for c in choices:
                c.completion_tokens = 0
        if errors:
            exc = errors[0]
            log.error("a streamed request ended with an engine error: %s", exc)
            await sink.write(event(translate.engine_error(exc).body_struct()))
            await sink.write(DONE)
            return
        if self.include_usage:
            usage = translate.usage(choices, n)
            if self.chat:
                chunk: Any = ChatCompletionChunk(id=self.rid, object="chat.completion.chunk", created=self.created,
                                                 model=self.model_name, choices=[], usage=usage)
            else:
                chunk = Completion(id=self.rid, object="text_completion", created=self.created,
                                   model=self.model_name, choices=[], usage=usage)
            await sink.write(event(chunk))
        await sink.write(DONE)

    def whole(self, choices: Sequence[Choice], n: int) -> ChatCompletion | Completion:
        """The body of a non-streamed answer."""
        decode = self.token_text
        usage = translate.usage(choices, n)
        if self.chat:
            chat_choices = []
            for c in choices:
                reasoning = "".join(c.reasoning) if self.include_reasoning else ""
                lp = (translate.chat_logprobs(c.token_ids, c.logprobs, decode, c.tops, self.top_k)
                      if self.want_logprobs else None)
                content: str | None = "".join(c.text)
                finish, calls = c.finish_reason, list[ToolCall]()
                if self.tool_plan is not None:
                    content, calls, finish = tool_calls.read_whole(self.tool_plan, content or "", finish)
                message = AssistantMessage(content=content, reasoning_content=reasoning or None, tool_calls=calls)
                chat_choices.append(ChatChoice(index=c.index, message=message, logprobs=lp, finish_reason=finish))
            return ChatCompletion(id=self.rid, object="chat.completion", created=self.created,
                                  model=self.model_name, choices=chat_choices, usage=usage,
                                  prompt_logprobs=self._prompt_logprobs(choices[0]) if choices else None)
        cchoices = []
        for c in choices:
            if self.echo_only:
                c.token_ids, c.logprobs, c.tops, c.text, c.completion_tokens = [], [], [], [], 0
            text = "".join(c.text)
            clp = (translate.completion_logprobs(c.token_ids, c.logprobs, decode, 0, c.tops)
                   if self.want_logprobs else None)
            if self.echoes:
                echoed = self.echoes[c.index // n]
                if clp is not None:
                    clp = scoring.joined(scoring.echo_logprobs(echoed, c.prompt_logprobs, decode),
                                         translate.completion_logprobs(c.token_ids, c.logprobs, decode,
                                                                       len(echoed.text), c.tops))
                text = echoed.text + text
            cchoices.append(CompletionChoice(index=c.index, text=text, logprobs=clp, finish_reason=c.finish_reason,
                                             prompt_logprobs=self._prompt_logprobs(c)))
        return Completion(id=self.rid, object="text_completion", created=self.created, model=self.model_name,
                          choices=cchoices, usage=translate.usage(choices, n))

    def _prompt_logprobs(self, choice: Choice) -> PromptLogprobs | None:
        if self.prompt_k is None:
            return None
        return scoring.prompt_logprobs(choice.prompt_logprobs, self.prompt_k, self.token_text)


def _tool_deltas(piece: Piece) -> list[DeltaToolCall]:
    """Call pieces as OpenAI's deltas: a call's first with its id, type and name (and empty arguments), then its
    argument text."""
    deltas = []
    for index, call_id, name, arguments in piece.calls:
        if call_id is not None:
            deltas.append(DeltaToolCall(index=index, id=call_id, type="function",
                                        function=DeltaFunction(name=name, arguments=arguments)))
        elif arguments:
            deltas.append(DeltaToolCall(index=index, function=DeltaFunction(arguments=arguments)))
    return deltas
