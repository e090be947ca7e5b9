"""The model options that ``generate``, ``chat``, ``serve`` and ``replay --full`` share: their flags, the checks
that turn an obvious mistake into one usage line (exit 64), and the ``EngineConfig``/``SamplingParams`` built from
them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tickloom import EngineConfig, SamplingParams

DEFAULT_MODEL = "smollm2-135m"
"""The default model is an instruct model, so ``--chat`` is on by default for it."""

DTYPES = ("float32", "float64", "float16", "bfloat16")

def add_model_arguments(parser: argparse.ArgumentParser, *, max_tokens: int, temperature: float,
                        chat_flag: bool = True) -> None:
    """Options shared by ``generate`` and ``chat``."""
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"a model name (see `tickloom models`), a checkpoint directory, a .gguf file, or "
                             f"'stub' (default {DEFAULT_MODEL})")
    parser.add_argument("--max-tokens", type=int, default=max_tokens,
                        help=f"tokens to generate per reply at most (default {max_tokens})")
    parser.add_argument("--temperature", type=float, default=temperature,
                        help=f"sampling temperature; 0 is greedy (default {temperature})")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling seed (prompt i uses SEED + i); default: the engine picks and logs one")
    parser.add_argument("--log", metavar="PATH", default=None,
                        help="write the engine's log here (replay it with `tickloom replay PATH`)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:N (default cpu)")
    parser.add_argument("--dtype", default=None,
                        help=f"model dtype: {', '.join(DTYPES)} (default: float32 on CPU, bfloat16 on CUDA; "
                             f"{DEFAULT_MODEL} on a CPU with native bfloat16: bfloat16 with --quant int4)")
    parser.add_argument("--quant", default=None, choices=["none", "int8", "int4"],
                        help="weight-only quantization on CPU: int8 per channel, int4 in groups of 32 (a GGUF's "
                             "Q4 blocks as they are); none: the --dtype weights (default: the model's)")
    parser.add_argument("--max-seq-len", type=int, default=2048, help="prompt + output tokens at most (default 2048)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="shard the model over N ranks: this process and N-1 worker processes (gloo on cpu, "
                             "one GPU each on cuda; default 1)")
    parser.add_argument("--stub-step-time", type=float, default=None, metavar="SECONDS",
                        help="with --model stub: seconds per model step (default: the engine's, 0.01)")
    if chat_flag:
        parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                            help=f"wrap prompts as chat messages (default: on for {DEFAULT_MODEL}, off otherwise)")


def check_dtype(dtype: str | None) -> None:
    from tickloom.tools.cli import CliError

    if dtype is not None and dtype not in DTYPES:
        raise CliError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")


def check_device(device: str | None) -> None:
    """A usage error unless torch knows the device and it is there (imports torch unless it is ``cpu``)."""
    from tickloom.tools.cli import CliError

    if device is None or device == "cpu":
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise CliError(f"--device {device!r}: not a torch device (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise CliError(f"--device {device}: CUDA is not available here (torch {torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise CliError(f"--device {device}: there are {torch.cuda.device_count()} CUDA devices")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise CliError(f"--device {device}: MPS is not available here")
    elif dev.type != "cpu":
        raise CliError(f"--device {device}: tickloom runs on cpu, cuda or mps")


def check_model(model: str, *, flag: str = "--model") -> None:
    """A usage error if ``model`` is neither a model name nor an existing .gguf file or directory with a
    config.json (what is wrong inside one is found while loading: exit 65)."""
    from tickloom.engine.model.registry import available_models
    from tickloom.tools.cli import CliError

    names = [m.name for m in available_models()] + ["stub"]
    if model in names:
        return
    path = Path(model).expanduser()
    if not path.exists():
        raise CliError(f"cannot load model {model!r}: no such file or directory, and not a model name "
                       f"({', '.join(names)}; see `tickloom models`)")
    if path.is_file() and path.suffix != ".gguf":
        raise CliError(f"{flag} {model!r}: a file must be a .gguf; a checkpoint is a directory (config.json + "
                       "safetensors)")
    if path.is_dir() and not (path / "config.json").is_file():
        raise CliError(f"{flag} {model!r}: a checkpoint directory needs config.json (and safetensors weights)")


def check_model_options(model: str, device: str | None, dtype: str | None) -> None:
    """The obvious mistakes in ``--model``, ``--device`` and ``--dtype``, each as one line (``CliError``)."""
    check_dtype(dtype)
    check_model(model)
    check_device(device)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from tickloom import ConfigError, EngineConfig
    from tickloom.tools.cli import CliError

    check_model_options(args.model, args.device, args.dtype)
    if args.max_tokens < 1:
        raise CliError("--max-tokens must be at least 1")
    if args.max_seq_len < 2:
        raise CliError("--max-seq-len must be at least 2")
    if args.stub_step_time is not None and args.model != "stub":
        raise CliError("--stub-step-time needs --model stub")
    extra = {} if args.stub_step_time is None else {"stub_step_time": args.stub_step_time}
    try:
        return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, log_path=args.log,
                            max_seq_len=args.max_seq_len, quant=getattr(args, "quant", None),
                            tensor_parallel_size=getattr(args, "tensor_parallel_size", 1), **extra)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def sampling(args: argparse.Namespace, index: int = 0) -> SamplingParams:
    from tickloom import RequestRejected, SamplingParams
    from tickloom.tools.cli import CliError

    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              seed=None if args.seed is None else args.seed + index)
    except RequestRejected as exc:
        raise CliError(str(exc)) from None

