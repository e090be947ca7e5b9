"""Behavioural tests that kill the mutants of the events area (scripts/mutate.sh --area events)."""
