"""The model options: the engine flags that every engine-building command shares (``generate``, ``chat``, ``serve``,
``fleet``; one declaration, ``ENGINE_FLAGS``, typed and described by ``EngineConfig``'s fields, with vLLM's and
llama.cpp's names as aliases), the sampling flags, the checks that turn an obvious mistake into one usage line
(exit 64), and the ``EngineConfig``/``SamplingParams`` built from them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tickloom import EngineConfig, SamplingParams

DEFAULT_MODEL = "smollm2-135m"
"""The model a command loads unless ``--model`` says otherwise (an instruct model: it has a chat template, so
``--chat`` is on by default for it)."""

DTYPES = ("float32", "float64", "float16", "bfloat16")

DEFAULT_MAX_TOKENS = 256
"""``--max-tokens``'s default in every command: a whole chat reply or paragraph, yet bounded (a run always ends)."""

MAX_SEQ_LEN_CAP = 8192
"""``--max-seq-len``'s default: the model's context, capped at this. The engine caps ``max_seq_len`` at the model's
context when it loads the model (``runtime``), so the CLI asks for this cap and the model's config decides; a
larger context is opt-in, as its KV pool's floor (one whole sequence) grows with it."""


@dataclass(frozen=True)
class EngineFlag:
    """One engine flag: the ``EngineConfig`` field it sets (the flag's dest) and its names, the long one first, then
    vLLM's and llama.cpp's for the same setting. Its type, choices, default and help come from the field."""

    field: str
    names: tuple[str, ...]
    metavar: str | None = None
    help: str | None = None


ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("model", ("--model",), help=f"a model name (see `tickloom models`), a checkpoint directory, a .gguf "
                                           f"file, a Hugging Face org/name in the local Hugging Face cache (offline), "
                                           f"or 'stub' (default {DEFAULT_MODEL})"),
    EngineFlag("device", ("--device",), help="torch device: cpu, cuda, cuda:N (default cpu)"),
    EngineFlag("dtype", ("--dtype",), help="model dtype (default: float32 on CPU, bfloat16 on CUDA; a quantized GGUF "
                                           "on a CPU with native bfloat16: bfloat16 with --quant int4)"),
    EngineFlag("quant", ("--quant",), help="weight-only quantization on CPU: int8 per channel, int4 in groups of 32 (a "
                                           "GGUF's Q4_0/Q4_1/Q4_K blocks as they are, its 5- to 8-bit ones as int8 "
                                           "per group); none: the --dtype weights (default: the model's)"),
    EngineFlag("chat_template", ("--chat-template",), "TEMPLATE",
               help="a Jinja chat template replacing the model's: a file's path or the template itself, as vLLM's "
                    "(default: the model's)"),
    EngineFlag("max_seq_len", ("--max-seq-len", "--max-model-len", "-c", "--ctx-size"), "N",
               help=f"prompt + output tokens of one sequence at most (default: the model's context, at most "
                    f"{MAX_SEQ_LEN_CAP}; the stub's: 2048)"),
    EngineFlag("max_batch_size", ("--max-batch-size", "--max-num-seqs", "-np", "--parallel"), "N"),
    EngineFlag("max_batch_tokens", ("--max-batch-tokens", "--max-num-batched-tokens"), "N"),
    EngineFlag("max_prefill_tokens", ("--max-prefill-tokens",), "N"),
    EngineFlag("threads", ("--threads", "-t"), "N"),
    EngineFlag("tensor_parallel_size", ("--tensor-parallel-size", "-tp"), "N",
               help="shard the model over N ranks: this process and N-1 worker processes (gloo on cpu, one GPU each "
                    "on cuda; default 1)"),
    EngineFlag("num_blocks", ("--num-blocks",), "N"),
    EngineFlag("kv_memory_bytes", ("--kv-memory-bytes",), "BYTES"),
    EngineFlag("block_size", ("--block-size",), "N"),
    EngineFlag("prefix_caching", ("--prefix-caching", "--enable-prefix-caching")),
    EngineFlag("max_waiting", ("--max-waiting",), "N"),
    EngineFlag("overload", ("--overload",)),
    EngineFlag("speculative_tokens", ("--speculative-tokens", "--num-speculative-tokens", "--draft-max"), "K",
               help="speculative decoding: propose and verify up to K tokens per decode row (default 0: off); the "
                    "tokens are the same as without it"),
    EngineFlag("speculative_proposer", ("--speculative-proposer",)),
    EngineFlag("stub_step_time", ("--stub-step-time",), "SECONDS"),
)
"""The engine flags every engine-building command takes (``generate``, ``chat``, ``serve``, ``fleet``)."""


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine flags (``ENGINE_FLAGS``), in an "engine" group. A flag not given is None: ``EngineConfig``'s
    default applies (``--model``: ``DEFAULT_MODEL``)."""
    import msgspec

    from tickloom.config import EngineConfig

    schema = msgspec.json.schema(EngineConfig)["$defs"]["EngineConfig"]["properties"]
    info = msgspec.inspect.type_info(EngineConfig)
    assert isinstance(info, msgspec.inspect.StructType)
    fields = {f.name: f for f in info.fields}
    group = parser.add_argument_group("engine", "how the engine is built (vLLM's and llama.cpp's names are aliases)")
    for flag in ENGINE_FLAGS:
        kind = _plain_type(fields[flag.field].type)
        default = fields[flag.field].default
        described = str(schema[flag.field].get("description", "")).rstrip(".")
        if described[1:2].islower():
            described = described[:1].lower() + described[1:]
        help_text = flag.help or described + ("" if default is None else f" (default {default})")
        options: dict[str, Any] = {"dest": flag.field, "default": DEFAULT_MODEL if flag.field == "model" else None,
                                   "help": help_text.replace("%", "%%")}
        if isinstance(kind, msgspec.inspect.BoolType):
            group.add_argument(*flag.names, action=argparse.BooleanOptionalAction, **options)
            continue
        if isinstance(kind, msgspec.inspect.LiteralType):
            options["choices"] = list(kind.values)
        else:
            options["type"] = {msgspec.inspect.IntType: int, msgspec.inspect.FloatType: float}.get(type(kind), str)
            options["metavar"] = flag.metavar
        group.add_argument(*flag.names, **options)


def _plain_type(kind: Any) -> Any:
    """A field's type without ``| None`` and its ``Meta`` wrappers."""
    import msgspec

    while True:
        if isinstance(kind, msgspec.inspect.Metadata):
            kind = kind.type
        elif isinstance(kind, msgspec.inspect.UnionType):
            kind = next(t for t in kind.types if not isinstance(t, msgspec.inspect.NoneType))
        else:
            return kind


def add_model_arguments(parser: argparse.ArgumentParser, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                        temperature: float = 0.7, chat_flag: bool = True, log: bool = True) -> None:
    """The engine flags, then the sampling flags and ``--log`` that ``generate``, ``chat`` and ``fleet`` share."""
    add_engine_arguments(parser)
    parser.add_argument("--max-tokens", "-n", type=int, default=max_tokens,
                        help=f"tokens to generate per reply at most (default {max_tokens})")
    parser.add_argument("--temperature", type=float, default=temperature,
                        help=f"sampling temperature; 0 is greedy (default {temperature})")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling seed (prompt i uses SEED + i); default: the engine picks and logs one")
    if log:
        parser.add_argument("--log", metavar="PATH", default=None,
                            help="write the engine's log here (replay it with `tickloom replay PATH`)")
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="no progress lines on stderr (model loading and conversion)")
    if chat_flag:
        parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                            help="wrap prompts as chat messages (default: on when the model has a chat template, "
                                 "or --chat-template is given)")


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
    """A usage error if ``model`` is neither a model name, an existing .gguf file or directory with a config.json,
    nor an ``org/name`` in the local Hugging Face cache (what is wrong inside one is found while loading: exit
    65)."""
    from tickloom.engine.model.registry import available_models, hf_cached_snapshot, unknown_model
    from tickloom.tools.cli import CliError

    names = [m.name for m in available_models()] + ["stub"]
    if model in names:
        return
    path = Path(model).expanduser()
    if not path.exists():
        if hf_cached_snapshot(model) is not None:
            return
        raise CliError(f"cannot load model {model!r}: no such file or directory; {unknown_model(model)}")
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


def engine_config(args: argparse.Namespace, **fields: Any) -> EngineConfig:
    """The ``EngineConfig`` of the engine flags given (plus ``fields``, e.g. ``log_path``); a bad value is a usage
    error naming the field."""
    from tickloom import ConfigError, EngineConfig
    from tickloom.tools.cli import CliError

    check_model_options(args.model, args.device, args.dtype)
    if getattr(args, "max_tokens", 1) < 1:
        raise CliError("--max-tokens must be at least 1")
    if args.stub_step_time is not None and args.model != "stub":
        raise CliError("--stub-step-time needs --model stub")
    given = {flag.field: getattr(args, flag.field) for flag in ENGINE_FLAGS if getattr(args, flag.field) is not None}
    if args.max_seq_len is None and args.model != "stub":
        given["max_seq_len"] = MAX_SEQ_LEN_CAP  # capped at the model's context when the engine loads it
    if "log_path" not in fields and getattr(args, "log", None) is not None:
        fields["log_path"] = args.log
    try:
        return EngineConfig(**given, **fields)
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

