"""guidellm (a real load tool, ``guidellm==0.8.1``) against ``tickloom serve``: its synthetic benchmark, at a fixed
rate against ``--model stub`` and at a fixed concurrency against the default model, gets every request through with
no error, and the server's log replays.

guidellm makes its synthetic prompts with a Hugging Face tokenizer: the default model's tokenizer files (the
directory tickloom converts the bundled GGUF to), read offline. Both processes run as a user runs them: ``tickloom
serve`` and ``python -m guidellm run``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.engine_helpers import assert_replays

pytest.importorskip("guidellm")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "HF_DATASETS_OFFLINE": "1"}


def default_model_tokenizer() -> Path:
    """The default model's tokenizer files (tokenizer.json and its config), as guidellm's tokenizer loads them."""
    from tickloom.engine.model.convert import resolve_model
    from tickloom.tools.model_options import DEFAULT_MODEL

    try:
        return resolve_model(DEFAULT_MODEL)
    except OSError as exc:  # ModelLoadError: the bundled model's package is not installed
        pytest.skip(f"the default model is not available: {exc}")


@contextmanager
def tickloom_serve(tmp_path: Path, *flags: str) -> Iterator[str]:
    """``tickloom serve`` on a free port, its log in ``tmp_path``; yields its URL, then stops it with SIGTERM (it
    drains) and checks that it exited 0 and that its log replays."""
    err = tmp_path / "serve.err"
    log = tmp_path / "serve.tlog"
    with err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "tickloom", "serve", "--port", "0", "--log", str(log),
                                 "--no-access-log", "--stats-interval", "0", "--quiet", *flags],
                                cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 300
        while " on http://" not in err.read_text():
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.2)
        line = next(line for line in err.read_text().splitlines() if " on http://" in line)
        yield line.split(" on ")[1].split(";")[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    assert code == 0, err.read_text()
    assert_replays(log)


def guidellm(url: str, tmp_path: Path, profile: str, requests: int, prompt_tokens: int,
             output_tokens: int) -> dict[str, Any]:
    """guidellm's synthetic benchmark of ``requests`` chat requests under ``profile``; its JSON report's one
    benchmark."""
    report = tmp_path / "guidellm.json"
    argv = [sys.executable, "-m", "guidellm", "run", "--backend", f"kind=openai_http,target={url}",
            "--profile", profile, "--constraint", f"kind=max_requests,count={requests}",
            "--tokenizer", f"kind=hf_auto,model={default_model_tokenizer()}",
            "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
            "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    done = subprocess.run(argv, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    result: dict[str, Any] = benchmark
    return result


def check_every_request_succeeded(benchmark: dict[str, Any], requests: int, output_tokens: int) -> None:
    totals = benchmark["metrics"]["request_totals"]
    assert totals == {"successful": requests, "errored": 0, "incomplete": 0, "total": requests}, totals
    assert benchmark["scheduler_metrics"]["requests_made"]["errored"] == 0
    outputs = benchmark["metrics"]["output_token_count"]["successful"]
    assert outputs["count"] == requests and outputs["min"] >= 1 and outputs["max"] <= output_tokens


def test_guidellm_against_the_stub(tmp_path: Path) -> None:
    with tickloom_serve(tmp_path, "--model", "stub") as url:
        benchmark = guidellm(url, tmp_path, "kind=constant,rate=5", requests=20, prompt_tokens=16, output_tokens=8)
    check_every_request_succeeded(benchmark, 20, 8)
    assert benchmark["metrics"]["output_token_count"]["successful"]["min"] == 8  # the stub never ends early


def test_guidellm_against_the_default_model(tmp_path: Path) -> None:
    default_model_tokenizer()
    with tickloom_serve(tmp_path) as url:
        benchmark = guidellm(url, tmp_path, "kind=concurrent,streams=2", requests=6, prompt_tokens=32,
                             output_tokens=16)
    check_every_request_succeeded(benchmark, 6, 16)
