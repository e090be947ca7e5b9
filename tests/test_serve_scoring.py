"""Scoring over HTTP: ``echo`` with ``logprobs`` on ``/v1/completions``, read as lm-evaluation-harness's
``local-completions`` model reads it for a log-likelihood (the prompt is context + continuation as token ids,
``max_tokens=1``, ``logprobs=1``, ``echo=true``; it sums ``token_logprobs[ctxlen:-1]`` and calls the continuation
greedy when each of its tokens' logprob is the best of its ``top_logprobs``), and vLLM's echo-only
``max_tokens=0``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tests.test_serve import running, stub

CONTEXT = [40, 69, 76, 76, 79, 0]  # "Hello " in the stub's ids (a character's id is its code - 32)
CONTINUATION = [87, 79, 82, 76, 68]  # "world"


def lm_eval_loglikelihood(choice: dict[str, Any], ctxlen: int) -> tuple[float, bool]:
    """What lm-evaluation-harness computes from one choice (its ``parse_logprobs``)."""
    lp = choice["logprobs"]
    continuation = lp["token_logprobs"][ctxlen:-1]
    greedy = all(tok == max(top.values()) for tok, top in zip(continuation, lp["top_logprobs"][ctxlen:-1],
                                                              strict=True))
    return sum(continuation), greedy


async def test_echo_with_logprobs_is_what_lm_eval_reads(tmp_path: Path) -> None:
    prompt = CONTEXT + CONTINUATION
    async with running(stub(tmp_path / "s.tlog")) as srv:
        def go(c: Any) -> list[dict[str, Any]]:
            score = {"model": "stub", "prompt": [prompt, CONTEXT], "max_tokens": 1, "logprobs": 1, "echo": True,
                     "temperature": 0, "seed": 1234}
            answers = [c.post("/v1/completions", json=score),
                       c.post("/v1/completions", json={**score, "prompt": prompt, "max_tokens": 0}),
                       c.post("/v1/completions", json={**score, "prompt": "Hello world", "prompt_logprobs": 1}),
                       c.post("/v1/completions", json={**score, "echo": False, "prompt": prompt})]
            for r in answers:
                assert r.status_code == 200, r.text
            return [r.json() for r in answers]

        batch, echo_only, text, plain = await srv.http(go)
    first, second = batch["choices"]
    for choice, ids in ((first, prompt), (second, CONTEXT)):
        lp = choice["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["tokens"][: len(ids)] == [chr(t + 32) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for tok, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
            assert tok is not None and tok <= 0 and tok in top.values() and 1 <= len(top) <= 2
        assert lp["text_offset"] == list(range(len(ids) + 1))  # the stub: one character per token
        assert choice["text"].startswith("Hello ") and len(choice["text"]) == len(ids) + 1
    assert batch["usage"]["prompt_tokens"] == len(prompt) + len(CONTEXT)
    total, greedy = lm_eval_loglikelihood(first, len(CONTEXT))
    assert total < 0 and math.isfinite(total) and isinstance(greedy, bool)
    # The generated token's logprob is the one a plain request (no echo) reports for it.
    assert first["logprobs"]["token_logprobs"][-1] == plain["choices"][0]["logprobs"]["token_logprobs"][0]

    [only] = echo_only["choices"]
    assert only["text"] == "Hello world" and echo_only["usage"]["completion_tokens"] == 0
    assert only["logprobs"]["token_logprobs"] == first["logprobs"]["token_logprobs"][:-1]
    assert only["logprobs"]["top_logprobs"] == first["logprobs"]["top_logprobs"][:-1]

    [scored] = text["choices"]
    assert scored["text"].startswith("Hello world")
    assert scored["logprobs"]["token_logprobs"][:-1] == only["logprobs"]["token_logprobs"]
    # vLLM's prompt_logprobs agree with the echoed ones: token id -> logprob, rank, decoded token.
    listed = scored["prompt_logprobs"]
    assert listed[0] is None and len(listed) == len(prompt)
    for position, entry in enumerate(listed[1:], start=1):
        own = entry[str(prompt[position])]
        assert own["logprob"] == only["logprobs"]["token_logprobs"][position]
        assert own["decoded_token"] == chr(prompt[position] + 32)
        assert own["rank"] in (1, None)


async def test_echo_refusals_name_the_field(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog")) as srv:
        def go(c: Any) -> list[Any]:
            base = {"model": "stub", "prompt": "Hi", "echo": True}
            return [c.post("/v1/completions", json={**base, "truncate_prompt_tokens": 0, "logprobs": 1})]

        [no_prompt] = await srv.http(go)
    assert no_prompt.status_code == 400 and no_prompt.json()["error"]["param"] == "truncate_prompt_tokens"


async def test_an_echoed_prompt_counts_toward_the_answer_size(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog"), max_answer_entries=400) as srv:
        def go(c: Any) -> list[Any]:
            base = {"model": "stub", "prompt": "x" * 100, "max_tokens": 1, "logprobs": 1}
            return [c.post("/v1/completions", json=base),  # 1 x 1 x 3 entries
                    c.post("/v1/completions", json={**base, "echo": True}),  # 1 x 101 x 3
                    c.post("/v1/completions", json={**base, "prompt_logprobs": 5})]  # 1 x 101 x 7

        plain, echoed, listed = await srv.http(go)
    assert plain.status_code == 200 and echoed.status_code == 200
    assert listed.status_code == 400 and listed.json()["error"]["code"] == "answer_too_large"
    assert "1 choices x 101 tokens x 7 entries" in listed.json()["error"]["message"]


async def test_a_streamed_echo_is_the_whole_one_in_pieces(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog")) as srv:
        def go(c: Any) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
            out = []
            for body in ({"model": "stub", "prompt": ["Hello", "Bye"], "max_tokens": 3, "logprobs": 1, "echo": True,
                          "seed": 3, "n": 2},
                         {"model": "stub", "prompt": "Hello", "max_tokens": 0, "logprobs": 1, "echo": True},
                         {"model": "stub", "prompt": "Hello", "max_tokens": 2, "echo": True, "seed": 1}):
                whole = c.post("/v1/completions", json=body).json()
                streamed = c.post("/v1/completions", json={**body, "stream": True,
                                                           "stream_options": {"include_usage": True}})
                assert streamed.status_code == 200, streamed.text
                chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
                out.append((whole, chunks))
            return out

        answers = await srv.http(go)
    for whole, chunks in answers:
        for choice in whole["choices"]:
            mine = [ch["choices"][0] for ch in chunks if ch["choices"] and ch["choices"][0]["index"] == choice["index"]]
            assert "".join(m["text"] for m in mine) == choice["text"]
            if choice["logprobs"] is not None:
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    pieces = [x for m in mine if m["logprobs"] is not None for x in m["logprobs"][key]]
                    assert pieces == choice["logprobs"][key], key
        assert chunks[-1]["usage"] == whole["usage"]
    assert answers[1][0]["choices"][0]["text"] == "Hello" and answers[1][0]["usage"]["completion_tokens"] == 0
