"""Multi-turn trajectories (docs/concepts/multi-turn-design.md §2.4-§2.7): the chat-template delta between turns, the
tool-call parser, the per-trajectory state and the async runner that drives a trajectory turn by turn."""
