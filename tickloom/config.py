"""``EngineConfig``: the core's scheduling knobs (declared once, in ``engine.core.config.SchedulingKnobs``), then the
model, the device, the KV pool, spill, the log, the stub model and faults."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from tickloom.engine.core import ConfigError
from tickloom.engine.core.config import BlockCount, SchedulingKnobs
from tickloom.events.types import FLOAT_MAX, INT64_MAX
from tickloom.validation import checked

Bytes = Annotated[int, Meta(ge=0, le=2**48)]
Seconds = Annotated[float, Meta(ge=0.0, le=FLOAT_MAX)]
PathStr = Annotated[str, Meta(min_length=1, max_length=4096)]
Actor = Literal["step", "device", "deadlines", "retire", "spill", "swap-in", "log"]


class _FaultFields(msgspec.Struct, frozen=True, kw_only=True):
    fail_steps: list[Annotated[int, Meta(ge=0, le=INT64_MAX)]] = []
    """Step ids the device reports as failed."""
    fail_spill: list[str] = []
    """Request ids whose spill write fails."""
    fail_swap_in: list[str] = []
    """Request ids whose swap-in read fails."""
    crash_actor: Actor | None = None
    """An actor name ("deadlines", "retire", "spill", "swap-in", "log") that raises after ``crash_after`` s."""
    crash_after: Seconds = 0.0
    report_delay: Seconds = 0.0
    """Seconds the retire actor's reports (stop matches, clients gone) are held back: a late-noticed match."""
    stub_extras: Annotated[int, Meta(ge=0, le=64)] = 0
    """The stub device accepts up to this many extra tokens after a row's sampled one, as a constraint's forced
    tokens come (the oracle's own next tokens, so no output changes): the extra-token path under any timing."""


class FaultPlan(_FaultFields, frozen=True, kw_only=True):
    """Faults to inject, for tests and chaos runs. Each is logged like any other input, so the run replays.

    Invalid values raise ``ConfigError`` naming the field.
    """

    def __post_init__(self) -> None:
        _normalise(self, checked(msgspec.structs.asdict(self), _FaultFields, "FaultPlan", ConfigError))


class _EngineFields(SchedulingKnobs, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The engine's own fields; the scheduling knobs (``SchedulingKnobs``) come first, declared in the core."""

    model: Annotated[PathStr, Meta(
        description="A bundled model's name (smollm2-135m), a Hugging Face directory, a .gguf file, an org/name in "
                    "the local Hugging Face cache, or stub (the core's oracle: tests, benchmarks).")] = "smollm2-135m"
    dtype: Annotated[Literal["float32", "float64", "float16", "bfloat16"] | None, Meta(
        description="None: float32 on CPU, bfloat16 on CUDA; the bundled model on a CPU with native bfloat16 (with "
                    "quant also None) runs bfloat16 with int4 weights.")] = None
    quant: Annotated[Literal["none", "int8", "int4"] | None, Meta(
        description="Weight-only quantization (CPU): int8 per output channel, or int4 in groups of 32 (a GGUF's "
                    "Q4_0/Q4_1/Q4_K blocks as they are, its 5- to 8-bit blocks as int8 per group; the LM head stays "
                    "int8). None: the model's default.")] = None
    chat_template: Annotated[Annotated[str, Meta(min_length=1, max_length=1 << 20)] | None, Meta(
        description="A Jinja chat template replacing the model's: a file's path, or the template itself (text with "
                    "{, } or a newline in it), as vLLM's --chat-template; stored as the template's text. None: the "
                    "model's own.")] = None
    device: Annotated[str, Meta(min_length=1, max_length=64, description="A torch device.")] = "cpu"
    threads: Annotated[Annotated[int, Meta(ge=1, le=4096)] | None, Meta(
        description="torch threads; None: torch's default.")] = None
    tensor_parallel_size: Annotated[int, Meta(
        ge=1, le=64, description="Ranks the model is sharded over (Megatron-style: attention by heads, the MLP by "
                                 "channels): rank 0 in this process, the others in worker processes the engine "
                                 "starts and stops; gloo on cpu, nccl on one cuda device per rank. The model's "
                                 "heads, kv heads and intermediate size must divide by it; not with the stub model "
                                 "or spill. kv_memory_bytes is per rank; on cpu, threads=None gives each rank its "
                                 "share of the cores.")] = 1
    num_blocks: Annotated[BlockCount | None, Meta(
        description="KV blocks in the pool; None derives them from kv_memory_bytes.")] = None
    kv_memory_bytes: Annotated[int, Meta(ge=1, le=2**48, description="The KV pool's size in bytes, when "
                                                                     "num_blocks is None.")] = 256 << 20
    overload: Annotated[Literal["wait", "reject"], Meta(
        description="With max_waiting requests open, submit waits (wait) or raises EngineOverloaded "
                    "(reject).")] = "wait"
    spill_dir: Annotated[PathStr | None, Meta(
        description="A spill store's disk tier (a private subdirectory is made in it). Spill is on when this is "
                    "set or host_spill_bytes > 0.")] = None
    host_spill_bytes: Annotated[Bytes, Meta(description="The spill store's host tier, in bytes.")] = 0
    log_path: Annotated[PathStr | None, Meta(
        description="The log to create (never overwritten); None: no log.")] = None
    fsync: Annotated[str, Meta(pattern="^(never|tick|[1-9][0-9]{0,8}ms)$",
                               description="never, tick or <N>ms: what a machine crash may lose.")] = "never"
    snapshot_every: Annotated[int, Meta(ge=0, le=2**31, description="Ticks between core snapshots in the log "
                                                                    "(0: none).")] = 0
    max_constraint_chars: Annotated[int, Meta(
        ge=1, le=1 << 20, description="A structured-output constraint's text (schema, regex, grammar, choices) at "
                                      "most this many characters; a longer one is refused at submit.")] = 1 << 20
    max_constraint_grammar_size: Annotated[int, Meta(
        ge=100, le=10_000_000, description="Symbols a constraint's compiled grammar may hold (llguidance's "
                                           "max_grammar_size): bounds each constraint's compile time and memory; "
                                           "a larger one is refused at submit.")] = 100_000
    speculative_proposer: Annotated[Literal["prompt_lookup", "draft"], Meta(
        description="What fills the proposal slots when speculative_tokens > 0: prompt_lookup proposes what followed "
                    "the request's last 3 (or 2, or 1: then one token) tokens where they occurred before in its prompt "
                    "or output; draft "
                    "decodes greedily with speculative_draft_model. The stub model accepts a stable pseudo-random "
                    "share instead. Logged in the header.")] = "prompt_lookup"
    speculative_draft_model: Annotated[Annotated[str, Meta(min_length=1, max_length=4096)] | None, Meta(
        description="The draft proposer's model, with the target's vocabulary; None: the target's own weights, "
                    "quantized by speculative_draft_quant.")] = None
    speculative_draft_quant: Annotated[Literal["none", "int8", "int4"], Meta(
        description="The draft model's weight quantization.")] = "int4"
    stub_vocab_size: Annotated[int, Meta(ge=96, le=2**20, description="The stub model's vocabulary.")] = 96
    stub_step_time: Annotated[float, Meta(
        ge=0.0, le=3600.0, description="Seconds per step of the stub model (virtual time under MockClock).")] = 0.01
    faults: Annotated[FaultPlan | None, Meta(description="Faults to inject (FaultPlan).")] = None

    @property
    def spill_enabled(self) -> bool:
        return self.spill_dir is not None or self.host_spill_bytes > 0


class EngineConfig(_EngineFields, frozen=True, kw_only=True):
    """How to build an engine. ``model="stub"`` runs the core's oracle instead of a model (tests, benchmarks).

    Every field is checked for type and range when the config is made (``msgspec.convert`` against the bounds
    declared on the fields); a bad one raises ``ConfigError`` naming it, e.g.
    ``EngineConfig: Expected `int` >= 1 - at `$.block_size```.
    """

    def __post_init__(self) -> None:
        fields: _EngineFields = checked(msgspec.structs.asdict(self), _EngineFields, "EngineConfig", ConfigError)
        fields.check_knob_relations("EngineConfig")
        from tickloom.actors.log import parse_fsync

        try:
            parse_fsync(fields.fsync)
        except ValueError as exc:
            raise ConfigError(f"EngineConfig.{exc}") from None
        _check_tensor_parallel(fields)
        fields = _with_chat_template_text(fields)
        _normalise(self, fields)


def _check_tensor_parallel(fields: _EngineFields) -> None:
    """What tensor parallelism cannot run, known from the config alone (the model's shapes are checked at open)."""
    world = fields.tensor_parallel_size
    if world == 1:
        return
    if fields.model == "stub":
        raise ConfigError(f"EngineConfig.tensor_parallel_size={world}: the stub model has no weights to shard; "
                          "use tensor_parallel_size=1 with model='stub'")
    if fields.spill_enabled:
        raise ConfigError(f"EngineConfig.tensor_parallel_size={world}: KV spill (spill_dir, host_spill_bytes) is not "
                          "supported with tensor parallelism (each rank holds a shard of the KV cache); turn spill "
                          "off or use tensor_parallel_size=1")
    if fields.speculative_tokens:
        raise ConfigError(f"EngineConfig.tensor_parallel_size={world}: speculative decoding (speculative_tokens="
                          f"{fields.speculative_tokens}) does not run on tensor-parallel ranks yet; set "
                          "speculative_tokens=0 or use tensor_parallel_size=1")


def _with_chat_template_text(fields: _EngineFields) -> _EngineFields:
    """``chat_template`` as the template's text, read (if it names a file) and compiled once, here: the config and
    its log header hold the template that was used, and a fleet's replicas need no file. A template that cannot be
    read or does not compile is a ``ConfigError`` naming the field."""
    source = fields.chat_template
    if source is None:
        return fields
    shown = source if len(source) <= 60 else source[:57] + "..."
    if fields.model == "stub":
        raise ConfigError(f"EngineConfig.chat_template={shown!r}: the stub model renders chats its own way "
                          "(<role>content); a chat template needs a model with a tokenizer")
    from tickloom.engine.model.tokenizer import load_chat_template

    try:
        text = load_chat_template(source)
    except ValueError as exc:
        raise ConfigError(f"EngineConfig.chat_template={shown!r}: {exc}") from None
    return msgspec.structs.replace(fields, chat_template=text)


def _normalise(target: msgspec.Struct, fields: msgspec.Struct) -> None:
    """Store the converted values (plain ints and floats, the config's own list copies) in the frozen struct."""
    for field in msgspec.structs.fields(fields):
        value = getattr(fields, field.name)
        if getattr(target, field.name) is not value:
            msgspec.structs.force_setattr(target, field.name, value)


def configuration_table() -> str:
    """The README's configuration table (Markdown), rendered from the declarations: each field of ``EngineConfig``
    with its default, its bound and its meaning; the scheduling knobs (``SchedulingKnobs``) first, marked *core*
    (they reach the core and its log header as they are)."""
    schema = msgspec.json.schema(EngineConfig)
    fields = schema["$defs"]["EngineConfig"]["properties"]
    rows = ["| field | default | bound | meaning |", "|---|---|---|---|"]
    for name, field in fields.items():
        label = f"`{name}` (core)" if name in SchedulingKnobs.__struct_fields__ else f"`{name}`"
        default = "required" if "default" not in field else f"`{_json_value(field['default'])}`"
        cells = [label, default, _bound(field), str(field.get("description", ""))]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


def _bound(field: dict[str, object]) -> str:
    """A JSON schema's constraint, in words: ``1–4096``, ``1 or 2``, ``None or 0–2**31-1``..."""
    options = field.get("anyOf")
    if isinstance(options, list):
        parts = [_bound(option) for option in options if option.get("type") != "null"]
        nullable = len(parts) < len(options)
        return ("None or " if nullable else "") + " or ".join(parts)
    if "enum" in field:
        values = field["enum"]
        assert isinstance(values, list)
        return " or ".join(f"`{_json_value(v)}`" for v in values)
    if "$ref" in field:
        return str(field["$ref"]).rsplit("/", 1)[-1]
    if field.get("type") == "string":
        if "pattern" in field:
            return f"matches `{field['pattern']}`"
        return f"{field.get('minLength', 0)}–{field.get('maxLength')} characters"
    if field.get("type") in ("integer", "number"):
        return f"{_number(field.get('minimum'))}–{_number(field.get('maximum'))}"
    return "true or false" if field.get("type") == "boolean" else str(field.get("type", "any"))


def _number(value: object) -> str:
    if isinstance(value, int) and value >= 2**16:
        for exponent in range(16, 64):
            if value in (2**exponent, 2**exponent - 1):
                return f"2**{exponent}" + ("" if value == 2**exponent else "-1")
    return str(value)


def _json_value(value: object) -> str:
    return "None" if value is None else msgspec.json.encode(value).decode()
