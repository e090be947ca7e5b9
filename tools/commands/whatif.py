"""``tickloom whatif LOG --set KEY=VALUE ...``: re-simulate a log's requests under another core configuration and
compare the original run with the what-if side by side (``replay/whatif.py`` says how).

With ``--validate`` the log's arrivals are also re-run for real under the changed configuration, and the prediction
is printed against the measurement (``tools/commands/_whatif_validate.py``; for a model's log, the prediction is
made from a baseline re-run of the log's arrivals under its own configuration just before, ``--baseline``, and
``--rounds N`` repeats the pair).

Exit status: 0 done; 1 a what-if with the log's own configuration did not reproduce the log's decisions; 2 the
log cannot be read; 64 usage errors (an unknown ``--set`` key, a bad value, a configuration the core rejects, a
``--validate`` the log cannot be re-run for, ``--step-model calibration`` without a stored profile).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import msgspec

from tickloom.engine.core import CoreConfig
from tickloom.engine.core.errors import ConfigError
from tickloom.replay.header import ReplayConfigError, check_core_limits

if TYPE_CHECKING:
    from tickloom.replay.whatif import WhatIfResult
    from tickloom.replay.whatif_measure import RunMetrics

NAME = "whatif"
HELP = "re-simulate a log's requests under another core configuration and compare"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", help="the log file, or a fleet directory (or its router.log): then --set changes "
                                    "the router (policy, replicas, load_slack, affinity_blocks, cache_blocks)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a core configuration field to change (repeatable), e.g. num_blocks=512")
    parser.add_argument("--modelled", action="store_true",
                        help="model step times even when the configuration is the log's own (to judge the model)")
    parser.add_argument("--step-model", choices=("auto", "log", "calibration"), default="auto",
                        help="the step-time model: the log's own fit, the stored calibration profile "
                             "(`tickloom bench calibrate`), or auto: the log's when its steps span the what-if's")
    parser.add_argument("--validate", action="store_true",
                        help="also re-run the log's arrivals for real under the changed configuration (the log's "
                             "model, or the stub) and print predicted against measured")
    parser.add_argument("--baseline", choices=("auto", "rerun", "log"), default="auto",
                        help="with --validate, what the prediction is made from: rerun: the log's arrivals re-run "
                             "under its own configuration right before the changed run (both real runs then share "
                             "the host's speed of the moment); log: the log as recorded; auto (default): rerun for "
                             "a model's log, log for the stub's (virtual time)")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="with --validate, repeat the real runs N times and compare each figure's median "
                             "(a shared host's load comes and goes)")
    parser.add_argument("--plot", metavar="PNG", help="also plot both runs' latency distributions to PNG")
    parser.add_argument("--json", action="store_true", help="print the comparison as one JSON object")


class OverrideError(ValueError):
    """A bad ``--set``: one line naming the key."""


def apply_overrides(base: CoreConfig, pairs: Sequence[str]) -> CoreConfig:
    """``base`` with each ``KEY=VALUE`` applied, validated by the core's own checks and replay's size limits;
    raises ``OverrideError`` (one line naming the key)."""
    fields = {f.name: f.type for f in msgspec.structs.fields(CoreConfig)}
    values = msgspec.structs.asdict(base)
    for pair in pairs:
        key, raw = split_override(pair)
        values[key] = _parse_value(key, raw, fields[key])
    try:
        return check_core_limits(CoreConfig(**values))
    except (ConfigError, ReplayConfigError) as exc:
        raise OverrideError(f"--set: {exc}") from exc


def split_override(pair: str) -> tuple[str, str]:
    """``(key, value)`` of ``KEY=VALUE``, the key a core configuration field; raises ``OverrideError``."""
    key, sep, raw = pair.partition("=")
    key = key.strip()
    if not sep or not key:
        raise OverrideError(f"--set {pair!r}: expected KEY=VALUE")
    if key not in CoreConfig.__struct_fields__:
        raise OverrideError(f"--set {key}: not a core configuration field (the fields: "
                            f"{', '.join(CoreConfig.__struct_fields__)})")
    return key, raw.strip()


def _parse_value(key: str, raw: str, kind: object) -> object:
    """``raw`` as JSON (``512``, ``true``, ``null`` or ``none``), as a comma-separated list for a tuple field
    (``2,3``), or as the string itself; then checked against the field's type."""
    value: object
    if raw.lower() in ("none", "null"):
        value = None
    else:
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
    if str(kind).startswith("tuple") and not isinstance(value, list):
        value = [_number(part) for part in raw.split(",") if part.strip()]
    try:
        return msgspec.convert(value, type=kind, strict=True)
    except msgspec.ValidationError as exc:
        raise OverrideError(f"--set {key}={raw}: {exc}") from exc


def _number(text: str) -> object:
    try:
        return int(text)
    except ValueError:
        return text.strip()


def run(args: argparse.Namespace) -> int:
    from tickloom.events import LogError
    from tickloom.replay.whatif import read_log, whatif
    from tickloom.tools.cli import CliError
    from tickloom.tools.commands.replay import log_input_problem

    problem = log_input_problem(args.log)  # missing, a directory that is not a fleet's, no permission: exit 2
    if problem is not None:
        return _unreadable(args, problem)
    if os.path.isdir(args.log) or _is_router_log(args.log):  # a fleet: re-routed (tickloom.fleet.whatif)
        from tickloom.tools.commands._fleet_replay import run_fleet_whatif

        return run_fleet_whatif(args)
    try:
        for pair in args.sets:  # an unknown key is a usage error even before the log is read
            split_override(pair)
    except OverrideError as exc:
        raise CliError(str(exc)) from exc
    if args.plot:
        _matplotlib()  # before the run: a missing matplotlib is a usage error, found at once
    try:
        logged = read_log(args.log)
    except (LogError, ReplayConfigError) as exc:
        return _unreadable(args, str(exc))
    try:
        config = apply_overrides(logged.config, args.sets)
    except OverrideError as exc:
        raise CliError(str(exc)) from exc
    try:
        result = whatif(args.log, config, modelled=args.modelled, run=logged, step_model=args.step_model)
    except ValueError as exc:  # --step-model calibration without a profile
        raise CliError(f"--step-model: {exc}") from exc
    report = None
    if args.validate:
        from tickloom.tools.commands._whatif_validate import ValidateError, validate

        try:
            report = validate(args.log, result, logged, baseline=args.baseline, rounds=args.rounds,
                              step_model=args.step_model)
        except ValidateError as exc:
            raise CliError(str(exc)) from exc
    if args.json:
        out = result.to_json()
        if report is not None:
            out["validate"] = report.to_json()
        print(json.dumps(out))
    else:
        print(format_table(result))
        if report is not None:
            print()
            print(report.format_text())
    if args.plot:
        write_plot(result, args.plot)
        if not args.json:
            print(f"plot: {args.plot}")
    return 1 if result.divergence else 0


def _is_router_log(path: str) -> bool:
    from tickloom.fleet.router_log import is_router_log

    return is_router_log(path)


def _unreadable(args: argparse.Namespace, error: str) -> int:
    if args.json:
        print(json.dumps({"status": "unreadable", "error": error}))
    else:
        print(f"unreadable: {error}")
    return 2


# -- the table ------------------------------------------------------------------------------------------------
def _rows(m: RunMetrics) -> list[tuple[str, str]]:
    s = m.summary()

    def ms(key: str) -> str:
        value = s[key]
        return "-" if value is None else f"{value:.3f}"

    rows = [("requests", str(m.requests)), ("finished", str(len(m.reasons))), ("completion tokens",
            str(m.completion_tokens)), ("duration (s)", f"{m.duration_ns / 1e9:.3f}"),
            ("throughput (tok/s)", f"{m.throughput:.1f}")]
    rows += [(f"TTFT p{q} (ms)", ms(f"ttft_ms_p{q}")) for q in (50, 90, 99)]
    rows += [(f"inter-token p{q} (ms)", ms(f"itl_ms_p{q}")) for q in (50, 90, 99)]
    rows += [("preemptions", str(m.preemptions)), ("  requeued", str(m.requeues)), ("  swapped out", str(m.swaps)),
             ("swap-ins", str(m.swap_ins)), ("timeouts", str(s["timeouts"]))]
    return rows


def format_table(result: WhatIfResult) -> str:
    """The side-by-side comparison, original (what the log says happened) vs what-if."""
    changes = ", ".join(f"{k} {was} -> {now}" for k, (was, now) in result.changes.items()) or "none"
    lines = [f"what-if of {result.path} ({result.mode}, {result.ticks} ticks)", f"  set: {changes}", ""]
    if result.divergence:
        lines[1:1] = [f"  DIVERGED from the log at {result.divergence}: the what-if column stops there"]
    original, whatif = dict(_rows(result.original)), dict(_rows(result.whatif))
    reasons = sorted({*result.original.finish_reasons, *result.whatif.finish_reasons})
    for reason in reasons:
        original[f"finished: {reason}"] = str(result.original.finish_reasons.get(reason, 0))
        whatif[f"finished: {reason}"] = str(result.whatif.finish_reasons.get(reason, 0))
    spread = _intervals(result)
    width = max(len(k) for k in original)
    lines.append(f"{'':<{width}}  {'original':>12}  {'what-if':>12}" + (f"  {'interval':>19}" if spread else ""))
    lines += [f"{k:<{width}}  {v:>12}  {whatif[k]:>12}" + (f"  {spread.get(k, ''):>19}" if spread else "")
              for k, v in original.items()]
    if result.mode == "modelled":
        m = result.model
        lines += ["", f"step model: {m.source} ({m.why}); valid for {m.describe_range()}"]
        ext = result.extrapolation
        if ext is not None and result.extrapolated:
            lines.append(f"EXTRAPOLATED: {ext.outside} of the what-if's {ext.steps} steps ({ext.fraction:.0%}) lie "
                         "outside that range: the figures above are a guess")
    oracle = sum(result.oracle_tokens.values())
    lines += ["", "tokens: every token the what-if's clients received is the log's" if not oracle else
              f"tokens: {oracle} tokens the log never had came from the oracle"]
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)


def _intervals(result: WhatIfResult) -> dict[str, str]:
    """Table row -> its interval's text, for the figures that have one."""
    rows = {"throughput_tok_s": "throughput (tok/s)", "duration_s": "duration (s)",
            **{f"{what}_ms_p{q}": f"{label} p{q} (ms)" for what, label in (("ttft", "TTFT"), ("itl", "inter-token"))
               for q in (50, 90, 99)}}
    digits = {"throughput_tok_s": 1}
    return {rows[k]: f"{lo:.{digits.get(k, 3)}f}-{hi:.{digits.get(k, 3)}f}" for k, (lo, hi) in
            result.intervals.items() if k in rows}


# -- the plot -------------------------------------------------------------------------------------------------
def _matplotlib() -> ModuleType:
    from tickloom.tools.cli import CliError

    try:
        import matplotlib
    except ImportError as exc:
        raise CliError("install tickloom[plot] for --plot (matplotlib is not installed)") from exc
    return matplotlib


def write_plot(result: WhatIfResult, out: str | os.PathLike[str]) -> None:
    """Both runs' TTFT and inter-token latency distributions (empirical CDFs) as a PNG."""
    _matplotlib().use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    try:
        for ax, what, title in ((axes[0], "ttft_ns", "time to first token"),
                                (axes[1], "itl_ns", "inter-token latency")):
            for label, m in (("original", result.original), ("what-if", result.whatif)):
                values = sorted(v / 1e6 for v in getattr(m, what))
                if values:
                    ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                            label=f"{label} ({len(values)})")
            ax.set_title(title)
            ax.set_xlabel("ms")
            ax.set_ylabel("fraction")
            ax.grid(True, alpha=0.3)
            ax.legend(loc="lower right", fontsize="small")
        changes = ", ".join(f"{k}={now}" for k, (_, now) in result.changes.items()) or "own configuration"
        fig.suptitle(f"{os.path.basename(result.path)}: original vs what-if ({changes})")
        fig.tight_layout()
        fig.savefig(out, dpi=80)
    finally:
        plt.close(fig)
