"""A trivially learnable reward for end-to-end tests: the share of a completion's characters that are 'a'."""


def letter_a(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [t.count("a") / max(len(t), 1) for t in texts]
