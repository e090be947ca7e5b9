#!/usr/bin/env bash
# Mutation testing with mutmut, by area; configuration: [tool.mutmut] in pyproject.toml.
#
#   scripts/mutate.sh                              every module of the core (thousands of mutants: hours on 2 cores)
#   scripts/mutate.sh admission tick_end           only these modules of the core (tickloom.engine.core.<module>.*)
#   scripts/mutate.sh --area events [module ...]   the area events (all its modules, or only these: log frames ...)
#   scripts/mutate.sh --score [module ...]         only print the scores of what has been run so far: one table per
#                                                  area (with --area, that area's only)
#
# Environment: MUTATE_CHILDREN (default 1) parallel mutant workers.
#
# The areas, and what each mutates (a module is named by its path under the area's folder, without .py):
#   core        engine/core/*: every scheduling decision. [tool.mutmut] itself; mutants/ at the top.
#   events      events/log.py, frames.py, codec.py, digest.py, errors.py: the log writer, reader, frame scan and
#               recovery, the one encoding and the schema hash, the running digest, the errors that name a file and
#               offset. Left out: commands.py, inputs.py, records.py, types.py and routing.py (the vocabulary: Struct
#               declarations, whose one behaviour, the wire schema, the schema-hash and golden-bytes tests pin as a
#               whole), oracle.py (the stub model's tokens: the core's tests' model, scored with them) and
#               __init__.py (re-exports).
#   replay      replay/verify.py and diff.py: exact replay, divergence reports, seek and bisect, field-level diffs.
#               The rest of replay/ (the simulator, what-if, traces) is tooling over the same core.
#   validation  tickloom/validation.py (checked, unencodable, with_bounds: the validation boundary of the public
#               API), tickloom/params.py (SamplingParams) and the checks of tickloom/config.py (FaultPlan's and EngineConfig's
#               __post_init__, _check_tensor_parallel, _normalise). Left out: config.py's configuration_table, _bound,
#               _number and _json_value, which render the README's table (tests/test_engine_config.py compares it
#               with README.md), not checks of any input.
#   actors      every module of actors/: the step actor (ticks, dispatch by the routing table, acknowledged means
#               logged, snapshots, fsync per tick, the idle event, its statistics), the devices (ThreadDevice and
#               StubDevice: command order, poisoned rows and placeholders, copies out and in, the bounded queue),
#               the spill store and its actors (the host tier's byte budget, checksummed disk files, stale
#               directories, the directories a store makes, drops that overtake their copy), the retire actor
#               (streams, groups of n choices, coalescing, abandoned and closed streams), deadlines.py, log.py,
#               mailbox.py and streams.py (the timer heap, the fsync policy and group commit, stamping and bounded
#               reporting, stream assembly). Besides the actors' own tests, the engine-level tests that run them
#               quickly (the stub engine, asyncio, isolation, the simulator, one explorer run); the explorer's
#               fuzzers, the kill -9 and CLI tests (a subprocess never sees the mutant) are left out.
#   Everywhere: a Protocol's or a type's declaration has no behaviour of its own; what mutmut makes of one (a
#   default in a Protocol method) is listed as equivalent below. __repr__s are none of these files' own.
# Each area other than core is its table [tool.mutmut.areas.NAME] in pyproject.toml (files, tests, an optional
# `mutants` list of name patterns that narrows what is run and scored). mutmut reads only [tool.mutmut], so the
# script runs such an area in mutants/areas/NAME/: links to tickloom/, tests/ and what the area copies, and a
# pyproject.toml that is the real one with [tool.mutmut] replaced by the area's table. Everything under mutants/ is
# ignored by git.
#
# Mutants are named after their file's path under tickloom/ (tickloom.engine.core.decode_lane.x_plan_lane_decode__mutmut_3);
# the list of equivalent mutants below leaves out the "tickloom." prefix.
#
# Each mutant runs, in a fork, only the area's tests that call the mutated function (fastest first, stopping at the
# first failure: mutmut adds -x, -p no:randomly). The core's tests are tests/test_core_*.py without the golden-bytes
# and purity tests (see pyproject.toml). Results are cached in mutants/ per function: a rerun tests only functions
# whose source changed. `.venv/bin/mutmut show <name>` prints a mutant's diff (for an area, run it in
# mutants/areas/NAME); `mutmut results` lists them.
#
# The score is detected / (detected + survived + suspicious + no tests), where detected is killed plus timeout (a
# mutant that makes the tests hang is caught, as Stryker counts it), leaving out the equivalent mutants listed below (a mutant no test can kill because the program behaves identically), each with its reason.
# Mutant names are numbered within their function, so a change to a function can renumber them: recheck this list
# with `mutmut show` when a listed function changes.
set -euo pipefail
cd "$(dirname "$0")/.."

score_only=0
area=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --score) score_only=1; shift ;;
        --area) area="${2:?--area needs a name}"; shift 2 ;;
        --area=*) area="${1#--area=}"; shift ;;
        *) break ;;
    esac
done
modules=("$@")
if [[ $score_only == 0 && -z $area ]]; then
    area=core
fi

# name<TAB>reason, one equivalent mutant per line.
EQUIVALENT=$(cat <<'EOF'
engine.core.admission.x_in_flight_demand__mutmut_5	> becomes >=: a sequence holding exactly its reservation stays listed, adding 0 to the demand
engine.core.admission.x_admit__mutmut_4	>= becomes >: at a full batch the loop admits nothing either; only in_flight_demand runs, pruning the reserving list alike
engine.core.admission.x_admit__mutmut_46	make_room gets no ctx on the lone path: nothing is active, so there is no swap-out, its only use of ctx
engine.core.admission.x_admit__mutmut_66	admission numbers step by 2: they are only compared with each other (victim and swap-out order)
engine.core.admission.x_make_room__mutmut_5	> becomes >=: reclaim(0) frees nothing and the shortfall is recomputed the same
engine.core.settle.x_commit_token__mutmut_61	the forced call passes None for think-end: its first test replaces any token but think-end by think-end, the budget being spent
engine.core.apply.x_shut_down__mutmut_20	dequeue=None for dequeue=False: both falsy
engine.core.apply.x_shut_down__mutmut_26	dequeue left True: each parked request also leaves its queue one by one, which shutdown then empties anyway (only slower)
engine.core.apply.x_shut_down__mutmut_31	dequeue=True: as mutant 26
engine.core.apply.x_shut_down__mutmut_29	the shutdown error at index len+1, not len-1: the only reason that can follow it in the tick is the sweep's timeout at len-1, which wins either way; earlier reasons stand either way
engine.core.apply.x_spill_done__mutmut_28	unblocked not set after a failed spill: it only matters with no step in flight, and then the requeued sequence resumes in this tick's resume phase, which sets it
engine.core.apply.x_spill_done__mutmut_29	as mutant 28 (False for None)
engine.core.settle.x_fail_step__mutmut_8	a failed step's samplers are all among its rows, which it ends: retired this tick, their in-flight count is never read again
engine.core.settle.x_fail_step__mutmut_9	as mutant 8
engine.core.settle.x_fail_step__mutmut_10	as mutant 8
engine.core.settle.x_fail_step__mutmut_25	the error at len+1, not len-1: reasons after it in the tick (stop match, deadline sweep) come at len-1 or earlier and win either way, as they do over error, the lowest rank
engine.core.settle.x_fail_step__mutmut_47	as mutant 25, for a request sharing the failed step's blocks
engine.core.apply.x_apply_inputs__mutmut_2	always sorted: sorting none or one input changes nothing (the guard only skips the call)
engine.core.apply.x_apply_inputs__mutmut_4	as mutant 2: a single input is sorted too
engine.core.apply.x_apply_inputs__mutmut_82	a DeadlineReached entry keyed -2 instead of -1: due at once either way, and ordered among such entries by arrival alike
engine.core.apply.x__invalid_arrival__mutmut_12	the fast guard <= 0: a prompt with token 0 takes the per-token scan, which finds it valid
engine.core.apply.x__invalid_arrival__mutmut_13	as mutant 12 (< 1)
engine.core.settle.x__commit_in_bulk__mutmut_4	discarded = None: falsy like False
engine.core.settle.x__commit_in_bulk__mutmut_5	discarded = True: every step takes the per-row emit path, which emits the same rows (only slower)
engine.core.settle.x__commit_in_bulk__mutmut_8	zip without strict: settle_step has already refused a token count unlike the samplers
engine.core.settle.x__commit_in_bulk__mutmut_11	as mutant 8
engine.core.settle.x__commit_in_bulk__mutmut_12	as mutant 8
engine.core.settle.x__settle_kv__mutmut_4	zip without strict: a step's rows and KV ends are built together, one each
engine.core.settle.x__settle_kv__mutmut_7	as mutant 4
engine.core.settle.x__settle_kv__mutmut_8	as mutant 4
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
engine.core.preemption.x_choose_victim__mutmut_15	the immunity flag 0/1 becomes 0/2: only its order matters
engine.core.preemption.x_choose_victim__mutmut_19	> becomes >=: keys end in the admission number, unique, so no two keys tie
engine.core.prefix_cache.x_full_block_hashes__mutmut_5	> becomes >=: when equal, chain_hashes over no tokens adds nothing
engine.core.prefix_cache.x_full_block_hashes__mutmut_14	+= becomes =: seq.hashes stays empty, every call rehashes from the root; same hashes, slower
engine.core.preemption.x_preempt__mutmut_1	the victims-are-settled assert weakened: callers only pass settled victims (choose_victim, make_room)
engine.core.preemption.x_preempt__mutmut_8	the assert's message: the assert never fires
engine.core.preemption.x_preempt__mutmut_9	the assert's message: the assert never fires
engine.core.preemption.x_take_off_device__mutmut_70	reserve left 1: only RUNNING sequences count in demand, and every way back sets reserve itself
engine.core.preemption.x_take_off_device__mutmut_68	first_planned left True: every way back (resume_preempted, swap_in) sets it True itself
engine.core.blocks.x_chain_hashes__mutmut_16	range end len-step+2 for len-step+1: offsets are multiples of 4 x block_size and len(packed) a multiple of 4, so no offset is ever len-step+1
engine.core.blocks.xǁBlockPoolǁreclaim__mutmut_1	< 0 for <= 0: reclaim(0) runs its loop zero times and returns 0 alike
engine.core.blocks.xǁBlockPoolǁreclaim__mutmut_14	popitem(last=None): falsy like False
engine.core.blocks.xǁBlockPoolǁreclaim__mutmut_20	free and cached are ordered sets: their values are never read
engine.core.blocks.xǁBlockPoolǁreclaim__mutmut_25	as mutant 20
engine.core.blocks.xǁBlockPoolǁreclaim__mutmut_27	move_to_end(last=None): falsy like False
engine.core.blocks.xǁBlockPoolǁunregister__mutmut_4	as reclaim mutant 20
engine.core.config.xǁCoreConfigǁto_json__mutmut_2	order=None for "deterministic": it orders only dicts and sets, and CoreConfig holds none
engine.core.config.xǁCoreConfigǁto_json__mutmut_4	as mutant 2 (the default order)
engine.core.context.xǁTickContextǁemit__mutmut_13	float("NAN") is float("nan")
engine.core.context.xǁTickContextǁemit__mutmut_21	as mutant 13
engine.core.deadlines.x_sweep_deadlines__mutmut_25	the timeout at len-2, not len-1: every other reason recorded in the tick names the last output at the sweep (a stop match truncates to its token; a finished sequence takes no more tokens), so timeout, first in precedence, wins at len-1 or len-2 alike; the finish index decides only precedence, not the usage
engine.core.deadlines.x_live_deadlines__mutmut_14	no de-duplication: a second entry comes only from DeadlineReached, due at once, and the same tick's sweep pops it and ends the request, so no request has two live entries when live_deadlines runs (compaction at a tick's end, snapshots between ticks)
engine.core.tick_end.x_retire_finished__mutmut_31	has_spill left True on a retired sequence: it leaves state.seqs in the same iteration and nothing reads it again
engine.core.decode_lane.x__join__mutmut_6	an empty lane's last run order +1 for -1: a joiner with run order 0 or 1 makes the lane stand down; only speed, as the general plan it falls back to plans the same step (the lane's contract, tests/test_core_decode_lane.py)
engine.core.decode_lane.x__join__mutmut_7	-2 for -1: joiners have run orders >= 0 (join_running numbers them), so the comparison is the same
engine.core.decode_lane.x__join__mutmut_8	stop_rule without the config: the rule was computed and cached at arrival (track_stops), and again at restore
engine.core.decode_lane.x__join__mutmut_23	as mutant 8
engine.core.decode_lane.x__join__mutmut_11	(incomplete and partly sent) for (incomplete or partly sent): joiners are the sequences advance_lane lists as completed by the lane's step, with their whole table sent by that step; a preemption in between stands the lane down, so neither test is ever true for one
engine.core.decode_lane.x__join__mutmut_15	< for <=: run orders are unique among running sequences except for restored ones (all -1), which a restored core never has in a lane (state.lane is not snapshotted)
engine.core.decode_lane.x__join__mutmut_48	joining = None for []: only tested for truth before advance_lane assigns it its next list, in the same plan
engine.core.decode_lane.x_plan_lane_decode__mutmut_4	and for or: a lane exists only right after the step it describes was planned (every plan either advances it or drops it), so both tests are always false together
engine.core.decode_lane.x_plan_lane_decode__mutmut_31	fed inverted: with a step in flight the lane stands down instead of leaving the member out (only speed, as mutant _join 6); without one the member has finished, as the comment says, so the branch is never taken
engine.core.decode_lane.x_plan_lane_decode__mutmut_55	joiners expected with 2 tokens in flight when fed: they have 1, so the lane stands down (only speed, as _join mutant 6)
engine.core.decode_lane.x_plan_lane_decode__mutmut_59	>= for >: at exactly max_batch_tokens rows the lane stands down (only speed, as _join mutant 6)
engine.core.finish.x_mark_finish__mutmut_7	> for >=: the same reason at the same index again only overwrites the same values: no two sources give one request different error texts at one index in a tick (a failed step skips finished rows, shutdown and swap-in failure skip finished requests)
engine.core.finish.x_mark_finish__mutmut_8	True for False when the finish does not stand: the only caller that reads it (stop_matched) then truncates after the match, a no-op, as the match is at or after the standing finish's index, which is the last output
engine.core.finish.x_stop_rule__mutmut_1	the cache never read: the rule is recomputed, the same, on each call (only slower)
engine.core.prefix_cache.x_cache_full_blocks__mutmut_21	zip(strict=None): falsy like strict=False
engine.core.prefix_cache.x_cache_full_blocks__mutmut_24	zip without strict: the default is strict=False
engine.core.preemption.x_take_off_device__mutmut_2	lane_broken = None: a preemption while a lane step is planned takes a sequence outside the lane (every member already has a row in that step, so none is a victim); the lane skips a prefilling or joining sequence that is no longer running, so keeping it plans the same steps (the flag only makes the general plan rebuild it); the differential lane tests pass with it, the slow ones too
engine.core.preemption.x_take_off_device__mutmut_3	as mutant 2
engine.core.snapshot.x__restore_step__mutmut_6	zip(strict=None): a step's samplers and sample indices are restored from one list each, equally long
engine.core.snapshot.x__restore_step__mutmut_9	as mutant 6
engine.core.snapshot.x__restore_step__mutmut_10	as mutant 6
engine.core.snapshot.x__restore_step__mutmut_12	a row listed as ending one token early only adds a settle-time candidate for the stop rules, which finish nothing they would not (as planner _plan_decode mutant 160)
engine.core.snapshot.x_restore_state__mutmut_8	BlockPool(block_size=None): the pool never reads its block_size (the core reads the config's)
engine.core.snapshot.x_restore_state__mutmut_39	or for and: the extra entries (finished sequences still in running) are pruned by in_flight_demand before it sums, its only reader
engine.core.snapshot.x_restore_state__mutmut_41	>= for >: a sequence holding exactly its reservation adds 0 to the demand (as admission in_flight_demand mutant 5)
engine.core.state.xǁWaitingQueueǁ__iter____mutmut_3	iterating from 0, not the head: every entry before the head was admitted and is no longer WAITING, so the filter drops it
engine.core.state.xǁWaitingQueueǁ__iter____mutmut_5	as mutant 3
engine.core.state.xǁWaitingQueueǁdiscard__mutmut_2	the assert's message: the assert never fires
engine.core.state.xǁWaitingQueueǁdiscard__mutmut_3	as mutant 2
engine.core.state.x_find_in_run_order__mutmut_17	-2 for -1 when absent: the only caller that may miss tests i >= 0
engine.core.fences.x_release_fences__mutmut_13	unblocked not set when fences are released: they are released while applying a settled or failed step, before this tick's own admission, swap-in and resume run; as apply_inputs mutant 47
engine.core.decode_lane.x_plan_lane_decode__mutmut_83	>= for >: with exactly enough free and cached blocks the lane stands down (only speed, as _join mutant 6)
engine.core.decode_lane.x_plan_lane_decode__mutmut_94	>= for >: when the rows need exactly the free blocks, reclaim(0) frees nothing
engine.core.decode_lane.x_plan_lane_decode__mutmut_98	popitem(last=None): falsy like False
engine.core.decode_lane.x_plan_lane_decode__mutmut_121	zip(strict=None): the positions are computed from the members, one each
engine.core.decode_lane.x_plan_lane_decode__mutmut_124	as mutant 121
engine.core.decode_lane.x_plan_lane_decode__mutmut_125	as mutant 121
engine.core.blocks.xǁBlockPoolǁallocate__mutmut_6	popitem(last=None): falsy like False
engine.core.blocks.xǁBlockPoolǁrelease__mutmut_9	as reclaim mutant 20 (the ordered sets' values are never read)
engine.core.blocks.xǁBlockPoolǁrelease__mutmut_10	as reclaim mutant 20
engine.core.blocks.xǁBlockPoolǁrelease__mutmut_11	<= 0 for < 0 in the elif: a count of 0 took the branch before it
engine.core.blocks.xǁBlockPoolǁrelease__mutmut_12	as mutant 11 (< 1)
engine.core.decode_lane.x_plan_lane_decode__mutmut_135	tokens = None for []: the lane's tokens are read only when tokens_step names its step, and hand_tokens assigns a new list first
engine.core.decode_lane.x_start_lane__mutmut_2	stop_rule without the config: cached at arrival, as _join mutant 8
engine.core.decode_lane.x_start_lane__mutmut_7	as mutant 2
engine.core.decode_lane.x_start_lane__mutmut_19	zip(strict=None): the limits are computed from the members, one each
engine.core.decode_lane.x_start_lane__mutmut_23	as mutant 19
engine.core.decode_lane.x_start_lane__mutmut_24	as mutant 19
engine.core.decode_lane.x_start_lane__mutmut_40	tokens=None: as plan_lane_decode mutant 135
engine.core.decode_lane.x_start_lane__mutmut_41	tokens_step=None: it is only compared with step ids (>= 0), which -1 never equals either
engine.core.decode_lane.x_start_lane__mutmut_58	tokens_step=-2: as mutant 41
engine.core.state.x_ends_in_thinking__mutmut_2	True when no markers are configured: the flag it sets at arrival is then never acted on (same steps and outputs with a zero budget while running ahead: tests/test_core_cache.py)
engine.core.state.xǁSeqǁtokens__mutmut_2	< for <=: at end == prompt_len the general branch returns the same slice (prompt[start:] plus no outputs)
engine.core.state.xǁSeqǁtokens__mutmut_3	> for >=: at start == prompt_len the general branch returns the same slice (no prompt plus the outputs)
engine.core.state.xǁWaitingQueueǁinsert__mutmut_8	<= for <: queue keys end in the arrival number, unique, so no two are equal
engine.core.state.xǁWaitingQueueǁpop_head__mutmut_1	returns None: its one caller (admission) already holds the head from head()
engine.core.state.xǁCoreStateǁjoin_running__mutmut_4	run orders step by 2: they are only compared with each other
engine.core.state.xǁCoreStateǁprune_running__mutmut_2	the threshold between two ways of dropping the finished (binary searches or one rebuild), which leave the same list: only speed
engine.core.state.xǁCoreStateǁprune_running__mutmut_3	as mutant 2
engine.core.state.xǁCoreStateǁprune_running__mutmut_4	as mutant 2
engine.core.tick_end.x_reclaim_for_swap_in__mutmut_9	<= for <: with exactly enough free blocks the loop calls reclaim(0), which frees nothing and ends it
engine.core.tick_end.x_swap_back_in__mutmut_12	first_planned left False: a swapped-in sequence has the KV of its whole history (spill_tokens is its prefill target), so it never reaches the prefill pass, the flag's only reader, and a later preemption resets it anyway
events.log.x_known_schema_hashes__mutmut_2	read_text(encoding=None): the file is ASCII, which every locale encoding reads alike
events.log.x_known_schema_hashes__mutmut_8	encoding "UTF-8" for "utf-8": the same codec
events.log.x_known_schema_hashes__mutmut_13	split("#") without maxsplit: only the part before the first "#" is read
events.log.x_known_schema_hashes__mutmut_16	as mutant 13 (maxsplit 2)
events.log.xǁLogWriterǁ__init____mutmut_52	_identity = "" at first: overwritten before any read unless fstat raises, and then discard compares it with a (dev, ino) pair, unequal as None is treated
events.log.xǁLogWriterǁflush__mutmut_10	<= for <: with everything written the loop's own test (written < len) is false at once
events.log.xǁLogWriterǁdiscard__mutmut_10	same = None for False when lstat fails: falsy alike
events.log.x_open_log_file__mutmut_7	O_RDONLY & O_CLOEXEC: O_RDONLY is 0, and Python makes every descriptor non-inheritable anyway (PEP 446)
events.log.xǁLogReaderǁ_read_header__mutmut_5	framed_format_version without the offset: its default is 0
events.log.xǁLogReaderǁframes__mutmut_7	<= for <: at the end of the file read_frame finds fewer than a header's bytes and returns None, leaving the same tail
events.frames.xǁFileBytesǁ__init____mutmut_4	_start = 1 with an empty window: a cache hit would need stop <= 1 with start >= 1, an empty slice, returned before the cache is looked at
events.frames.xǁFileBytesǁ__getitem____mutmut_9	< for <=: an empty slice (stop == start) then comes from the window, empty alike (at most one extra read)
events.frames.xǁFileBytesǁ__getitem____mutmut_15	a slice starting at the window's start is read again instead of served from it: the same bytes (only an extra read)
events.frames.xǁFileBytesǁ__getitem____mutmut_16	as mutant 15
events.frames.xǁFileBytesǁ__getitem____mutmut_18	< for <=: a slice ending at the window's end is read again: the same bytes (only an extra read)
events.frames.xǁFileBytesǁ_pread__mutmut_8	and for or: a full or empty first read then takes the loop, which adds nothing and returns the same bytes
events.frames.xǁFileBytesǁ_pread__mutmut_13	<= for <: once complete, one more pread of 0 bytes returns b"" and ends the loop
events.frames.xǁFileBytesǁ_pread__mutmut_21	asks for more than is missing: the extra bytes are the file's own, after the range, and every slice is clamped to the size at open
events.frames.xǁFileBytesǁnext_data__mutmut_1	> for >=: lseek(SEEK_DATA) at the end of the file fails with ENXIO, which returns the size alike
events.frames.x__next_data__mutmut_1	holes never skipped: the scans read their zeros instead, which hold no frame and strip to nothing (only slower)
events.frames.x__valid_header_after__mutmut_3	<= for <: a chunk starting at the end is empty
events.frames.x__valid_header_after__mutmut_5	_next_data(None): holes are read instead of skipped (only slower, as _next_data mutant 1)
events.frames.x__valid_header_after__mutmut_9	> for >=: at the end (a hole to the end of the file) the chunk read is empty
events.frames.x__valid_header_after__mutmut_10	return (None) for break (then False): every caller only tests its truth
events.frames.x__valid_header_after__mutmut_17	a chunk overlapping the next by two bytes more: only positions below the chunk size are examined, so the same headers are found
events.frames.x__valid_header_after__mutmut_30	<= for <: a header at exactly the chunk size is also the first position of the next chunk
events.frames.x__valid_header_after__mutmut_46	find from pos + 2: "TL" at pos puts "L" at pos + 1, where no "TL" can begin
events.frames.x__only_zeros_after__mutmut_3	as _valid_header_after mutant 3
events.frames.x__only_zeros_after__mutmut_5	as _valid_header_after mutant 5
events.frames.x__only_zeros_after__mutmut_9	as _valid_header_after mutant 9
events.frames.x_read_frame__mutmut_9	size + offset: with fewer than a header's bytes left, no header can begin after the offset, so the scan says no anyway
events.frames.x_read_frame__mutmut_10	> for >=: with exactly a header's bytes left, none can begin at offset + 1
validation.x_checked__mutmut_5	unencodable without the path: its default is ""
validation.x_unencodable__mutmut_5	"UTF-8" for "utf-8": the same codec
validation.x_encodable__mutmut_3	as unencodable mutant 5
validation.x_with_bounds__mutmut_13	with_bounds(Ellipsis) returns Ellipsis itself (no origin, no args)
params.xǁSamplingParamsǁvalidate__mutmut_16	encodable_all here never raises: checked() has already refused every string UTF-8 cannot encode, stop's included (dead code, not a bug)
params.xǁSamplingParamsǁvalidate__mutmut_19	as mutant 16
params.xǁSamplingParamsǁvalidate__mutmut_20	as mutant 16
params.xǁSamplingParamsǁvalidate__mutmut_21	as mutant 16
params.xǁSamplingParamsǁto_spec__mutmut_20	validate (at construction) has already made a str stop a one-element list, so self.stop is never a str here
replay.verify.x__replay__mutmut_23	_diverged with out=None returns before it reads the core or the records
replay.verify.x__replay__mutmut_24	as mutant 23
replay.verify.x__replay__mutmut_39	as mutant 23
replay.verify.x__replay__mutmut_40	as mutant 23
replay.diff.x_value_diff__mutmut_30	zip(strict=None): falsy like strict=False
replay.diff.x_value_diff__mutmut_33	zip without strict: the default is strict=False
replay.diff.x_value_diff__mutmut_38	return for break: nothing follows the loop
replay.diff.x_diff_commands__mutmut_5	autojunk=None: falsy like False
replay.diff.x_diff_commands__mutmut_25	zip(strict=None) over two ranges of equal length (an equal block, or a replace of equal lengths)
replay.diff.x_diff_commands__mutmut_28	as mutant 25
replay.diff.x_diff_commands__mutmut_37	as mutant 25
replay.diff.x_diff_state__mutmut_7	getattr's default: every snapshot sequence (a Seq) has a request_id
replay.diff.x_diff_state__mutmut_10	as mutant 7
replay.diff.x_diff_state__mutmut_13	as mutant 7
replay.diff.x_diff_state__mutmut_18	as mutant 7
replay.diff.x_diff_state__mutmut_21	as mutant 7
replay.diff.x_diff_state__mutmut_24	as mutant 7
replay.diff.x_diff_state__mutmut_36	& for |: both views are the attrs fields of one class, the same keys
replay.diff.x_diff_state__mutmut_54	as mutant 7
replay.diff.x_diff_state__mutmut_57	as mutant 7
replay.diff.x_diff_state__mutmut_67	as mutant 7
replay.diff.x_diff_state__mutmut_70	as mutant 7
replay.diff.x_diff_state__mutmut_89	zip(strict=None): falsy like strict=False
replay.diff.x_diff_state__mutmut_92	zip without strict: the default is strict=False
actors.mailbox.xǁOutboxǁ__init____mutmut_4	sequence numbers from 2: they are only compared with each other (the step actor sorts by source, then sequence)
actors.mailbox.xǁOutboxǁ_stamp__mutmut_3	sequence numbers step by 2: as __init__ mutant 4
actors.streams.xǁDetokenizerǁdecode__mutmut_1	a Protocol's declaration: never called
actors.retire.x_merge_frames__mutmut_9	float("NAN") for float("nan"): the same value
actors.streams.xǁStreamAssemblerǁ__init____mutmut_18	_prefix = None: ids[None:] and ids[None:read] slice from 0, as 0 does, until the first advance sets it
actors.streams.xǁStreamAssemblerǁ__init____mutmut_22	_prefix_text = None at first: the first decode step computes it, the decode of no ids, ""
actors.streams.xǁStreamAssemblerǁ__init____mutmut_24	_last_reasoning = None: falsy like False, and set by every token before it is read
actors.streams.xǁStreamAssemblerǁ__init____mutmut_25	_last_reasoning = True: read only by _flush, and with no token at all it returns "" either way
actors.streams.xǁStreamAssemblerǁ__init____mutmut_34	_last_time = "": read only once _first_time is set, which sets it too
actors.streams.xǁStreamAssemblerǁ__init____mutmut_35	finished = None: falsy like False
actors.streams.xǁStreamAssemblerǁon_tokens__mutmut_23	>= 2 for > 2: a two-token batch is then checked index by index, which refuses exactly what the first/last test refuses
actors.streams.xǁStreamAssemblerǁon_finish__mutmut_42	and for or: a frame was delivered (first set) exactly when count >= 1 (a stop match counts k + 1, otherwise count must equal the tokens delivered)
actors.streams.xǁStreamAssemblerǁon_finish__mutmut_51	first and last are set together
actors.streams.xǁStreamAssemblerǁ_stop_prefix_len__mutmut_25	>= for >: a candidate as long as the best so far cannot change it
actors.streams.xǁStreamAssemblerǁ_content__mutmut_29	<= for <: equal (end, start) keys are the same stop string
actors.streams.xǁStreamAssemblerǁ_content__mutmut_34	_held = None after a match: nothing reads it again (no content after a match; _flush runs only without one)
actors.streams.xǁStreamAssemblerǁ_content__mutmut_35	as mutant 34
actors.streams.xǁStreamAssemblerǁ_content__mutmut_43	keep 0 gives buf[len(buf):], "" alike
actors.streams.xǁStreamAssemblerǁ_flush__mutmut_3	<= for <: with nothing undecoded the tail is the decode of no new ids, ""
actors.streams.xǁStreamAssemblerǁ_flush__mutmut_4	_prefix_text recomputed when it is set: the same decode of the same window
actors.streams.xǁStreamAssemblerǁ_flush__mutmut_5	unreachable: _prefix_text is None only right after the window advanced, when _read == len(ids) and _flush skips the block
actors.streams.xǁStreamAssemblerǁ_flush__mutmut_6	as mutant 5
actors.streams.xǁStreamAssemblerǁ_flush__mutmut_7	as mutant 5
actors.streams.xǁStreamAssemblerǁ_flush__mutmut_8	as mutant 5
actors.streams.xǁStreamAssemblerǁ_flush__mutmut_9	as mutant 5
actors.streams.xǁStreamAssemblerǁ_flush__mutmut_16	the window's indices after the final flush: nothing reads them again
actors.streams.xǁStreamAssemblerǁ_flush__mutmut_17	as mutant 16 (_prefix_text)
actors.streams.xǁStreamAssemblerǁ_flush__mutmut_19	_held after the final flush: nothing reads it again
actors.streams.xǁStreamAssemblerǁ_flush__mutmut_20	as mutant 19
actors.device.x_without_requests__mutmut_21	zip(strict=None): a step's columns have one entry per row, as keep has
actors.device.x_without_requests__mutmut_24	as mutant 21 (no strict)
actors.device.x_without_requests__mutmut_25	as mutant 21 (strict=False)
actors.device.x_with_placeholders__mutmut_4	zip(strict=None): request_ids and sample_indices are columns of one RunStep, equally long
actors.device.x_with_placeholders__mutmut_7	as mutant 4
actors.device.x_with_placeholders__mutmut_8	as mutant 4
actors.device.x_with_placeholders__mutmut_16	one live pick without a result: there is no result only when every row is dead (or there are none), so no row ever takes a pick
actors.device.x_with_placeholders__mutmut_39	StepResult(tokens, None, None): the omitted columns default to None
actors.device.x_with_placeholders__mutmut_40	as mutant 39
actors.device.x_with_placeholders__mutmut_41	as mutant 39
actors.device.x_sampled_ids__mutmut_3	zip(strict=None): request_ids and sample_indices are columns of one RunStep, equally long
actors.device.x_sampled_ids__mutmut_6	as mutant 3
actors.device.x_sampled_ids__mutmut_7	as mutant 3
actors.device.xǁThreadDeviceǁ__init____mutmut_9	_token = "" at first: run sets it before the thread starts, and only the thread reads it
actors.device.xǁThreadDeviceǁrun__mutmut_4	_token = "" once run ends: the thread has exited, nothing reads it again
actors.device.xǁThreadDeviceǁ_report__mutmut_4	trio_token=None: the thread is trio's own worker (to_thread.run_sync), which finds its trio run without the token
actors.device.xǁThreadDeviceǁ_report__mutmut_7	as mutant 4 (the token left out)
actors.device.xǁThreadDeviceǁ_to_spill__mutmut_1	the assert with or: both are set whenever it runs (the token by run, the store by _execute's own assert)
actors.device.xǁThreadDeviceǁ_to_spill__mutmut_8	trio_token=None: as _report mutant 4
actors.device.xǁThreadDeviceǁ_to_spill__mutmut_13	as mutant 8 (the token left out)
actors.device.xǁThreadDeviceǁ_execute__mutmut_9	the poisoned set always intersected: with none poisoned the intersection is empty, as the shortcut's set()
actors.device.xǁThreadDeviceǁ_execute__mutmut_13	always cut: cutting no rows builds an equal step (only slower)
actors.device.xǁThreadDeviceǁ_execute__mutmut_86	a finished copy with error None: the spill actor reads the error only when the copy is missing
actors.device.xǁThreadDeviceǁ_execute__mutmut_90	as mutant 86 ("XXXX")
actors.device.xǁStubDeviceǁ__init____mutmut_1	the default block_size: its one caller, the runtime, passes the core's
actors.device.xǁStubDeviceǁrun__mutmut_14	a finished copy with error None: as ThreadDevice._execute mutant 86
actors.device.xǁStubDeviceǁrun__mutmut_17	as mutant 14 (the error left out)
actors.device.xǁStubDeviceǁrun__mutmut_22	as mutant 14 ("XXXX")
actors.device.xǁStubDeviceǁrun__mutmut_18	the stub's host copy without num_tokens: it holds no data, and only the stub device takes it back, ignoring its contents
actors.device.xǁStubDeviceǁ_run_step__mutmut_11	the poisoned set always intersected: as ThreadDevice._execute mutant 9
actors.device.xǁStubDeviceǁ_run_step__mutmut_15	always cut: as ThreadDevice._execute mutant 13
actors.device.xǁStubDeviceǁ_run_step__mutmut_39	zip(strict=None): columns of one RunStep, equally long
actors.device.xǁStubDeviceǁ_run_step__mutmut_42	as mutant 39
actors.device.xǁStubDeviceǁ_run_step__mutmut_43	as mutant 39
actors.spill.x_remove_stale_spill_dirs__mutmut_16	is_dir(follow_symlinks=None): falsy like False
actors.spill.x_remove_stale_spill_dirs__mutmut_20	stat(follow_symlinks=None): falsy like False
actors.spill.x_remove_stale_spill_dirs__mutmut_21	stat(follow_symlinks=True): the entry is a directory and not a symlink (the test before), so following changes nothing
actors.spill.x_remove_stale_spill_dirs__mutmut_37	7 random bytes for 6 in the claimed name: any name of this process's own is as good
actors.spill.x__make_dirs__mutmut_3	walking up with or: the existing ancestors found above the first one there are then "made" again, each FileExistsError on a directory, skipped and never counted as made (only slower)
actors.spill.xǁSpillStoreǁclose__mutmut_3	_host_used = None after close: a closed store is never used again
actors.spill.xǁSpillStoreǁclose__mutmut_4	as mutant 3 (1)
actors.spill.xǁSpillStoreǁdiscard__mutmut_2	return for break: the only thing skipped is clearing _made, which only discard reads, and it stops at the same non-empty directory again
actors.spill.xǁSpillStoreǁ_path__mutmut_6	a 64-byte hash in the file name for a 12-byte one: still one file per request, inside the directory
actors.spill.xǁSpillStoreǁ_path__mutmut_7	as mutant 6 (13 bytes)
actors.spill.x__serialize__mutmut_5	and for or: a copy has both tensors or neither
actors.spill.xǁSpillActorǁ_put__mutmut_1	the default error "XXXX": the error is read only for a missing copy, and every caller reporting one passes its error
actors.spill.xǁSpillActorǁaccept_nowait__mutmut_1	as _put mutant 1
actors.spill.xǁSpillActorǁaccept_nowait__mutmut_2	the kind None for "copy": the run loop takes everything but "pending" and "drop" as a copy
actors.spill.xǁSpillActorǁaccept_nowait__mutmut_10	as mutant 2 ("XXcopyXX")
actors.spill.xǁSpillActorǁaccept_nowait__mutmut_11	as mutant 2 ("COPY")
actors.step.xǁStepActorǁ__init____mutmut_1	another default fsync: the step actor acts only on "tick"; any other value is "never" here (the log actor parses the policy)
actors.step.xǁStepActorǁ__init____mutmut_2	as mutant 1
actors.step.xǁStepActorǁrun__mutmut_1	needs_tick = None: falsy like False
actors.step.xǁStepActorǁrun_tick__mutmut_18	append_tick without the core's encoded commands: the writer encodes them itself, the same bytes (passing them only saves the work)
actors.step.xǁStepActorǁrun_tick__mutmut_21	as mutant 18
actors.retire.xǁ_Streamǁ__init____mutmut_1	member defaults to 1: it is read only for a stream of a group, and open_group passes each its place
actors.retire.xǁ_Streamǁ__init____mutmut_12	finished = None: falsy like False
actors.retire.xǁ_Streamǁ__init____mutmut_14	closed = None: falsy like False
actors.retire.xǁClientStreamǁ__del____mutmut_5	a wider guard: _close repeats each test (a closed stream returns at once, a finished or failed one reports nothing), so the extra calls change nothing
actors.retire.xǁClientStreamǁ__del____mutmut_6	as mutant 5
actors.retire.xǁClientStreamǁ__del____mutmut_7	as mutant 5 (_stream is always set)
actors.retire.xǁGroupStreamǁ__del____mutmut_5	as ClientStream.__del__ mutant 5 (_group is always set)
actors.retire.xǁGroupStreamǁ__del____mutmut_8	as ClientStream.__del__ mutant 5: close_nowait's _close calls repeat the tests; it also empties the order of a group no one reads any more
actors.retire.xǁGroupStreamǁ__del____mutmut_9	as mutant 8
actors.retire.xǁGroupStreamǁ__del____mutmut_11	as mutant 8
actors.retire.xǁRetireActorǁopen_stream__mutmut_9	output_id None: the assembler then takes request_id, the same
actors.retire.xǁRetireActorǁ_open__mutmut_6	max_frames None for a stream opened after the fatal error: it never gets a frame
actors.retire.xǁRetireActorǁ_open__mutmut_7	no group for a stream opened after the fatal error: the group's reader raises its error before it would wait
actors.retire.xǁRetireActorǁ_open__mutmut_8	member None for a stream opened after the fatal error: it never gets a frame, so its place is never queued
actors.retire.xǁRetireActorǁ_open__mutmut_13	as mutant 8 (the member left out)
actors.retire.xǁRetireActorǁ_open__mutmut_17	the prompt kept without prompt_logprobs: the assembler reads it only when they are asked for
actors.retire.xǁRetireActorǁdeliver_nowait__mutmut_14	on_finish without the time: it reads the times of the tokens, never now
actors.retire.xǁRetireActorǁ_emit__mutmut_2	n = None: the first fast path is never taken, and the general path builds the same columns (only slower)
actors.retire.xǁRetireActorǁ_emit__mutmut_25	top alternatives handed to a stream that did not ask for logprobs: the assembler reads them only when its spec asks
actors.retire.xǁRetireActorǁ_emit__mutmut_26	and for or: a tick carries both top columns or neither
actors.retire.xǁRetireActorǁ_emit__mutmut_32	the prompt entry looked up for every stream: the assembler reads it only when its spec asks for prompt logprobs
EOF
)

EQUIVALENT="$EQUIVALENT" SCORE_ONLY="$score_only" AREA="$area" exec .venv/bin/python - "${modules[@]}" <<'PY'
"""Run an area's mutants (unless --score), then print the score table of each area asked for."""

import fnmatch
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from mutmut.stats import status_by_exit_code

ROOT = Path.cwd()
EQUIVALENT = {}
for line in os.environ["EQUIVALENT"].splitlines():
    if line.strip():
        name, _, reason = line.partition("\t")
        EQUIVALENT["tickloom." + name.strip()] = reason.strip()

pyproject_text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
mutmut_config = tomllib.loads(pyproject_text)["tool"]["mutmut"]
AREA_TABLES = mutmut_config.get("areas", {})
AREAS = ["core", *AREA_TABLES]


class Area:
    def __init__(self, name: str) -> None:
        self.name = name
        if name == "core":
            table = {k: v for k, v in mutmut_config.items() if k != "areas"}
            self.workdir = ROOT
        else:
            table = AREA_TABLES[name]
            self.workdir = ROOT / "mutants" / "areas" / name
        self.table = table
        self.only_mutate = table["only_mutate"]
        self.patterns = table.get("mutants")  # None: every mutant of the files
        # a module's label is its path under the deepest folder common to the area's files, without .py
        self.folder = os.path.commonpath([os.path.dirname(p) for p in self.only_mutate])

    def metas(self) -> dict[str, Path]:
        found = {}
        for pattern in self.only_mutate:
            for meta in sorted((self.workdir / "mutants").glob(pattern + ".meta")):
                if meta.name.endswith(".py.meta"):
                    rel = meta.relative_to(self.workdir / "mutants").as_posix().removesuffix(".py.meta")
                    found[rel.removeprefix(self.folder + "/")] = meta
        return found

    def modules(self) -> list[str]:
        """The area's modules, from its files (a glob is expanded in the source tree)."""
        names = []
        for pattern in self.only_mutate:
            for path in sorted(ROOT.glob(pattern)):
                if path.suffix == ".py":
                    names.append(path.relative_to(ROOT).as_posix().removesuffix(".py").removeprefix(self.folder + "/"))
        return names

    def dotted(self, module: str) -> str:
        return f"{self.folder}/{module}".replace("/", ".")

    def in_scope(self, mutant: str) -> bool:
        return self.patterns is None or any(fnmatch.fnmatchcase(mutant, p) for p in self.patterns)

    def prepare(self) -> None:
        """An area's own folder: links to what mutmut copies, and pyproject.toml with the area's [tool.mutmut]."""
        if self.name == "core":
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        tops = {Path(p).parts[0] for p in self.table.get("source_paths", []) + self.table.get("also_copy", [])}
        for top in sorted(tops | {"tests"}):
            link = self.workdir / top
            if not link.is_symlink():
                link.symlink_to(os.path.relpath(ROOT / top, self.workdir))
        lines = [f"{key} = {json.dumps(value, ensure_ascii=False)}" for key, value in self.table.items()
                 if key != "mutants"]
        # [tool.mutmut] is the last table of pyproject.toml (with its areas): everything before it is kept
        before = pyproject_text[: pyproject_text.index("\n[tool.mutmut]\n") + 1]
        text = before + "[tool.mutmut]\n" + "\n".join(lines) + "\n"
        target = self.workdir / "pyproject.toml"
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")

    def run(self, wanted: list[str]) -> None:
        # mutmut reruns every mutant named on its command line, and skips those with a result otherwise. So: the
        # first time, name the modules; after that, name only the mutants not yet killed (a survivor is retested, as
        # a new test may kill it; a mutant whose function changed has lost its result and is tested again).
        self.prepare()
        metas = self.metas()
        names: list[str] = []
        for module in wanted or self.modules():
            meta = metas.get(module)
            if meta is None:
                prefix = f"{self.dotted(module)}."
                if self.patterns is None:
                    names.append(prefix + "*")
                else:
                    names.extend(p for p in self.patterns if p.startswith(prefix))
                continue
            for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
                if code not in (1, 3) and name not in EQUIVALENT and self.in_scope(name):
                    names.append(name)
        if names:
            mutmut = ROOT / ".venv" / "bin" / "mutmut"
            children = os.environ.get("MUTATE_CHILDREN", "1")
            code = subprocess.run([str(mutmut), "run", "--max-children", children, *names], cwd=self.workdir).returncode
            if code:
                sys.exit(f"scripts/mutate.sh: mutmut run failed (exit status {code}) for the area {self.name}")

    def score(self, wanted: list[str]) -> None:
        columns = ("killed", "survived", "timeout", "suspicious", "no tests", "not checked", "equivalent")
        totals = dict.fromkeys(columns, 0)
        survivors = []
        print(f"area {self.name}: {', '.join(self.only_mutate)}" + (" (some functions)" if self.patterns else ""))
        print(f"{'module':<12}" + "".join(f"{c:>12}" for c in columns) + f"{'score':>9}")
        for module, meta in self.metas().items():
            if wanted and module not in wanted:
                continue
            counts = dict.fromkeys(columns, 0)
            for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
                if not self.in_scope(name):
                    continue
                status = "equivalent" if name in EQUIVALENT else status_by_exit_code[code]
                if status in ("segfault", "caught by type check", "skipped", "check was interrupted by user"):
                    status = "suspicious" if status == "segfault" else "not checked"
                counts[status] += 1
                if status in ("survived", "suspicious", "no tests"):
                    survivors.append((status, name))
            if not sum(counts.values()):
                continue
            for c in columns:
                totals[c] += counts[c]
            print(f"{module:<12}" + "".join(f"{counts[c]:>12}" for c in columns) + _score(counts))
        print(f"{'total':<12}" + "".join(f"{totals[c]:>12}" for c in columns) + _score(totals))
        for status, name in survivors:
            print(f"  {status}: {name}")


def _score(counts: dict[str, int]) -> str:
    scored = counts["killed"] + counts["survived"] + counts["timeout"] + counts["suspicious"] + counts["no tests"]
    return f"{100 * (counts['killed'] + counts['timeout']) / scored:8.1f}%" if scored else "       -"


area_name = os.environ["AREA"]
if area_name and area_name not in AREAS:
    sys.exit(f"scripts/mutate.sh: no area {area_name!r}; the areas are {', '.join(AREAS)}")
wanted = sys.argv[1:]
if os.environ["SCORE_ONLY"] == "0":
    Area(area_name).run(wanted)
for i, name in enumerate([area_name] if area_name else AREAS):
    if i:
        print()
    Area(name).score(wanted)
PY
