"""``tickloom chat``: an interactive chat with a model (the default instruct model unless ``--model``).

Reads one message per line from stdin and streams each reply; the conversation's history goes with every turn
(the oldest turns are dropped when it outgrows ``--max-seq-len``). ``/reset`` forgets the history; ``/exit``,
``/quit`` or end of input leave.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from tools.cmd_generate import add_model_arguments, engine_config, sampling

NAME = "chat"
HELP = "chat interactively with a model (one message per stdin line; /reset, /exit)"

COMMANDS = "/reset forgets the conversation, /exit (or end of input) leaves"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, max_tokens=256, temperature=0.7, chat_flag=False)
    parser.add_argument("--system", default=None, help="a system message to start the conversation with")


def run(args: argparse.Namespace) -> int:
    import trio

    from engine import Engine, RequestRejected
    from engine.model import ModelLoadError
    from tools.cli import EX_DATAERR, CliError

    config = engine_config(args)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    totals = {"turns": 0, "tokens": 0, "seconds": 0.0}

    def say(text: str, end: str = "\n") -> None:
        sys.stdout.write(text + end)
        sys.stdout.flush()

    async def read_line() -> str | None:
        if interactive:
            say("\x1b[1myou>\x1b[0m ", end="")
        line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
        return line if line else None

    async def reply(engine: Engine, history: list[dict[str, Any]], turn: int) -> dict[str, Any] | None:
        """Stream one reply; drop the oldest turns while the conversation is too long for the model."""
        system = history[:1] if history and history[0]["role"] == "system" else []
        params = sampling(args, turn)
        while True:
            try:
                stream = engine.generate(history, params)
                break
            except RequestRejected as exc:
                body = history[len(system):]
                if len(body) <= 1:
                    say(f"(message rejected: {exc})")
                    return None
                del history[len(system): len(system) + 2]  # the oldest user message and its reply
        if interactive:
            say("\x1b[1;36massistant>\x1b[0m ", end="")
        started = time.monotonic()
        text: list[str] = []
        tokens = 0
        finish: str | None = None
        try:
            async for out in stream:
                text.append(out.text_delta)
                tokens += len(out.token_ids)
                say(out.text_delta, end="")
                if out.finished:
                    finish = out.finish_reason
                    if out.error:
                        say(f"\n(error: {out.error})", end="")
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()
        say("")
        if finish not in ("stop", "length"):
            say(f"({finish})")
        totals["turns"] += 1
        totals["tokens"] += tokens
        totals["seconds"] += time.monotonic() - started
        return {"role": "assistant", "content": "".join(text)}

    async def main() -> None:
        async with Engine.open(config) as engine:
            if interactive:
                say(f"tickloom chat with {args.model}: {COMMANDS}")
            history: list[dict[str, Any]] = []
            if args.system:
                history.append({"role": "system", "content": args.system})
            turn = 0
            while (line := await read_line()) is not None:
                message = line.strip()
                if not message:
                    continue
                if message in ("/exit", "/quit"):
                    break
                if message == "/reset":
                    del history[1 if args.system else 0:]
                    say("(conversation reset)")
                    continue
                history.append({"role": "user", "content": message})
                answer = await reply(engine, history, turn)
                turn += 1
                if answer is None:
                    history.pop()
                else:
                    history.append(answer)

    try:
        trio.run(main)
    except ModelLoadError as exc:
        raise CliError(f"cannot load model {args.model!r}: {exc}", EX_DATAERR) from None
    rate = totals["tokens"] / totals["seconds"] if totals["seconds"] > 0 else 0.0
    print(f"chat: {totals['turns']} replies, {totals['tokens']} tokens, {rate:.1f} tokens/s, "
          f"log {args.log if args.log else 'none (use --log PATH)'}", file=sys.stderr)
    return 0
