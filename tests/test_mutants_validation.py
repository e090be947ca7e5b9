"""Behavioural tests that kill the mutants of the validation area (scripts/mutate.sh --area validation)."""
