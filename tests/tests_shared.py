"""Constants shared by several test modules."""

PROMPT_40 = list(range(200, 240))
