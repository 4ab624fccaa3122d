"""Rewards for end-to-end tests: a trivially learnable one (the share of a completion's characters that are
'a') and a regex format reward over strings."""

import re


def letter_a(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [t.count("a") / max(len(t), 1) for t in texts]


def has_number(prompts, completions, **kwargs):
    """A regex format reward over strings, as written for TRL's standard format: 1 when the completion holds
    a number. ``re.search`` raises on a message list, and the check below raises on a chat prompt: either is
    a bug, which stops the scorer and so fails the test that uses it."""
    if not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"a standard-format prompt reached the rewards as {type(prompts[0]).__name__}")
    return [1.0 if re.search(r"\d+", completion) else 0.0 for completion in completions]
