"""The endpoints around generation, in vLLM's shapes: ``/v1/models`` (with ``created`` and ``max_model_len``),
``/tokenize`` (a prompt or chat messages), ``/detokenize`` and ``/version``.

``/tokenize`` tokenizes as the engine does (``tickloom.prompts``): text with the model's special tokens, chat
messages rendered with the model's template and its generation prompt. A request for another way (no special
tokens on text, special tokens added to chat, no generation prompt, continuing the final message) is a 400 naming
the field, as ``/v1/chat/completions`` refuses it: the counts here are the counts there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tickloom import RequestRejected
from tickloom.prompts import text_prompt_ids
from tickloom.tools.cli import package_version
from tickloom.tools.serve.backend import ServedEngine
from tickloom.tools.serve.guard import BodyLimits, read_body
from tickloom.tools.serve.openai_types import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    OpenAIError,
    TokenizeChat,
    TokenizeCompletion,
    TokenizeResponse,
    Version,
    decode_request,
)
from tickloom.tools.serve.translate import chat_messages

VERSION = package_version()
TOKENIZE_ROUTES = ("/tokenize", "/detokenize", "/version")

Json = Callable[[Any], Response]


def _check_model(model: str | None, served: str) -> None:
    if model is not None and model != served:
        raise OpenAIError(404, f"the model {model!r} does not exist; this server has {served!r}", param="model",
                          code="model_not_found")


def _refuse_other_tokenizing(req: TokenizeCompletion | TokenizeChat) -> None:
    if isinstance(req, TokenizeCompletion):
        wrong = [("add_special_tokens", not req.add_special_tokens, "text is tokenized with special tokens")]
    else:
        wrong = [("add_generation_prompt", not req.add_generation_prompt,
                  "the chat template always adds the generation prompt"),
                 ("continue_final_message", req.continue_final_message, "continuing the final message"),
                 ("add_special_tokens", req.add_special_tokens, "chat is tokenized without adding special tokens")]
    for name, asked, why in wrong:
        if asked:
            raise OpenAIError(400, f"{name} is not supported by this server: {why}", param=name,
                              code="unsupported_field")


def info_routes(engine: ServedEngine, model_name: str, created: int, limits: BodyLimits, json: Json) -> list[Route]:
    """The routes, answering with ``json(payload)``."""
    config = engine.config

    async def models(request: Request) -> Response:
        card = ModelCard(id=model_name, created=created, max_model_len=engine.max_seq_len, root=config.model)
        return json(ModelList(data=[card]))

    async def tokenize(request: Request) -> Response:
        body = await read_body(request, limits)
        chat = "messages" in decode_request(body, dict[str, Any])
        req: TokenizeCompletion | TokenizeChat = decode_request(body, TokenizeChat if chat else TokenizeCompletion)
        _check_model(req.model, model_name)
        _refuse_other_tokenizing(req)
        tokenizer: Any = engine.tokenizer
        try:
            if isinstance(req, TokenizeChat):
                messages = chat_messages(ChatCompletionRequest(model=model_name, messages=req.messages))
                ids = text_prompt_ids(tokenizer, messages, engine.max_seq_len)
            else:
                ids = text_prompt_ids(tokenizer, req.prompt, engine.max_seq_len)
        except RequestRejected as exc:
            raise OpenAIError(400, str(exc), param="messages" if chat else "prompt") from None
        assert ids is not None
        strs = [tokenizer.decode([t], False) for t in ids] if req.return_token_strs else None
        return json(TokenizeResponse(count=len(ids), max_model_len=engine.max_seq_len, tokens=ids, token_strs=strs))

    async def detokenize(request: Request) -> Response:
        req: DetokenizeRequest = decode_request(await read_body(request, limits), DetokenizeRequest)
        _check_model(req.model, model_name)
        vocab = engine.tokenizer.vocab_size
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise OpenAIError(400, f"token id {bad} is outside the vocabulary ({vocab} tokens)", param="tokens")
        return json(DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens, False)))

    async def version(request: Request) -> Response:
        return json(Version(version=VERSION))

    return [Route("/v1/models", models, methods=["GET"]), Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]), Route("/version", version, methods=["GET"])]


__all__ = ["TOKENIZE_ROUTES", "VERSION", "info_routes"]

