"""llama.cpp's side of ``tickloom bench model --against llama.cpp``: batched greedy decoding through
llama-cpp-python's low-level API (one context, one sequence id per row, argmax in numpy), and its resident memory
and load time measured in a child process."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

INSTALL_HINT = "pip install 'tickloom[bench]'  (llama-cpp-python; it compiles llama.cpp, several minutes)"
NO_AMX_BUILD = ("CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
                "-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON' pip install --force-reinstall "
                "--no-deps --no-cache-dir --no-binary llama-cpp-python llama-cpp-python")
"""llama.cpp built for AVX512 without AMX: its repacked kernels, on a CPU where its AMX path faults."""


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppRunner:
    """One model, a context per (threads, batch). ``extra_buffers``: llama.cpp's default, weights repacked into
    its extra buffer types (interleaved rows for its AVX kernels, AMX tiles where the CPU has AMX); off only where
    that faults (``runner_for``)."""

    def __init__(self, gguf: Path, extra_buffers: bool = True) -> None:
        import llama_cpp

        self.lc: Any = llama_cpp
        self.extra_buffers = extra_buffers
        llama_cpp.llama_backend_init()
        llama_cpp.llama_log_set(QUIET_LOG, ctypes.c_void_p())
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = extra_buffers
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {gguf}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))

    def decode(self, prompts: list[list[int]], new_tokens: int, threads: int) -> tuple[float, float]:
        """(prefill seconds, decode seconds for new_tokens - 1 steps), greedy, eos ignored."""
        lc, b, plen = self.lc, len(prompts), len(prompts[0])
        p = lc.llama_context_default_params()
        p.n_ctx = b * (plen + new_tokens) + 16
        p.n_batch = p.n_ubatch = max(b * plen, 512)
        p.n_seq_max = b
        p.n_threads = p.n_threads_batch = threads
        ctx = lc.llama_init_from_model(self.model, p)
        batch = lc.llama_batch_init(b * plen, 0, b)
        try:
            t0 = time.perf_counter()
            n = 0
            for s, prompt in enumerate(prompts):
                for j, tok in enumerate(prompt):
                    _put(batch, n, tok, j, s, j == plen - 1)
                    n += 1
            batch.n_tokens = n
            last = self._step(ctx, batch, [(s + 1) * plen - 1 for s in range(b)])
            t1 = time.perf_counter()
            for k in range(1, new_tokens):
                for s in range(b):
                    _put(batch, s, last[s], plen + k - 1, s, True)
                batch.n_tokens = b
                last = self._step(ctx, batch, list(range(b)))
            t2 = time.perf_counter()
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        return t1 - t0, t2 - t1

    def _step(self, ctx: Any, batch: Any, rows: list[int]) -> list[int]:
        if self.lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        out = []
        for i in rows:
            ptr = self.lc.llama_get_logits_ith(ctx, i)
            out.append(int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax()))
        return out


def _put(batch: Any, i: int, tok: int, pos: int, seq: int, logits: bool) -> None:
    batch.token[i] = tok
    batch.pos[i] = pos
    batch.n_seq_id[i] = 1
    batch.seq_id[i][0] = seq
    batch.logits[i] = logits


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def QUIET_LOG(level: int, text: bytes, data: int) -> None:
    """llama.cpp's log callback, silenced (it prints a line per tensor at load and at quantization)."""
    return None


def runner_for(gguf: Path) -> tuple[LlamaCppRunner, str | None]:
    """A runner for ``gguf`` with llama.cpp's defaults where they run, and a note when they do not.

    Why the probe: on an Intel host with AMX (this project's VM moved to one), llama-cpp-python 0.3.36 built with
    its native flags puts quantized weights in its AMX buffer, and its first batched matmul dies in
    ``ggml_backend_amx_mul_mat`` on a general-protection fault at ``ldtilecfg`` (the process's AMX permission
    granted or not), which would take the whole bench down with it. One prompt is decoded in a child process
    first; if the child dies by a signal, llama.cpp runs without its extra buffer types (``use_extra_bufts``
    false: its plain AVX512 kernels, no repacking: at batch 32 a fraction of its speed), and the note says so
    beside its figures, with the build that keeps the repacking (``NO_AMX_BUILD``, what the README's figures on
    such a host use)."""
    if extra_buffers_work(gguf):
        return LlamaCppRunner(gguf), None
    return LlamaCppRunner(gguf, extra_buffers=False), (
        f"llama.cpp: its extra buffer types (weight repacking, AMX) crash on {gguf.name} on this CPU; "
        f"measured without them (use_extra_bufts=False); to keep its repacking, build it without AMX: {NO_AMX_BUILD}")


_PROBE = """
import sys
from tickloom.tools.bench.llamacpp import LlamaCppRunner
r = LlamaCppRunner(sys.argv[1])
r.decode([[1] * 16, [2] * 16], 2, 1)
"""


def extra_buffers_work(gguf: Path) -> bool:
    """Whether llama.cpp with its defaults survives loading ``gguf`` and decoding a batch, in a child process."""
    out = subprocess.run([sys.executable, "-c", _PROBE, str(gguf)], capture_output=True, text=True)
    return probe_outcome(out.returncode, out.stderr)


def probe_outcome(returncode: int, stderr: str) -> bool:
    """True for a clean exit, False for a death by a signal (a fault in llama.cpp's code); any other failure is an
    error of its own, raised with the child's last lines."""
    if returncode == 0:
        return True
    if returncode < 0:
        return False
    tail = "\n".join(stderr.strip().splitlines()[-5:])
    raise RuntimeError(f"llama.cpp probe failed (exit {returncode}):\n{tail}")


_CHILD = """
import json, sys, time
t = time.perf_counter()
import llama_cpp
from tickloom.tools.bench.llamacpp import LlamaCppRunner
r = LlamaCppRunner(sys.argv[1], extra_buffers=sys.argv[2] == "1")
import ctypes, llama_cpp as lc
p = lc.llama_context_default_params(); p.n_ctx = 4096; p.n_threads = p.n_threads_batch = 1
ctx = lc.llama_init_from_model(r.model, p)
load = time.perf_counter() - t
rss = int(open("/proc/self/statm").read().split()[1]) * 4096
print(json.dumps({"load_s": load, "rss": rss}))
"""


def footprint(gguf: Path, extra_buffers: bool = True) -> dict[str, float]:
    """llama.cpp's load time (import + model + a 4096-token context) and RSS, in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _CHILD, str(gguf), "1" if extra_buffers else "0"],
                         capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))
