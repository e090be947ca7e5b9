"""What a load tool sends ``serve --model stub``: prompts with newlines, tabs and emoji get 200s (guidellm's synthetic
prompts got 0 of 200 through while the stub took printable ASCII only), and the log keeps exactly the text sent."""

from __future__ import annotations

from pathlib import Path

import openai

from tests.test_serve import running, stub
from tickloom.engine.model.stub import StubTokenizer
from tickloom.events import LogReader, RequestArrived

PROMPTS = ["first line\nsecond line", "col\tcol\r\n", "caf\u00e9 \U0001F600 \u4e16\u754c"]


async def test_completions_and_chat_take_any_text(tmp_path: Path) -> None:
    log = tmp_path / "s.tlog"
    async with running(stub(log)) as srv:
        def go(c: openai.OpenAI) -> list[str | None]:
            finishes: list[str | None] = []
            for prompt in PROMPTS:
                done = c.completions.create(model="stub", prompt=prompt, max_tokens=4)
                finishes.append(done.choices[0].finish_reason)
            reply = c.chat.completions.create(model="stub", max_tokens=4,
                                              messages=[{"role": "user", "content": "\n".join(PROMPTS)}])
            finishes.append(reply.choices[0].finish_reason)
            return finishes

        assert await srv.call(go) == ["length"] * (len(PROMPTS) + 1)
    with LogReader(log) as reader:
        arrivals = [i for record in reader.ticks() for i in record.inputs.inputs if isinstance(i, RequestArrived)]
    texts = [StubTokenizer().decode(a.prompt_token_ids) for a in arrivals]
    assert texts[:len(PROMPTS)] == PROMPTS
    assert "\n".join(PROMPTS) in texts[-1]
