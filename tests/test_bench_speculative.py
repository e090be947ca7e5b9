"""``tickloom bench speculative`` on the stub: every case runs both sides, they give the same tokens, and the
acceptance figures come from the speculating engine's log."""

from __future__ import annotations

import json

import pytest

from tickloom.tools.cli import main


def test_the_bench_runs_every_case_side_by_side_and_reads_acceptance_from_the_log(
        capsys: pytest.CaptureFixture[str]) -> None:
    main(["bench", "speculative", "--model", "stub", "--batch", "3", "--repeat", "1", "--max-tokens", "16",
          "--json", "--quiet"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    cases = {(row["prompts"], row["batch"]) for row in rows}
    assert cases == {("copy-heavy", 1), ("open-ended", 1), ("copy-heavy", 3), ("open-ended", 3)}
    for row in rows:
        assert row["same_tokens"], row
        assert row["tokens"] == 16 * row["requests"]  # the stub never stops early
        assert 0.0 < row["acceptance"] <= 1.0 and row["tokens_per_row"] > 1.0, row
        assert 0.0 < row["filled"] < 1.0, row  # the stub's proposer leaves some slots empty (oracle_fill_count)
        assert row["plain_tok_s"] > 0 and row["speculative_tok_s"] > 0
