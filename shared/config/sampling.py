"""The learner's sampling settings (``[learner]``, ``LEARNER_*``): sent with every prompt, applied by the generators.

``max_completion_length`` is an objective field (:mod:`shared.config.objective`: the dr_grpo aggregation reads
it); the check that ``min_completion_length`` stays below it is the learner's (:mod:`shared.config.learner`).
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class SamplingSettings(BaseModel):
    """Sampling, sent with every prompt; the generators apply it."""

    temperature: float = Field(1.0, gt=0, description="Sampling temperature (logprobs use the same).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling (-1: off).")
    min_p: float = Field(0.0, ge=0, le=1, description="Min-p sampling: drop tokens below min_p x the top one (0: off).")
    repetition_penalty: float = Field(1.0, gt=0, description="vLLM's repetition penalty (1: off).")
    sampling_seed: int | None = Field(
        None,
        ge=0,
        description="Seed of the generators' sampling: each training prompt's G completions get a seed of their "
        "own from it and the prompt's dataset position, so two runs with the same seed sample the same completions "
        "of the same prompt under the same weights (on the same machine). None: unseeded. On GPUs a seeded request "
        "skips FlashInfer's sampler for PyTorch's.",
    )
    min_completion_length: int = Field(
        0,
        ge=0,
        description="vLLM's min_tokens for training samples: end-of-sequence and stop tokens are masked and stop "
        "strings ignored until a completion has this many tokens (0: off). Single-turn tasks only (refused beside "
        "an [environment], whose turns end at the model's own turn end); evaluation samples without it.",
    )
    max_prompt_length: int = Field(
        512,
        ge=1,
        description="Prompts longer than this, in the tokens the generator samples from, are skipped (counted). An "
        "environment task's tool schemas and reset observation are added at the generator and not counted here; a "
        "prompt that then outgrows the engine's context is set aside there.",
    )
    model_context: int = Field(0, ge=0, description="Model context (0: read from the model's config).")

    def behaviour_logprobs_problem(self) -> str | None:
        """Why ``old_logprobs = "behaviour"`` cannot be used with these settings, or None: a filter that makes the
        generator sample (and report logprobs of) another distribution than the learner's softmax at
        ``temperature`` (top-p, top-k, min-p, repetition penalty, a minimum length)."""
        on = {
            "top_p": self.top_p < 1.0,
            "top_k": self.top_k != -1,
            "min_p": self.min_p > 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "min_completion_length": self.min_completion_length > 0,
        }
        filters = [f"{name} = {getattr(self, name)}" for name, active in on.items() if active]
        if not filters:
            return None
        return (
            f"old_logprobs = 'behaviour' puts the generator's logprobs in the clipped ratio, and with "
            f"{', '.join(filters)} they are a filtered distribution's, which the learner does not compute (the ratio "
            "would be off 1 on every token); turn the filter off, or use 'recompute' or 'reuse' (there the gap is a "
            "capped importance weight)"
        )
