#!/usr/bin/env bash
# Mutation testing of the scheduler core (engine/core) with mutmut; configuration: [tool.mutmut] in pyproject.toml.
#
#   scripts/mutate.sh                       every module of engine/core (thousands of mutants: hours on 2 cores)
#   scripts/mutate.sh admission endgame     only these modules (engine.core.<module>.*)
#   scripts/mutate.sh --score [module ...]  only print the scores of what has been run so far
#
# Environment: MUTATE_CHILDREN (default 1) parallel mutant workers.
#
# Each mutant runs, in a fork, only the core tests that call the mutated function (fastest first, stopping at the
# first failure: mutmut adds -x, -p no:randomly). The tests are tests/test_core_*.py without the golden-bytes and
# purity tests (see pyproject.toml). Results are cached in mutants/ per function: a rerun tests only functions
# whose source changed. `.venv/bin/mutmut show <name>` prints a mutant's diff; `mutmut results` lists them.
#
# The score is killed / (killed + survived + timeout + suspicious + no tests), leaving out the equivalent mutants
# listed below (a mutant no test can kill because the program behaves identically), each with its reason.
# Mutant names are numbered within their function, so a change to a function can renumber them: recheck this list
# with `mutmut show` when a listed function changes.
set -euo pipefail
cd "$(dirname "$0")/.."

score_only=0
if [[ "${1:-}" == "--score" ]]; then
    score_only=1
    shift
fi
modules=("$@")

# name<TAB>reason, one equivalent mutant per line.
EQUIVALENT=$(cat <<'EOF'
engine.core.admission.x_in_flight_demand__mutmut_5	> becomes >=: a sequence holding exactly its reservation stays listed, adding 0 to the demand
engine.core.admission.x_admit__mutmut_4	>= becomes >: at a full batch the loop admits nothing either; only in_flight_demand runs, pruning the reserving list alike
engine.core.admission.x_admit__mutmut_46	make_room gets no ctx on the lone path: nothing is active, so there is no swap-out, its only use of ctx
engine.core.admission.x_admit__mutmut_61	admission numbers step by 2: they are only compared with each other (victim and swap-out order)
engine.core.admission.x_make_room__mutmut_5	> becomes >=: reclaim(0) frees nothing and the shortfall is recomputed the same
engine.core.apply.x_commit_token__mutmut_61	the forced call passes None for think-end: its first test replaces any token but think-end by think-end, the budget being spent
engine.core.apply.x_shut_down__mutmut_20	dequeue=None for dequeue=False: both falsy
engine.core.apply.x_shut_down__mutmut_26	dequeue left True: each parked request also leaves its queue one by one, which shutdown then empties anyway (only slower)
engine.core.apply.x_shut_down__mutmut_31	dequeue=True: as mutant 26
engine.core.apply.x_shut_down__mutmut_29	the shutdown error at index len+1, not len-1: the only reason that can follow it in the tick is the sweep's timeout at len-1, which wins either way; earlier reasons stand either way
engine.core.apply.x_spill_done__mutmut_18	unblocked not set after a failed spill: it only matters with no step in flight, and then the requeued sequence resumes in this tick's resume phase, which sets it
engine.core.apply.x_spill_done__mutmut_19	as mutant 18 (False for None)
engine.core.apply.x_fail_step__mutmut_8	a failed step's samplers are all among its rows, which it ends: retired this tick, their in-flight count is never read again
engine.core.apply.x_fail_step__mutmut_9	as mutant 8
engine.core.apply.x_fail_step__mutmut_10	as mutant 8
engine.core.apply.x_fail_step__mutmut_25	the error at len+1, not len-1: reasons after it in the tick (stop match, deadline sweep) come at len-1 or earlier and win either way, as they do over error, the lowest rank
engine.core.apply.x_fail_step__mutmut_47	as mutant 25, for a request sharing the failed step's blocks
engine.core.apply.x_apply_inputs__mutmut_2	always sorted: sorting none or one input changes nothing (the guard only skips the call)
engine.core.apply.x_apply_inputs__mutmut_4	as mutant 2: a single input is sorted too
engine.core.apply.x_apply_inputs__mutmut_82	a DeadlineReached entry keyed -2 instead of -1: due at once either way, and ordered among such entries by arrival alike
engine.core.apply.x__invalid_arrival__mutmut_12	the fast guard <= 0: a prompt with token 0 takes the per-token scan, which finds it valid
engine.core.apply.x__invalid_arrival__mutmut_13	as mutant 12 (< 1)
engine.core.apply.x__commit_in_bulk__mutmut_4	discarded = None: falsy like False
engine.core.apply.x__commit_in_bulk__mutmut_5	discarded = True: every step takes the per-row emit path, which emits the same rows (only slower)
engine.core.apply.x__commit_in_bulk__mutmut_8	zip without strict: settle_step has already refused a token count unlike the samplers
engine.core.apply.x__commit_in_bulk__mutmut_11	as mutant 8
engine.core.apply.x__commit_in_bulk__mutmut_12	as mutant 8
engine.core.apply.x__settle_kv__mutmut_4	zip without strict: a step's rows and KV ends are built together, one each
engine.core.apply.x__settle_kv__mutmut_7	as mutant 4
engine.core.apply.x__settle_kv__mutmut_8	as mutant 4
engine.core.planner.x_can_run_ahead__mutmut_1	> for >=: plan_step plans only with fewer than pipeline_depth steps in flight, so a sequence never has pipeline_depth rows in flight here
engine.core.planner.x_can_run_ahead__mutmut_2	as mutant 1: the early return is never taken
engine.core.planner.x__plan_decode__mutmut_22	looked_at_all = None for False: falsy alike
engine.core.planner.x__plan_decode__mutmut_97	zip without strict: the columns zipped are built together from the same rows, equally long
engine.core.planner.x__plan_decode__mutmut_100	zip without strict: the columns zipped are built together from the same rows, equally long
engine.core.planner.x__plan_decode__mutmut_101	zip without strict: the columns zipped are built together from the same rows, equally long
engine.core.planner.x__plan_decode__mutmut_107	zip without strict: the columns zipped are built together from the same rows, equally long
engine.core.planner.x__plan_decode__mutmut_111	zip without strict: the columns zipped are built together from the same rows, equally long
engine.core.planner.x__plan_decode__mutmut_112	zip without strict: the columns zipped are built together from the same rows, equally long
engine.core.planner.x__plan_decode__mutmut_154	zip without strict: the columns zipped are built together from the same rows, equally long
engine.core.planner.x__plan_decode__mutmut_157	zip without strict: the columns zipped are built together from the same rows, equally long
engine.core.planner.x__plan_decode__mutmut_158	zip without strict: the columns zipped are built together from the same rows, equally long
engine.core.apply.x_arrive__mutmut_98	the forced call passes None for think-end: commit_token's first test replaces it by think-end, the zero budget being spent (as commit_token mutant 61)
engine.core.apply.x_apply_inputs__mutmut_66	the swap-in error at len+1, not len-1: as fail_step mutant 25, every other reason in the tick comes at len-1 or earlier and wins either way
engine.core.apply.x_apply_inputs__mutmut_47	unblocked not set by SwapInReady: the flag only matters when no step is in flight after the tick, and then this tick's own phases have acted already: a running sequence was planned or preempted, and with none running the swap-in (or admission, or resume) succeeded and set the flag itself
engine.core.apply.x_apply_inputs__mutmut_48	as mutant 47
engine.core.apply.x_arrive__mutmut_87	unblocked not set by an arrival: the flag only matters when no step is in flight after the tick, and then this tick's own phases have acted already: a running sequence was planned or preempted, and with none running the swap-in (or admission, or resume) succeeded and set the flag itself
engine.core.apply.x_arrive__mutmut_88	as mutant 87
engine.core.planner.x__unclaim_prefix__mutmut_1	unreachable (no test reaches _unclaim_prefix): a fresh sequence is itself always a victim candidate (settled, no row yet), so ensure_blocks fails for it only by preempting it, which releases the hits it claimed
engine.core.planner.x__unclaim_prefix__mutmut_2	unreachable (no test reaches _unclaim_prefix): a fresh sequence is itself always a victim candidate (settled, no row yet), so ensure_blocks fails for it only by preempting it, which releases the hits it claimed
engine.core.planner.x__unclaim_prefix__mutmut_3	unreachable (no test reaches _unclaim_prefix): a fresh sequence is itself always a victim candidate (settled, no row yet), so ensure_blocks fails for it only by preempting it, which releases the hits it claimed
engine.core.planner.x__unclaim_prefix__mutmut_4	unreachable (no test reaches _unclaim_prefix): a fresh sequence is itself always a victim candidate (settled, no row yet), so ensure_blocks fails for it only by preempting it, which releases the hits it claimed
engine.core.planner.x__unclaim_prefix__mutmut_5	unreachable (no test reaches _unclaim_prefix): a fresh sequence is itself always a victim candidate (settled, no row yet), so ensure_blocks fails for it only by preempting it, which releases the hits it claimed
engine.core.planner.x__unclaim_prefix__mutmut_6	unreachable (no test reaches _unclaim_prefix): a fresh sequence is itself always a victim candidate (settled, no row yet), so ensure_blocks fails for it only by preempting it, which releases the hits it claimed
engine.core.planner.x__add_delta__mutmut_6	>= for >: with nothing new, extending by no blocks and setting sent_blocks to what it is change nothing
engine.core.planner.x__claim_prefix__mutmut_3	and for or: a fresh sequence holds no blocks, and with caching off no block has a hash, so the lookup finds nothing
engine.core.planner.x_ensure_blocks__mutmut_2	<= for <: a table already of the wanted size enters the loop only to allocate no blocks and return True
engine.core.planner.x_ensure_blocks__mutmut_6	>= for >: reclaim(0) frees nothing
engine.core.planner.x_ensure_blocks__mutmut_17	choose_victim without the step id: a row in the step being planned has set last_step to its id, above settled_step, so the unsettled test excludes it already
engine.core.planner.x__plan_decode__mutmut_20	< for <=: the decode loop's budget check before a sequence never fires: after the prune, running holds at most max_batch_size live sequences, each taking at most one token, and the config keeps max_batch_tokens >= max_batch_size
engine.core.planner.x__plan_decode__mutmut_23	looked_at_all left True: the decode loop's budget check before a sequence never fires: after the prune, running holds at most max_batch_size live sequences, each taking at most one token, and the config keeps max_batch_tokens >= max_batch_size
engine.core.planner.x__plan_decode__mutmut_24	return for break: the decode loop's budget check before a sequence never fires: after the prune, running holds at most max_batch_size live sequences, each taking at most one token, and the config keeps max_batch_tokens >= max_batch_size
engine.core.planner.x__plan_decode__mutmut_48	/ for //: for an integer n, position / block_size >= n exactly when position // block_size >= n
engine.core.planner.x__plan_decode__mutmut_55	ensure_blocks without the step id: as ensure_blocks mutant 17
engine.core.planner.x__plan_decode__mutmut_83	the decode token budget stays 1: the budget check it feeds never fires (see mutant 20), and the prefill budget is computed from the row count
engine.core.planner.x__plan_decode__mutmut_84	the decode token budget grows: the budget check it feeds never fires (see mutant 20), and the prefill budget is computed from the row count
engine.core.planner.x__plan_decode__mutmut_88	looked_at_all is always True here (see mutant 20): the early return is never taken either way
engine.core.planner.x__plan_decode__mutmut_160	a row listed as ending one token early only adds a settle-time candidate for the stop rules, which finish nothing it would not
engine.core.planner.x__plan_decode__mutmut_168	looked_at_all is always True here (see mutant 20)
engine.core.planner.x_plan_prefill__mutmut_22	> for >= in the completed test, whose branch is never taken (no test reaches it): a sequence is handed to plan_prefill only while num_computed < prefill_target (the decode pass's prefilling list, or the lane's, which join_running fills only with such sequences and plan_prefill empties of completed ones)
engine.core.planner.x_plan_prefill__mutmut_23	appends None in the completed branch, never taken (no test reaches it): a sequence is handed to plan_prefill only while num_computed < prefill_target (the decode pass's prefilling list, or the lane's, which join_running fills only with such sequences and plan_prefill empties of completed ones)
engine.core.planner.x_plan_prefill__mutmut_24	break for continue in the completed branch, never taken (no test reaches it): a sequence is handed to plan_prefill only while num_computed < prefill_target (the decode pass's prefilling list, or the lane's, which join_running fills only with such sequences and plan_prefill empties of completed ones)
engine.core.planner.x_plan_prefill__mutmut_43	ensure_blocks without the step id: as ensure_blocks mutant 17
engine.core.planner.x_plan_prefill__mutmut_57	_unclaim_prefix(None, ...): unreachable, as the _unclaim_prefix mutants
engine.core.planner.x_plan_prefill__mutmut_58	_unclaim_prefix with a None argument: unreachable, as the _unclaim_prefix mutants
engine.core.planner.x_plan_prefill__mutmut_59	as mutant 58
engine.core.planner.x_plan_prefill__mutmut_60	as mutant 58
engine.core.planner.x_plan_prefill__mutmut_80	stop_rule without the config: the rule was computed and cached at arrival (track_stops), and again at restore
engine.core.planner.x_plan_prefill__mutmut_86	a prefill row listed as ending with a limit of 2: only an extra settle-time candidate for the stop rules, which finish nothing they would not
engine.core.planner.x_plan_prefill__mutmut_91	inflight = 1 for += 1: a prompt's last chunk is its first sampling row, so inflight was 0
engine.core.planner.x_emit_step__mutmut_5	sampler ids always rebuilt from the samplers: when every row samples, that is the same list (the shortcut only saves building it)
engine.core.lifecycle.x_choose_victim__mutmut_15	the immunity flag 0/1 becomes 0/2: only its order matters
engine.core.lifecycle.x_choose_victim__mutmut_19	> becomes >=: keys end in the admission number, unique, so no two keys tie
engine.core.lifecycle.x_full_block_hashes__mutmut_5	> becomes >=: when equal, chain_hashes over no tokens adds nothing
engine.core.lifecycle.x_full_block_hashes__mutmut_14	+= becomes =: seq.hashes stays empty, every call rehashes from the root; same hashes, slower
engine.core.lifecycle.x_preempt__mutmut_1	the victims-are-settled assert weakened: callers only pass settled victims (choose_victim, make_room)
engine.core.lifecycle.x_preempt__mutmut_8	the assert's message: the assert never fires
engine.core.lifecycle.x_preempt__mutmut_9	the assert's message: the assert never fires
engine.core.lifecycle.x_preempt__mutmut_69	reserve left 1: only RUNNING sequences count in demand, and every way back sets reserve itself
engine.core.lifecycle.x_preempt__mutmut_67	first_planned left True: every way back (resume_preempted, swap_in) sets it True itself
EOF
)

if [[ $score_only == 0 ]]; then
    # mutmut reruns every mutant named on its command line, and skips those with a result otherwise. So: the first
    # time, name the modules; after that, name only the mutants not yet killed (a survivor is retested, as a new
    # test may kill it; a mutant whose function changed has lost its result and is tested again).
    if [[ -e mutants/mutmut-stats.json ]]; then
        mapfile -t names < <(EQUIVALENT="$EQUIVALENT" .venv/bin/python - "${modules[@]}" <<'PY'
import json, os, sys
from pathlib import Path
equivalent = {line.split("\t")[0].strip() for line in os.environ["EQUIVALENT"].splitlines() if line.strip()}
wanted = set(sys.argv[1:])
for meta in sorted(Path("mutants/engine/core").glob("*.py.meta")):
    if wanted and meta.name.removesuffix(".py.meta") not in wanted:
        continue
    for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
        if code not in (1, 3) and name not in equivalent:
            print(name)
PY
        )
        if [[ ${#names[@]} -gt 0 ]]; then
            .venv/bin/mutmut run --max-children "${MUTATE_CHILDREN:-1}" "${names[@]}"
        fi
    else
        patterns=()
        for module in "${modules[@]}"; do
            patterns+=("engine.core.${module}.*")
        done
        .venv/bin/mutmut run --max-children "${MUTATE_CHILDREN:-1}" "${patterns[@]}"
    fi
fi

EQUIVALENT="$EQUIVALENT" .venv/bin/python - "${modules[@]}" <<'PY'
import json
import os
import sys
from pathlib import Path

from mutmut.stats import status_by_exit_code

equivalent = {}
for line in os.environ["EQUIVALENT"].splitlines():
    if line.strip():
        name, _, reason = line.partition("\t")
        equivalent[name.strip()] = reason.strip()

wanted = set(sys.argv[1:])
columns = ("killed", "survived", "timeout", "suspicious", "no tests", "not checked", "equivalent")
totals = dict.fromkeys(columns, 0)
survivors = []
print(f"{'module':<12}" + "".join(f"{c:>12}" for c in columns) + f"{'score':>9}")
for meta in sorted(Path("mutants/engine/core").glob("*.py.meta")):
    module = meta.name.removesuffix(".py.meta")
    if wanted and module not in wanted:
        continue
    counts = dict.fromkeys(columns, 0)
    for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
        status = "equivalent" if name in equivalent else status_by_exit_code[code]
        if status in ("segfault", "caught by type check", "skipped", "check was interrupted by user"):
            status = "suspicious" if status == "segfault" else "not checked"
        counts[status] += 1
        if status in ("survived", "timeout", "suspicious", "no tests"):
            survivors.append((status, name))
    if not sum(counts.values()):
        continue
    for c in columns:
        totals[c] += counts[c]
    scored = counts["killed"] + counts["survived"] + counts["timeout"] + counts["suspicious"] + counts["no tests"]
    score = f"{100 * counts['killed'] / scored:8.1f}%" if scored else "       -"
    print(f"{module:<12}" + "".join(f"{counts[c]:>12}" for c in columns) + score)
scored = totals["killed"] + totals["survived"] + totals["timeout"] + totals["suspicious"] + totals["no tests"]
score = f"{100 * totals['killed'] / scored:8.1f}%" if scored else "       -"
print(f"{'total':<12}" + "".join(f"{totals[c]:>12}" for c in columns) + score)
for status, name in survivors:
    print(f"  {status}: {name}")
PY
