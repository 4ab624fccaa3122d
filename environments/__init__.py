"""Environments for multi-turn tool use: the HTTP protocol both halves speak, and (later) the Python adapter,
the client and the server (docs/concepts/multi-turn-design.md §2.3). Layer 2: imports ``shared`` only, never torch or
vLLM; the generator and the environment server import it."""
