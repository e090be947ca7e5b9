"""Behavioural tests that kill the mutants of the replay area (scripts/mutate.sh --area replay)."""
