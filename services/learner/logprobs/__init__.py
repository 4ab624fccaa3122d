"""Per-token logprobs (and entropies) of completions: the policy forward, the chunked LM head, packing and the
micro-batch plan."""
