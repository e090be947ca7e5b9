"""``tickloom generate PROMPT...``: stream completions of one or more prompts, run concurrently by the engine.

On a terminal each prompt gets a live panel that fills as tokens arrive, above a progress line with tokens/s.
Piped (or with ``--plain``), each output line is prefixed with its prompt's label, ``[1]``, ``[2]``...; a single
running prompt streams its text as it comes. Either way the run ends with a one-line summary: requests, tokens,
tokens/s, preemptions and the log's path. With ``--json``, every output frame is one JSON line as it arrives
(request id, token ids, text delta, finish), flushed at once, and the summary is a last ``{"summary": ...}`` line.
Exit status 1 if any request ended in an error.

Ctrl-C (SIGINT) cancels the requests, lets the engine shut down (what is left ends with an explicit error in the
log, which replays) and exits 130 without a traceback; a second Ctrl-C exits at once, skipping the shutdown.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from tickloom.tools.cli import plural
from tickloom.tools.model_options import add_model_arguments, engine_config, sampling

if TYPE_CHECKING:
    import trio

    from tickloom import Engine, RequestOutput, RequestStream, SamplingParams
    from tickloom.api import Prompt

NAME = "generate"
HELP = "stream completions of one or more prompts (concurrently), then summarise the run"

EX_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT), as shells report it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompts to complete, each one request")
    add_model_arguments(parser)
    parser.add_argument("--concurrency", type=int, default=None, metavar="K",
                        help="run at most K prompts at once (default: all)")
    parser.add_argument("--plain", action="store_true",
                        help="plain labelled lines even on a terminal (the default when piped)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per output frame as it arrives (token ids included), then a summary")


def use_chat(args: argparse.Namespace) -> bool:
    """``--chat`` as given, else on when a chat template applies: ``--chat-template``, or the model's own (an
    instruct model's, read from its GGUF or directory; the same by name or by path)."""
    if args.chat is not None:
        return bool(args.chat)
    if getattr(args, "chat_template", None) is not None:
        return True
    from tickloom.engine.model.convert import model_chat_template

    return model_chat_template(args.model) is not None


def label(index: int, prompt: str, width: int = 48) -> str:
    flat = " ".join(prompt.split())
    return f"[{index + 1}] " + (flat if len(flat) <= width else flat[: width - 1] + "…")


@dataclass
class _Request:
    index: int
    label: str
    text: str = ""
    tokens: int = 0
    state: str = "waiting"
    """"waiting", "running", or the finish reason."""
    error: str | None = None
    pending_line: str = field(default="", repr=False)


class _Plain:
    """Labelled lines for pipes: whole lines as they complete, or the raw stream when one request runs alone."""

    def __init__(self, out: TextIO, stream_raw: bool) -> None:
        self.out = out
        self.stream_raw = stream_raw

    def started(self, req: _Request) -> None:
        if self.stream_raw:
            print(f"{req.label}", file=self.out, flush=True)

    def delta(self, req: _Request, text: str) -> None:
        if self.stream_raw:
            self.out.write(text)
            self.out.flush()
            return
        req.pending_line += text
        *lines, req.pending_line = req.pending_line.split("\n")
        for line in lines:
            print(f"[{req.index + 1}] {line}", file=self.out, flush=True)

    def finished(self, req: _Request) -> None:
        if self.stream_raw:
            self.out.write("\n")
        elif req.pending_line:
            print(f"[{req.index + 1}] {req.pending_line}", file=self.out)
            req.pending_line = ""
        note = f"{req.state}, {plural(req.tokens, 'token')}" + (f": {req.error}" if req.error else "")
        print(f"[{req.index + 1}] ({note})", file=self.out, flush=True)

    def frame(self, req: _Request, out: RequestOutput) -> None:
        pass


class _Json:
    """``--json``: one JSON line per output frame, written and flushed as it arrives."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def started(self, req: _Request) -> None:
        pass

    def delta(self, req: _Request, text: str) -> None:
        pass

    def finished(self, req: _Request) -> None:
        pass

    def frame(self, req: _Request, out: RequestOutput) -> None:
        line = {"request_id": out.request_id, "prompt": req.index + 1, "token_ids": list(out.token_ids),
                "text": out.text_delta, "reasoning": out.reasoning_delta, "finished": out.finished,
                "finish_reason": out.finish_reason, "error": out.error}
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()


def run_trio(main: Callable[[], Awaitable[None]]) -> None:
    """``trio.run(main)``; a lone exception out of ``main``'s nursery (the one that holds ``CtrlC.watch``) comes
    out as itself, not inside an exception group, so callers can catch ``ModelLoadError`` or ``ConfigError``."""
    import trio

    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1 and not isinstance(group.exceptions[0], BaseExceptionGroup):
            raise group.exceptions[0] from None
        raise


class CtrlC:
    """Ctrl-C (SIGINT) inside ``trio.run``: each press cancels the scope registered with ``cancels`` (the
    innermost), so the code around it can clean up and carry on; a press while that scope is already cancelled
    (or none is registered) exits at once with status 130, skipping any shutdown. ``watch`` is the task that
    receives the signals."""

    def __init__(self) -> None:
        self.scope: trio.CancelScope | None = None
        self.presses = 0

    @contextlib.contextmanager
    def cancels(self, scope: trio.CancelScope) -> Iterator[trio.CancelScope]:
        previous, self.scope = self.scope, scope
        try:
            with scope:
                yield scope
        finally:
            self.scope = previous

    async def watch(self, task_status: trio.TaskStatus[None]) -> None:
        import signal

        import trio

        with trio.open_signal_receiver(signal.SIGINT) as signals:
            task_status.started()
            async for _ in signals:
                if self.scope is None or self.scope.cancel_called:
                    sys.stderr.write("\ntickloom: interrupted again: exiting without a clean shutdown\n")
                    sys.stderr.flush()
                    os._exit(EX_INTERRUPTED)
                self.presses += 1
                self.scope.cancel()


def make_streams(engine: Engine, prompts: Sequence[Prompt], params: Sequence[SamplingParams]) -> list[RequestStream]:
    """One (not yet submitted) stream per prompt; a prompt the engine refuses is a ``CliError`` naming it."""
    from tickloom import RequestRejected
    from tickloom.tools.cli import CliError

    streams = []
    for i, prompt in enumerate(prompts):
        try:
            streams.append(engine.generate(prompt, params[i], request_id=f"prompt-{i + 1}"))
        except RequestRejected as exc:
            raise CliError(f"prompt {i + 1}: {exc}") from None
    return streams


async def run_prompts(streams: Sequence[RequestStream], labels: Sequence[str], concurrency: int,
                      display: Any, reqs: list[_Request] | None = None) -> list[_Request]:
    """Run every stream, in order, at most ``concurrency`` at once (one worker task each), feeding the display.
    ``reqs`` (one per stream, filled in as they run) lets the caller see how far an interrupted run got."""
    import trio

    if reqs is None:
        reqs = [_Request(i, labels[i]) for i in range(len(streams))]
    queue = iter(zip(reqs, streams, strict=True))

    async def worker() -> None:
        for req, stream in queue:
            await one(req, stream)

    async def one(req: _Request, stream: RequestStream) -> None:
        try:
            await stream.start()
            req.state = "running"
            display.started(req)
            out: RequestOutput
            async for out in stream:
                delta = out.reasoning_delta + out.text_delta
                req.tokens += len(out.token_ids)
                if delta:
                    req.text += delta
                    display.delta(req, delta)
                if out.finished:
                    req.state = out.finish_reason or "?"
                    req.error = out.error
                display.frame(req, out)
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()
        display.finished(req)

    async with trio.open_nursery() as nursery:
        for _ in range(min(concurrency, len(reqs))):
            nursery.start_soon(worker)
    return reqs


class _Live:
    """Rich live panels, one per prompt, above a progress line (terminals only)."""

    def __init__(self, reqs_labels: Sequence[str], console: Any) -> None:
        self.console = console
        self.labels = reqs_labels
        self.reqs: dict[int, _Request] = {}
        self.started_at = time.monotonic()

    def started(self, req: _Request) -> None:
        self.reqs[req.index] = req

    def delta(self, req: _Request, text: str) -> None:
        pass

    def finished(self, req: _Request) -> None:
        pass

    def frame(self, req: _Request, out: RequestOutput) -> None:
        pass

    def render(self, final: bool = False) -> Any:
        from rich.console import Group
        from rich.panel import Panel
        from rich.text import Text

        panels: list[Any] = []
        tokens = 0
        running = done = 0
        for i, name in enumerate(self.labels):
            req = self.reqs.get(i)
            state = req.state if req is not None else "waiting"
            tokens += req.tokens if req is not None else 0
            running += state == "running"
            done += state not in ("running", "waiting")
            style = {"running": "cyan", "waiting": "dim", "interrupted": "yellow", "error": "red"}.get(state, "green")
            body = Text(req.text if req is not None else "")
            if req is not None and req.error:
                body.append(f"\n{req.error}", style="red")
            subtitle = f"{state} · {plural(req.tokens if req else 0, 'token')}"
            panels.append(Panel(body, title=name, title_align="left", subtitle=subtitle, subtitle_align="right",
                                border_style=style))
        if not final:
            elapsed = max(time.monotonic() - self.started_at, 1e-9)
            panels.append(Text(f"{done}/{len(self.labels)} done · {running} running · {plural(tokens, 'token')} · "
                               f"{tokens / elapsed:.1f} tokens/s · {elapsed:.1f} s", style="bold"))
        return Group(*panels)


def summary_line(n: int, tokens: int, seconds: float, preemptions: int, log: str | None) -> str:
    rate = tokens / seconds if seconds > 0 else 0.0
    return (f"summary: {plural(n, 'request')}, {plural(tokens, 'token')} in {seconds:.2f} s, {rate:.1f} tokens/s, "
            f"{plural(preemptions, 'preemption')}, log {log if log else 'none (use --log PATH)'}")


def run(args: argparse.Namespace) -> int:
    from tickloom.tools.cli import CliError

    if args.concurrency is not None and args.concurrency < 1:
        raise CliError("--concurrency must be at least 1")
    config = engine_config(args)
    chat = use_chat(args)
    prompts: list[Prompt] = [[{"role": "user", "content": p}] if chat else p for p in args.prompts]
    labels = [label(i, p) for i, p in enumerate(args.prompts)]
    params = [sampling(args, i) for i in range(len(prompts))]
    concurrency = args.concurrency or len(prompts)

    import trio
    from rich.console import Console

    console = Console()
    live_mode = console.is_terminal and not args.plain and not args.json
    reqs = [_Request(i, labels[i]) for i in range(len(prompts))]
    result: dict[str, Any] = {}
    ctrl_c = CtrlC()

    async def generate(engine: Engine) -> None:
        try:
            streams = make_streams(engine, prompts, params)
        except CliError as exc:
            result["error"] = exc  # raised outside the engine's nursery, so not in an exception group
            return
        result["started"] = time.monotonic()
        if live_mode:
            from rich.live import Live

            display = _Live(labels, console)
            try:
                with Live(display.render(), console=console, auto_refresh=False, transient=True,
                          vertical_overflow="ellipsis") as live:
                    async with trio.open_nursery() as nursery:
                        async def refresh() -> None:
                            while True:
                                live.update(display.render(), refresh=True)
                                await trio.sleep(0.1)

                        nursery.start_soon(refresh)
                        await run_prompts(streams, labels, concurrency, display, reqs)
                        nursery.cancel_scope.cancel()
            finally:
                for req in reqs:
                    display.reqs.setdefault(req.index, req)
                    if ctrl_c.presses and req.state in ("waiting", "running"):
                        req.state = "interrupted"
                console.print(display.render(final=True))
        else:
            plain = _Json(sys.stdout) if args.json else _Plain(sys.stdout, stream_raw=concurrency == 1)
            await run_prompts(streams, labels, concurrency, plain, reqs)

    async def main() -> None:
        from tickloom import Engine

        async with trio.open_nursery() as nursery:
            await nursery.start(ctrl_c.watch)
            with ctrl_c.cancels(trio.CancelScope()):  # while the model loads
                async with Engine.open(config) as engine:
                    try:  # inside the engine's block, so that its actors outlive the cancel and shut down
                        with ctrl_c.cancels(trio.CancelScope()):
                            await generate(engine)
                    finally:
                        result["stats"] = engine.stats()
                        if "started" in result:
                            result["seconds"] = time.monotonic() - result["started"]
            nursery.cancel_scope.cancel()

    from tickloom import ConfigError
    from tickloom.engine.model.errors import ModelLoadError
    from tickloom.tools.cli import EX_DATAERR

    try:
        run_trio(main)
    except ModelLoadError as exc:
        raise CliError(f"cannot load model {args.model!r}: {exc}", EX_DATAERR) from None
    except ConfigError as exc:  # e.g. --log names a path that exists: logs are never overwritten
        raise CliError(str(exc)) from None
    if "error" in result:
        raise result["error"]
    interrupted = ctrl_c.presses > 0
    for req in reqs:
        if req.state in ("waiting", "running"):
            req.state = "interrupted"
    tokens = sum(r.tokens for r in reqs)
    seconds = result.get("seconds", 0.0)
    preemptions = int(result["stats"]["preemptions"]) if "stats" in result else 0
    if interrupted and not args.json and not live_mode:
        for req in reqs:
            if req.state == "interrupted" and req.tokens:
                lead = "\n" if concurrency == 1 else ""
                print(f"{lead}[{req.index + 1}] (interrupted, {plural(req.tokens, 'token')})")
    if interrupted:
        print(f"tickloom: interrupted; {plural(sum(r.state == 'interrupted' for r in reqs), 'request')} cancelled",
              file=sys.stderr, flush=True)
    if args.json:
        summary = {"requests": len(reqs), "tokens": tokens, "seconds": seconds, "preemptions": preemptions,
                   "log": args.log, "errors": sum(r.state == "error" for r in reqs), "interrupted": interrupted}
        print(json.dumps({"summary": summary}), flush=True)
    else:
        print(summary_line(len(reqs), tokens, seconds, preemptions, args.log), flush=True)
    if interrupted:
        return EX_INTERRUPTED
    return 1 if any(r.state == "error" for r in reqs) else 0
