"""``tickloom bench serve``: concurrent streams through ``tickloom serve`` (HTTP, SSE) against the same streams
straight into the in-process ``Engine``, side by side in one run.

One engine (the stub by default, or ``--model smollm2-135m``), its log on (``fsync="never"``), and the server on
127.0.0.1 over that same engine, in the same trio run. Each round runs ``--streams`` (16) concurrent streaming
completions of ``--max-tokens`` tokens (``ignore_eos``, distinct prompts and seeds) in turn: in-process; over HTTP
(``httpx`` streaming ``/v1/completions`` with ``include_usage``, keep-alive connections) from a client in this
process and trio run, which so pays for the client's HTTP and JSON work too; and over HTTP from a client in a
separate process (``python -m tools.bench_serve URL ...``, warmed up before its clock starts). ``--rounds`` rounds;
the median round of each counts. Tokens/s is completion tokens over the wall time from the first submit to the
last finish; TTFT is measured by the client, from just before its submit (or its POST) to the first frame (or
chunk) with text.
The log must replay ``identical`` afterwards.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tickloom.tools.progress import progress_note

HELP = "16 concurrent streams through the HTTP server against the in-process engine: tokens/s and TTFT"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="stub", help="stub (default), smollm2-135m, or any model `serve` takes")
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams (default 16)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each, alternating (default 3)")
    parser.add_argument("--stub-step-time", type=float, default=0.005,
                        help="with the stub: seconds per model step (default 0.005)")


def _prompt(i: int) -> str:
    return f"Request {i}: once upon a time"


def _summary(ttfts: list[float], tokens: int, seconds: float) -> dict[str, float]:
    ordered = sorted(ttfts)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ttft_mean_ms": 1e3 * statistics.fmean(ordered),
            "ttft_p90_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}


async def _in_process(engine: Any, streams: int, max_tokens: int, seed: int) -> dict[str, float]:
    import trio

    from tickloom import SamplingParams

    ttfts: list[float] = []
    tokens = [0]

    async def one(i: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, seed=seed + i, ignore_eos=True, temperature=0.8)
        submitted = time.perf_counter()
        first = True
        async with engine.stream(_prompt(i), params) as stream:
            async for out in stream:
                if first and out.text_delta:
                    ttfts.append(time.perf_counter() - submitted)
                    first = False
                if out.finished:
                    tokens[0] += out.usage.completion_tokens

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(one, i)
    return _summary(ttfts, tokens[0], time.perf_counter() - started)


async def _http(client: Any, model: str, streams: int, max_tokens: int, seed: int) -> dict[str, float]:
    import trio

    ttfts: list[float] = []
    tokens = [0]

    async def one(i: int) -> None:
        body = {"model": model, "prompt": _prompt(i), "max_tokens": max_tokens, "seed": seed + i,
                "temperature": 0.8, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        submitted = time.perf_counter()
        first = True
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first and chunk["choices"] and chunk["choices"][0]["text"]:
                    ttfts.append(time.perf_counter() - submitted)
                    first = False
                if chunk.get("usage"):
                    tokens[0] += chunk["usage"]["completion_tokens"]

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(one, i)
    return _summary(ttfts, tokens[0], time.perf_counter() - started)


def run(args: argparse.Namespace) -> int:
    import functools

    import httpx
    import trio

    from tickloom import Engine, EngineConfig
    from tickloom.replay import verify
    from tickloom.tools.cli import CliError
    from tickloom.tools.serve.server import ServeOptions, serve_engine

    if args.streams < 1 or args.max_tokens < 1 or args.rounds < 1:
        raise CliError("--streams, --max-tokens and --rounds must be at least 1")
    rows: dict[str, list[dict[str, float]]] = {"in-process": [], "http": [], "http-subprocess": []}

    with tempfile.TemporaryDirectory(prefix="tickloom-bench-serve-") as tmp:
        log = Path(tmp) / "bench.tlog"
        extra: dict[str, Any] = {"stub_step_time": args.stub_step_time} if args.model == "stub" else {}
        config = EngineConfig(model=args.model, log_path=str(log), fsync="never",
                              max_batch_size=max(16, args.streams), **extra)

        async def main() -> None:
            async with Engine.open(config) as engine:
                shutdown = trio.Event()
                async with trio.open_nursery() as nursery:
                    binds = await nursery.start(functools.partial(
                        serve_engine, engine, ServeOptions(port=0, model_name="bench"), shutdown=shutdown))
                    limits = httpx.Limits(max_connections=args.streams, max_keepalive_connections=args.streams)
                    async with httpx.AsyncClient(base_url=binds[0], timeout=600.0, limits=limits) as client:
                        # Warm-up of both paths; the HTTP one also opens the client's keep-alive connections.
                        await _in_process(engine, args.streams, 2, 10_000)
                        await _http(client, "bench", args.streams, 2, 10_000)
                        for r in range(args.rounds):
                            progress_note(f"round {r + 1} of {args.rounds}")
                            seed = 1000 * r
                            rows["in-process"].append(await _in_process(engine, args.streams, args.max_tokens, seed))
                            rows["http"].append(await _http(client, "bench", args.streams, args.max_tokens, seed))
                            rows["http-subprocess"].append(await _http_subprocess(binds[0], args.streams,
                                                                                  args.max_tokens, seed))
                    shutdown.set()

        trio.run(main)
        report = verify(log)
        replay = report.status

    def median(kind: str) -> dict[str, float]:
        ordered = sorted(rows[kind], key=lambda row: row["tokens_per_s"])
        return ordered[len(ordered) // 2]

    medians = {kind: median(kind) for kind in rows}
    inp = medians["in-process"]
    ratios = {kind: {"tokens_per_s": medians[kind]["tokens_per_s"] / inp["tokens_per_s"],
                     "ttft": medians[kind]["ttft_mean_ms"] / inp["ttft_mean_ms"]}
              for kind in ("http", "http-subprocess")}
    if args.json:
        print(json.dumps({"bench": "serve", "model": args.model, "streams": args.streams,
                          "max_tokens": args.max_tokens, "rounds": args.rounds, "median": medians,
                          "all_rounds": rows, "ratio_to_in_process": ratios, "replay": replay}))
    else:
        print(f"bench serve: model {args.model}, {args.streams} concurrent streams x {args.max_tokens} tokens, "
              f"median of {args.rounds} rounds")
        print(f"{'':26}{'tokens/s':>10}{'TTFT mean':>12}{'TTFT p90':>11}   (tokens/s each round)")
        labels = {"in-process": "in-process Engine", "http": "HTTP, client in-process",
                  "http-subprocess": "HTTP, client process"}
        for kind, label in labels.items():
            row = medians[kind]
            each = ", ".join(f"{x['tokens_per_s']:.0f}" for x in rows[kind])
            print(f"{label:26}{row['tokens_per_s']:10.1f}{row['ttft_mean_ms']:10.1f}ms{row['ttft_p90_ms']:9.1f}ms"
                  f"   ({each})")
        for kind in ("http", "http-subprocess"):
            print(f"{labels[kind]} / in-process: tokens/s {ratios[kind]['tokens_per_s']:.2f}x, "
                  f"TTFT {ratios[kind]['ttft']:.2f}x")
        print(f"log replay: {replay}")
    return 0 if replay == "identical" else 1


async def _http_subprocess(url: str, streams: int, max_tokens: int, seed: int) -> dict[str, float]:
    """One round from a client in its own process (``main`` below)."""
    import trio

    argv = [sys.executable, "-m", "tickloom.tools.bench.serve", url, str(streams), str(max_tokens), str(seed)]
    done = await trio.run_process(argv, capture_stdout=True)
    row: dict[str, float] = json.loads(done.stdout)
    return row


def main(argv: list[str]) -> None:
    """The client process: ``python -m tools.bench_serve URL STREAMS MAX_TOKENS SEED``; one JSON line out."""
    import httpx
    import trio

    url, streams, max_tokens, seed = argv[0], int(argv[1]), int(argv[2]), int(argv[3])

    async def go() -> dict[str, float]:
        limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
        async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:
            await _http(client, "bench", streams, 2, 20_000 + seed)  # warm-up: imports, connections
            return await _http(client, "bench", streams, max_tokens, seed)

    print(json.dumps(trio.run(go)))


if __name__ == "__main__":
    main(sys.argv[1:])
