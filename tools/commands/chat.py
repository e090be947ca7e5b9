"""``tickloom chat``: an interactive chat with a model (the default instruct model unless ``--model``).

Reads one message per line from stdin and streams each reply; the conversation's history goes with every turn
(the oldest turns are dropped when it outgrows ``--max-seq-len``). ``/help`` lists the commands; ``/reset``
forgets the history; ``/exit``, ``/quit`` or end of input leave. These lines never go to the model.

On a terminal the line is read with ``readline`` (arrow keys, Ctrl-A/E, history with Up/Down; the stdlib module,
so nothing to install; where Python has none, as on Windows, input is plain). Ctrl-C during a reply cancels that
request, prints ``(interrupted)`` and keeps the session: the message and the part of the reply already shown stay
in the history. Ctrl-C at the prompt leaves, like ``/exit`` (exit 0). A second Ctrl-C while a reply is being
cancelled exits at once (130).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
import time
from collections.abc import Iterator
from typing import Any

from tickloom.tools.cli import plural
from tickloom.tools.commands.generate import CtrlC, run_trio
from tickloom.tools.model_options import add_model_arguments, engine_config, sampling

NAME = "chat"
HELP = "chat interactively with a model (one message per stdin line; /help, /reset, /exit)"

COMMANDS = ("/help lists these, /reset forgets the conversation, /exit (or Ctrl-C, or end of input) leaves, Ctrl-C "
            "stops a reply")

_BOLD, _CYAN, _RESET = "\x1b[1m", "\x1b[1;36m", "\x1b[0m"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, chat_flag=False)
    parser.add_argument("--system", default=None, help="a system message to start the conversation with")


def _readline_prompt(text: str, style: str) -> str:
    """A coloured prompt for ``input``: readline must not count the escape sequences as columns, so they are
    wrapped in its ignore markers (\\001, \\002)."""
    return f"\x01{style}\x02{text}\x01{_RESET}\x02"


@contextlib.contextmanager
def _terminal_restored() -> Iterator[None]:
    """Put the terminal's settings back on the way out: a reader thread abandoned inside readline (Ctrl-C at the
    prompt) would leave it in readline's character-at-a-time mode."""
    try:
        import termios
    except ImportError:  # not a POSIX terminal: nothing to restore
        yield
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run(args: argparse.Namespace) -> int:
    import trio

    from tickloom import ConfigError, Engine, RequestRejected
    from tickloom.engine.model.errors import ModelLoadError
    from tickloom.tools.cli import EX_DATAERR, CliError

    config = engine_config(args)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    if interactive and importlib.util.find_spec("readline") is not None:  # none on Windows: plain input()
        import readline  # noqa: F401 - imported for its effect: input() gets line editing and history
    totals = {"turns": 0, "tokens": 0, "seconds": 0.0}
    ctrl_c = CtrlC()

    def say(text: str, end: str = "\n") -> None:
        sys.stdout.write(text + end)
        sys.stdout.flush()

    def read_interactive() -> str | None:
        try:
            return input(_readline_prompt("you> ", _BOLD))
        except EOFError:
            return None

    async def read_line() -> str | None:
        """The next line, or None at the end of input or on Ctrl-C."""
        with ctrl_c.cancels(trio.CancelScope()):
            if interactive:
                line = await trio.to_thread.run_sync(read_interactive, abandon_on_cancel=True)
                if line is None:
                    say("")
                return line
            text = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            return text if text else None
        say("")  # Ctrl-C at the prompt: end its line
        return None

    async def reply(engine: Engine, history: list[dict[str, Any]], turn: int) -> dict[str, Any] | None:
        """Stream one reply; drop the oldest turns while the conversation is too long for the model. Ctrl-C
        cancels the request and returns what was shown so far."""
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
            say(f"{_CYAN}assistant>{_RESET} ", end="")
        started = time.monotonic()
        text: list[str] = []
        tokens = 0
        finish: str | None = None
        with ctrl_c.cancels(trio.CancelScope()) as scope:
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
        if scope.cancelled_caught:
            say("(interrupted)")
        elif finish not in ("stop", "length"):
            say(f"({finish})")
        totals["turns"] += 1
        totals["tokens"] += tokens
        totals["seconds"] += time.monotonic() - started
        return {"role": "assistant", "content": "".join(text)}

    async def conversation(engine: Engine) -> None:
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
            if message in ("/help", "/?"):
                say(f"commands: {COMMANDS}")
                continue
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

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(ctrl_c.watch)
            with ctrl_c.cancels(trio.CancelScope()):  # while the model loads
                async with Engine.open(config) as engine:
                    with ctrl_c.cancels(trio.CancelScope()):  # inside, so that the engine shuts down cleanly
                        await conversation(engine)
            nursery.cancel_scope.cancel()

    try:
        with _terminal_restored() if interactive else contextlib.nullcontext():
            run_trio(main)
    except ModelLoadError as exc:
        raise CliError(f"cannot load model {args.model!r}: {exc}", EX_DATAERR) from None
    except ConfigError as exc:  # e.g. --log names a path that exists: logs are never overwritten
        raise CliError(str(exc)) from None
    rate = totals["tokens"] / totals["seconds"] if totals["seconds"] > 0 else 0.0
    replies = "1 reply" if totals["turns"] == 1 else f"{totals['turns']} replies"
    print(f"chat: {replies}, {plural(int(totals['tokens']), 'token')}, {rate:.1f} tokens/s, "
          f"log {args.log if args.log else 'none (use --log PATH)'}", file=sys.stderr)
    return 0
