"""The race explorer's actor level (``tools.explore.actors`` through the driver; ``tickloom explore --actors``).

* trio still has the deterministic-scheduling hook the explorer seeds, at the version ``tickloom[explore]`` pins;
  without the hook, importing the actor level fails with an ``ImportError`` that names that trio;
* one seed gives one run: the same seed twice writes byte-identical logs, whatever the strategy, and whatever
  ``PYTHONHASHSEED`` is;
* each deliberately broken actor variant (``tools.explore.variants``) is found within 2,000 seeds by the
  explorer's own loop and shrunk; its replay token re-runs it, its log is kept, and the printed pytest test fails
  on the variant and passes on the real code;
* the real code, with faults, shows no violation (a few seeds here; 500 per strategy in the slow test).

These tests call ``trio.run`` themselves (one per seed), so they are plain functions, not trio tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import trio

from tickloom.replay import verify
from tickloom.tools.cli import main as cli_main
from tickloom.tools.explore.actors import ACTORS, LEVEL, run_script
from tickloom.tools.explore.driver import (
    STRATEGIES,
    Edit,
    Token,
    decode_token,
    encode_token,
    explore,
    regression_test,
)
from tickloom.tools.explore.levels import replay_token
from tickloom.tools.explore.schedule import EXPLORE_TRIO, deterministic_trio, trio_hook_present
from tickloom.tools.explore.script import make_script
from tickloom.tools.explore.variants import VARIANTS, enabled

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"^explored (\d+) seeds? \(actors\) in [0-9.]+ s: [0-9.]+ seeds/s, (\d+) violations?$")

KNOWN = {
    # variant: (a seed that finds it, the violation's kind)
    "deadline-keyerror": (1, "fatal"),
    "drop-overtakes-copy": (165, "conservation"),
    "retire-before-log": (0, "unlogged delivery"),
}


def test_trio_has_the_deterministic_scheduling_hook_at_the_pinned_version() -> None:
    assert trio_hook_present(), "trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING and _r are gone"
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["explore"]
    pins = [d for d in extra if re.fullmatch(r"trio\s*==.*", d)]
    assert pins == [EXPLORE_TRIO] == [f"trio=={trio.__version__}"], (pins, EXPLORE_TRIO, trio.__version__)

    async def order() -> list[int]:
        ran: list[int] = []

        async def task(i: int) -> None:
            for _ in range(3):
                ran.append(i)
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(task, i)
        return ran

    def run(seed: int, strategy: str) -> list[int]:
        with deterministic_trio(seed, strategy):
            return trio.run(order)

    before = (trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING, trio._core._run._r)
    for strategy in STRATEGIES:
        assert run(3, strategy) == run(3, strategy), f"{strategy}: one seed, one order"
    assert len({tuple(run(seed, "random")) for seed in range(8)}) > 1, "the seed drives the order"
    assert (trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING, trio._core._run._r) == before, "trio's own restored"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_same_seed_twice_writes_byte_identical_logs(tmp_path: Path, strategy: str) -> None:
    log = tmp_path / "run.tlog"
    for seed, faults in ((7, False), (41, True), (165, False)):
        script = make_script(seed, faults)
        first = run_script(script, strategy, log)
        data = log.read_bytes()
        second = run_script(script, strategy, log)
        assert first.violation is None and second.violation is None, (first.violation, second.violation)
        assert log.read_bytes() == data, f"seed {seed} ({strategy}): two runs, two logs"
        assert first.ticks == second.ticks > 0


def test_the_log_does_not_depend_on_the_hash_seed(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    code = ("import hashlib, sys; from pathlib import Path; from tickloom.tools.explore.actors import run_script; "
            "from tickloom.tools.explore.script import make_script; p = Path(sys.argv[1]) / 'run.tlog'; "
            "r = run_script(make_script(165, True), 'random', p); assert r.violation is None, r.violation; "
            "print(hashlib.sha256(p.read_bytes()).hexdigest())")
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", code, str(work)], cwd=ROOT, env=env, capture_output=True,
                             text=True, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1, digests


def test_every_variant_is_listed() -> None:
    assert set(KNOWN) == set(VARIANTS["actors"])


@pytest.mark.parametrize("variant", sorted(VARIANTS["actors"]))
def test_each_broken_variant_is_found_shrunk_and_reproduced(tmp_path: Path, variant: str) -> None:
    seed, kind = KNOWN[variant]
    quick = explore(ACTORS, [seed], variant=variant, shrink=False)
    assert quick.found is not None and quick.found.violation.kind == kind, quick.found

    exploration = explore(ACTORS, range(2000), variant=variant, out=tmp_path)
    found = exploration.found
    assert found is not None, f"{variant}: not found in 2,000 seeds"
    assert exploration.seeds == found.seed + 1 <= 2000, "stops at the first violation"
    assert found.violation.kind == found.original.kind == kind, found
    assert 1 <= len(found.keep) < found.actions or found.actions == 1, (found.keep, found.actions)
    print(f"{variant}: found at seed {found.seed}, shrunk {found.actions} -> {len(found.keep)} actions")

    assert found.log is not None and found.log.parent == tmp_path
    assert verify(found.log).status == "identical", "the kept log replays"
    assert decode_token(found.token) == Token(LEVEL, found.seed, "random", False, variant, None, found.keep, [])
    assert cli_main(["explore", "--replay", found.token]) == 1, "the token re-runs the violation"

    text = regression_test(found)
    test_name = f"test_explore_actors_seed_{found.seed}_random"
    namespace: dict[str, object] = {}
    exec(compile(text, "<regression>", "exec"), namespace)
    regression = namespace[test_name]
    assert callable(regression)
    with enabled(variant), pytest.raises(AssertionError, match=kind):
        regression()
    regression()  # passes on the real code


def test_the_real_code_with_faults_shows_no_violation() -> None:
    for strategy in STRATEGIES:
        exploration = explore(ACTORS, range(25), strategy, faults=True)
        assert exploration.found is None, exploration.found


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_500_seeds_with_faults_show_no_violation(strategy: str) -> None:
    exploration = explore(ACTORS, range(500), strategy, faults=True)
    print(exploration.summary())
    assert exploration.found is None, exploration.found
    assert exploration.seeds == 500


def test_a_token_replays_on_the_code_as_built() -> None:
    token = encode_token(Token(LEVEL, 1, "random", False, None, None, [1], []))
    assert replay_token(token) is None
    with enabled("deadline-keyerror"):
        violation = replay_token(token)
    assert violation is not None and "KeyError" in violation.detail
    for bad, message in ((Token(LEVEL, 1, "random", False, None, None, [99], []), "cannot keep"),
                         (Token(LEVEL, 1, "random", False, None, "some.tlog", None, []), "core level"),
                         (Token(LEVEL, 1, "random", False, None, None, None, [Edit(1, "delay", ("x",), 2)]),
                          "no moved events")):
        with pytest.raises(ValueError, match=message):
            replay_token(encode_token(bad))


def test_tokens_round_trip_and_bad_ones_are_refused() -> None:
    token = Token(LEVEL, 12, "pct", True, None, None, [0, 4], [])
    text = encode_token(token)
    assert text.startswith("tla1-") and decode_token(text) == token
    for bad in ("", "tla1-", "tla1-!!!", "nope", encode_token(Token(LEVEL, 1, "bogus", False, None, None, None, [])),
                encode_token(Token(LEVEL, 1, "random", False, "fence", None, None, []))):
        with pytest.raises(ValueError):
            decode_token(bad)


def test_without_the_hook_the_actor_level_does_not_import(tmp_path: Path) -> None:
    code = ("import trio; del trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING\n"
            "try:\n    import tickloom.tools.explore.actors\n"
            "except ImportError as exc:\n    print(exc)\n"
            "else:\n    raise SystemExit('imported')\n"
            "from tickloom.tools.cli import main\n"
            "assert main(['explore', '--actors', '--seeds', '1']) == 64\n"
            "assert main(['explore', '--seeds', '1']) == 0")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pip install 'tickloom[explore]'" in out.stdout and EXPLORE_TRIO in out.stdout, out.stdout
    assert "tickloom[explore]" in out.stderr, "the command says which trio to install"


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["explore", "--actors", "--seeds", "5", "--faults", "--strategy", "delay"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    match = SUMMARY.match(last)
    assert match is not None and match.groups() == ("5", "0"), last

    assert cli_main(["explore", "--actors", "--seeds", "3", "--variant", "retire-before-log"]) == 1
    out = capsys.readouterr().out
    assert "unlogged delivery" in out and "tickloom explore --replay tla1-" in out and "def test_explore" in out
    match = SUMMARY.match(out.strip().splitlines()[-1])
    assert match is not None and match.groups() == ("1", "1")

    for argv, message in ((["explore", "--replay", "junk"], "replay token"),
                          (["explore", "--actors", "--seeds", "0"], "at least 1"),
                          (["explore", "--actors", "some.tlog"], "core level"),
                          (["explore", "--actors", "--variant", "nope"], "unknown variant 'nope' at the actors"),
                          (["explore", "--actors", "--variant", "fence"], "unknown variant 'fence' at the actors")):
        assert cli_main(argv) == 64, argv
        assert message in capsys.readouterr().err, argv
    assert "--variant" not in subprocess.run([sys.executable, "-m", "tickloom", "explore", "--help"], cwd=ROOT,
                                             capture_output=True, text=True, check=True).stdout


def test_a_hang_is_reported_as_liveness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tickloom.actors.retire import RetireActor
    from tickloom.events import Finish

    deliver = RetireActor.deliver_nowait

    def lose_finishes(self: RetireActor, commands: list[object]) -> None:
        deliver(self, [c for c in commands if not isinstance(c, Finish)])  # type: ignore[misc]

    monkeypatch.setattr(RetireActor, "deliver_nowait", lose_finishes)
    result = run_script(make_script(7, False), "random", tmp_path / "run.tlog")
    assert result.violation is not None and result.violation.kind == "liveness", result.violation


@pytest.mark.parametrize(("seed", "actor"), [(40, "step"), (43, "deadlines"), (71, "log")])
def test_a_planned_crash_fails_every_stream_and_nothing_hangs(tmp_path: Path, seed: int, actor: str) -> None:
    result = run_script(make_script(seed, True), "random", tmp_path / "run.tlog")
    assert result.violation is None, result.violation
    assert result.fatal is not None and f"the {actor} actor failed" in result.fatal, result.fatal


def test_a_crash_that_leaves_a_stream_open_is_a_violation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tickloom.actors.retire import RetireActor

    monkeypatch.setattr(RetireActor, "fail_all", lambda self, error: None)
    result = run_script(make_script(71, True), "random", tmp_path / "run.tlog")
    assert result.violation is not None and result.violation.kind == "crash", result.violation
