"""The race explorer's core level (``tools.explore.core`` through the driver; ``tickloom explore [LOG]``).

* each deliberately broken core variant (``tools.explore.variants``) is found within 2,000 seeds by the explorer's
  own loop and shrunk to a 1-minimal script; its kept log reproduces it on the variant (``replay --bisect`` for
  invariants, the bisect with the stranding check for stranding, the clients' check on the log for client-visible
  rules), while the real code diverges from that log; its replay token re-runs it; the printed regression test fails
  on the variant and passes on the real code;
* one seed gives one run: the same seed twice writes byte-identical logs, and so does the run re-played from its
  moved events alone, whatever ``PYTHONHASHSEED`` is;
* the real code, with faults, shows no violation (a few hundred seeds here; 10,000 in the slow test), also around a
  real recorded log's workload;
* the core level needs no trio.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from scenarios import everything_scenario

from tickloom.replay import bisect, verify
from tickloom.tools.cli import main as cli_main
from tickloom.tools.explore.checks import StrandCheck, check_client_log
from tickloom.tools.explore.core import (
    CLIENT_KINDS,
    CORE,
    STRAND_TICKS,
    Arrive,
    Leave,
    StopAt,
    default_run,
    log_workload,
    random_workload,
    run_workload,
)
from tickloom.tools.explore.core_schedule import strategy_policy
from tickloom.tools.explore.driver import (
    STRATEGIES,
    Token,
    ddmin,
    decode_token,
    encode_token,
    explore,
    regression_test,
)
from tickloom.tools.explore.levels import replay_token
from tickloom.tools.explore.variants import VARIANTS, enabled

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"^explored (\d+) seeds? \(core\) in [0-9.]+ s: [0-9.]+ seeds/s, (\d+) violations?$")

KINDS = {
    # variant: the kinds of violation that catch it
    "fence": {"invariant"},
    "preempt-unsettled": {"invariant"},
    "swapped-deadline": {"deadline"},
    "swap-in-no-reclaim": {"stranded", "liveness"},
    "stream-overrun": {"ending", "overrun"},
    "stop-loses": {"stop"},
}


def test_every_variant_is_listed() -> None:
    assert set(KINDS) == set(VARIANTS["core"])


@pytest.mark.parametrize("variant", sorted(VARIANTS["core"]))
def test_each_broken_variant_is_found_shrunk_and_reproduced(tmp_path: Path, variant: str) -> None:
    exploration = explore(CORE, range(2000), variant=variant, out=tmp_path)
    found = exploration.found
    assert found is not None, f"{variant}: not found in 2,000 seeds"
    assert exploration.seeds == found.seed + 1 <= 2000, "stops at the first violation"
    kind = found.violation.kind
    assert kind == found.original.kind and kind in KINDS[variant], found
    assert 1 <= len(found.keep) <= found.actions and len(found.edits) <= found.moved
    print(f"{variant}: seed {found.seed}, {found.actions} -> {len(found.keep)} actions, {found.moved} -> "
          f"{len(found.edits)} moved events: {found.violation}")

    workload = random_workload(found.seed)
    with enabled(variant):
        for drop in found.keep:  # 1-minimal: every kept action is needed
            rest = [i for i in found.keep if i != drop]
            again = default_run(workload.subset(rest), found.edits).violation
            assert again is None or again.kind != kind, f"{variant}: action {drop} is not needed"

        # The kept log, on the variant: it replays, and it shows the violation at the same tick.
        log = found.log
        assert log is not None and log.parent == tmp_path and log.exists()
        assert verify(log).status == "identical"
        if kind == "invariant":
            report = bisect(log)
            assert report.status == "violation" and report.first_divergent_tick == found.violation.tick, report
            assert cli_main(["replay", "--bisect", str(log)]) == 1
        elif kind == "stranded":
            report = bisect(log, StrandCheck(STRAND_TICKS))
            assert report.status == "violation" and report.first_divergent_tick == found.violation.tick, report
        if kind in CLIENT_KINDS:
            assert check_client_log(log) == found.violation
    # The real code disagrees with the log: it diverges no later than the violation.
    real = verify(log)
    assert real.status == "divergent" and real.first_divergent_tick is not None
    assert real.first_divergent_tick <= found.violation.tick, (real.first_divergent_tick, found.violation)
    print(f"  real code: replay {real.status} at tick {real.first_divergent_tick}; replay --bisect "
          f"{bisect(log).format_text().splitlines()[0]}")

    token = decode_token(found.token)
    assert (token.seed, token.strategy, token.faults, token.variant, token.keep) == (
        found.seed, "random", False, variant, found.keep)
    assert cli_main(["explore", "--replay", found.token]) == 1, "the token re-runs the violation"
    assert replay_token(found.token) is None, "on the real code the token's run is clean"

    text = regression_test(found)
    name = f"test_explore_core_seed_{found.seed}_random"
    namespace: dict[str, object] = {}
    exec(compile(text, "<regression>", "exec"), namespace)
    regression = namespace[name]
    assert callable(regression)
    with enabled(variant), pytest.raises(AssertionError, match=kind):
        regression()
    regression()  # passes on the real code


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_same_seed_twice_writes_byte_identical_logs(tmp_path: Path, strategy: str) -> None:
    for seed, faults in ((3, False), (17, True), (100, True)):
        workload = random_workload(seed)
        logs = [tmp_path / f"{seed}-{n}.tlog" for n in range(3)]
        first = run_workload(workload, strategy_policy(seed, strategy, faults, workload.config), log=logs[0])
        second = run_workload(workload, strategy_policy(seed, strategy, faults, workload.config), log=logs[1])
        assert first.violation is None and second.violation is None, (first.violation, second.violation)
        assert first.edits == second.edits and first.ticks == second.ticks > 0
        # The moved events alone, the prompt default answering the rest, re-play the same run.
        replayed = default_run(workload, first.edits, log=logs[2])
        assert replayed.violation is None and replayed.ticks == first.ticks
        data = logs[0].read_bytes()
        assert logs[1].read_bytes() == data and logs[2].read_bytes() == data, f"seed {seed} ({strategy})"


def test_the_log_does_not_depend_on_the_hash_seed(tmp_path: Path) -> None:
    code = ("import hashlib, sys; from pathlib import Path; from tickloom.tools.explore.core import random_workload, "
            "run_workload; from tickloom.tools.explore.core_schedule import strategy_policy; p = Path(sys.argv[1]); "
            "w = random_workload(41); "
            "r = run_workload(w, strategy_policy(41, 'random', True, w.config), log=p); assert r.violation is None; "
            "print(hashlib.sha256(p.read_bytes()).hexdigest())")
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"h{hash_seed}.tlog")], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1, digests


def test_strategies_move_events_and_faults_inject_them() -> None:
    moved: dict[tuple[str, bool], set[str]] = {}
    for strategy in STRATEGIES:
        for faults in (False, True):
            kinds: set[str] = set()
            for seed in range(40):
                workload = random_workload(seed)
                result = run_workload(workload, strategy_policy(seed, strategy, faults, workload.config))
                assert result.violation is None, (strategy, faults, seed, result.violation)
                kinds |= {d.what for d in result.edits}
            moved[(strategy, faults)] = kinds
    assert {"delay", "device_steps", "arrange", "merge", "deadline_due"} <= moved[("random", False)]
    assert {"delay", "device_steps"} <= moved[("pct", False)] and {"delay", "device_steps"} <= moved[("delay", False)]
    for strategy in STRATEGIES:
        assert not {"step_fails", "spill_ok", "swap_in"} & moved[(strategy, False)]
        assert "step_fails" in moved[(strategy, True)], moved[(strategy, True)]
    assert "spill_ok" in set.union(*(moved[(strategy, True)] for strategy in STRATEGIES))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_real_code_with_faults_shows_no_violation(strategy: str) -> None:
    exploration = explore(CORE, range(120), strategy, faults=True)
    assert exploration.found is None, exploration.found
    assert exploration.seeds == 120 and exploration.logs == 2, "seeds 0 and 100 wrote and replayed their logs"


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "seeds"), [("random", 10_000), ("pct", 2_000), ("delay", 2_000)])
def test_many_seeds_with_faults_show_no_violation(strategy: str, seeds: int) -> None:
    exploration = explore(CORE, range(seeds), strategy, faults=True)
    print(exploration.summary())
    assert exploration.found is None, exploration.found
    assert exploration.seeds == seeds and exploration.logs == seeds // 100


def test_explore_a_recorded_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "everything.tlog"
    everything_scenario().record(log)
    workload = log_workload(log)
    arrivals = [a for a in workload.actions if isinstance(a, Arrive)]
    assert len(arrivals) == 14 and workload.config == everything_scenario().config
    assert [a.msg.request_id for a in workload.actions if isinstance(a, Leave)] == ["r12"]
    assert [(a.request_id, a.index) for a in workload.actions if isinstance(a, StopAt)] == [("r07", 3)]
    assert dict(next(a for a in arrivals if a.msg.request_id == "r09").tokens)[5] == 2, "the logged EOS"
    for strategy in STRATEGIES:
        assert cli_main(["explore", str(log), "--seeds", "40", "--faults", "--strategy", strategy]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        match = SUMMARY.match(last)
        assert match is not None and match.groups() == ("40", "0"), last


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["explore", "--seeds", "30", "--faults", "--strategy", "pct"]) == 0
    match = SUMMARY.match(capsys.readouterr().out.strip().splitlines()[-1])
    assert match is not None and match.groups() == ("30", "0")

    assert cli_main(["explore", "--seeds", "50", "--variant", "fence", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION at seed" in out and "fences" in out and "tickloom explore --replay tlc1-" in out
    assert "def test_explore_core_seed_" in out and "replay --bisect: violation at tick" in out
    match = SUMMARY.match(out.strip().splitlines()[-1])
    assert match is not None and match.groups()[1] == "1"

    for argv, message, status in ((["explore", "--variant", "nope"], "unknown variant 'nope' at the core level", 64),
                                  (["explore", "--replay", "tlc1-!!!"], "not a replay token", 64),
                                  (["explore", str(tmp_path / "missing.tlog")], "cannot explore", 2),
                                  (["explore", str(tmp_path)], "cannot explore", 2)):
        assert cli_main(argv) == status, argv  # a log that cannot be read exits 2, as every log reader does
        assert message in capsys.readouterr().err, argv


def test_the_readme_sample_token_replays(capsys: pytest.CaptureFixture[str]) -> None:
    sample = re.search(r"tickloom explore --replay (tlc1-\S+)", (ROOT / "README.md").read_text())
    assert sample is not None
    assert cli_main(["explore", "--replay", sample.group(1)]) == 1
    assert "variant swapped-deadline; 4 actions, 2 moved events): deadline at tick 13" in capsys.readouterr().out


def test_tokens_round_trip_and_bad_ones_are_refused() -> None:
    token = Token("core", 12, "pct", True, None, None, [0, 4], [])
    assert decode_token(encode_token(token)) == token
    for bad in ("", "tlc1-", "tlc1-!!!", "tlx1-abc", encode_token(Token("core", 1, "bogus", False, None, None, None,
                                                                        [])),
                encode_token(Token("core", 1, "random", False, "nope", None, None, [])),
                encode_token(Token("core", 1, "random", False, "retire-before-log", None, None, [])),
                "tlc1-" + encode_token(Token("actors", 1, "random", False, None, None, None, []))[5:]):
        with pytest.raises(ValueError):
            decode_token(bad)


def test_ddmin_finds_a_one_minimal_subset() -> None:
    assert ddmin(list(range(20)), lambda keep: 3 in keep and 7 in keep) == [3, 7]
    assert ddmin(list(range(5)), lambda keep: True) == []


def test_the_core_level_needs_no_trio(tmp_path: Path) -> None:
    # The command's own parser (``tickloom``'s builds every subcommand's, and ``serve``'s imports trio).
    code = ("import argparse, sys; from tickloom.tools.commands import explore; p = argparse.ArgumentParser(); "
            "explore.add_arguments(p); "
            "status = explore.run(p.parse_args(['--seeds', '101', '--variant', 'fence', '--out', sys.argv[1]])); "
            "assert status == 1, status; print(sorted(m for m in sys.modules if m.split('.')[0] == 'trio'))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]
