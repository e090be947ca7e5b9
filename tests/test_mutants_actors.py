"""Behavioural tests that kill the mutants of the actors area (scripts/mutate.sh --area actors)."""
