"""Every metric name the services emit, what it means, and TRL's name for the same figure where TRL has one.

The services write their figures as flat ``{name: float}`` dicts (the learner's ``metrics.jsonl`` and trackers,
every service's Prometheus ``/metrics``, where :func:`shared.telemetry.prometheus_name` turns ``reward/std`` into
``asyncgrpo_reward_std``). This registry is the reference docs/reference/metrics.md is generated from, and
``tests/unit/test_reference_docs.py`` fails when the source emits a name that is not here, or this lists one
that nothing emits. A placeholder in angle brackets stands for one path segment (``<function>``: a reward
function's name, which may itself hold ``/``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LEARNER, SCORER, GENERATOR, EVERY = "learner", "scorer", "generator", "every service"
STEP, EVAL, COUNTER, GAUGE = "step record", "evaluation record", "Prometheus counter", "Prometheus gauge"


@dataclass(frozen=True)
class Metric:
    name: str  # ``<placeholder>`` segments stand for a reward function, an outcome, a reason...
    meaning: str
    emitted_by: str  # LEARNER, SCORER, GENERATOR, EVERY, or two joined by ", "
    kind: str  # STEP (metrics.jsonl, trackers, a gauge), EVAL, COUNTER or GAUGE
    trl_name: str = ""  # TRL's GRPOTrainer name for the same figure, "" where TRL has none

    def pattern(self) -> re.Pattern[str]:
        """The names this entry stands for: ``<function>`` matches any text, another placeholder one segment."""
        parts = re.split(r"(<[a-z_]+>)", self.name)
        regex = "".join(
            (".+" if part == "<function>" else "[^/]+") if part.startswith("<") else re.escape(part) for part in parts
        )
        return re.compile(f"{regex}$")


def _m(name: str, meaning: str, emitted_by: str, kind: str, trl_name: str = "") -> Metric:
    return Metric(name, meaning, emitted_by, kind, trl_name)


_L, _LS = LEARNER, f"{LEARNER}, {SCORER}"

_REWARDS = (
    _m("reward", "mean combined reward of the batch's completions (scorer: of the last group)", _LS, STEP, "reward"),
    _m("reward_std", "mean within-group standard deviation of the combined reward", _LS, STEP, "reward_std"),
    _m("frac_reward_zero_std", "share of groups whose rewards are all equal (no signal)", _LS, STEP,
       "frac_reward_zero_std"),
    _m("frac_reward_nan", "share of completions whose combined reward is NaN (a failed optional reward)", _L, STEP),
    _m("rewards/<function>/mean", "mean of one reward function's non-NaN rewards", _LS, STEP,
       "rewards/<function>/mean"),
    _m("rewards/<function>/std", "standard deviation of one reward function's non-NaN rewards", _LS, STEP,
       "rewards/<function>/std"),
)  # fmt: skip

_COMPLETIONS = (
    _m("completions/mean_length", "mean sampled tokens per completion", _LS, STEP, "completions/mean_length"),
    _m("completions/min_length", "fewest sampled tokens of a completion", _LS, STEP, "completions/min_length"),
    _m("completions/max_length", "most sampled tokens of a completion", _LS, STEP, "completions/max_length"),
    _m("completions/clipped_ratio", "share of completions cut at the token limit", _LS, STEP,
       "completions/clipped_ratio"),
    _m("completions/mean_terminated_length", "mean length of the completions that ended by themselves", _L, STEP,
       "completions/mean_terminated_length"),
    _m("completions/min_terminated_length", "shortest completion that ended by itself", _L, STEP,
       "completions/min_terminated_length"),
    _m("completions/max_terminated_length", "longest completion that ended by itself", _L, STEP,
       "completions/max_terminated_length"),
    _m("completion_tokens", "sampled tokens of the step's batch", _L, STEP),
    _m("num_tokens", "prompt and completion tokens trained on so far (cumulative)", _L, STEP, "num_tokens"),
)  # fmt: skip

_LOSS = (
    _m("loss", "the optimizer step's loss", _L, STEP, "loss"),
    _m("grad_norm", "gradient norm before clipping", _L, STEP, "grad_norm"),
    _m("learning_rate", "the scheduler's learning rate of the step", _L, STEP, "learning_rate"),
    _m("entropy", "mean token entropy of the sampled tokens", _L, STEP, "entropy"),
    _m("entropy_coef", "the entropy bonus coefficient (adaptive_entropy adjusts it)", _L, STEP),
    _m("kl", "mean KL estimate to the reference model (beta > 0)", _L, STEP, "kl"),
    _m("clip_ratio/low_mean", "share of tokens clipped below 1 - epsilon_low (negative advantage)", _L, STEP,
       "clip_ratio/low_mean"),
    _m("clip_ratio/high_mean", "share of tokens clipped above 1 + epsilon_high (positive advantage)", _L, STEP,
       "clip_ratio/high_mean"),
    _m("clip_ratio/region_mean", "share of tokens clipped on either side", _L, STEP, "clip_ratio/region_mean"),
    _m("clip_ratio/low_min", "smallest clip_ratio/low_mean of the step's micro-batches", _L, STEP,
       "clip_ratio/low_min"),
    _m("clip_ratio/high_max", "largest clip_ratio/high_mean of the step's micro-batches", _L, STEP,
       "clip_ratio/high_max"),
    _m("cispo_clip_ratio", "share of tokens whose CISPO weight was capped (loss_type cispo)", _L, STEP,
       "cispo_clip_ratio"),
    _m("kl_cov/selected_mean", "share of tokens the kl_cov penalty chose (loss_type kl_cov)", _L, STEP),
    _m("vespo/phi_seq_mean", "mean VESPO sequence weight phi(w) (loss_type vespo)", _L, STEP, "vespo/phi_seq_mean"),
    _m("off_policy_mask/masked_mean", "share of tokens masked as too far off-policy", _L, STEP),
    _m("sampling/importance_sampling_ratio/min", "smallest importance weight pi_old / pi_behaviour", _L, STEP,
       "sampling/importance_sampling_ratio/min"),
    _m("sampling/importance_sampling_ratio/mean", "mean importance weight", _L, STEP,
       "sampling/importance_sampling_ratio/mean"),
    _m("sampling/importance_sampling_ratio/max", "largest importance weight", _L, STEP,
       "sampling/importance_sampling_ratio/max"),
    _m("sampling/sampling_logp_difference/mean", "mean |behaviour - recomputed old logprob| per token", _L, STEP,
       "sampling/sampling_logp_difference/mean"),
    _m("sampling/sampling_logp_difference/max", "largest |behaviour - recomputed old logprob|", _L, STEP,
       "sampling/sampling_logp_difference/max"),
)  # fmt: skip

_PIPELINE = (
    _m("staleness/mean", "mean policy versions between sampling a group and training on it", _L, STEP),
    _m("staleness/max", "most policy versions between sampling a group and training on it", _L, STEP),
    _m("policy_version", "the policy version this step produced", _L, STEP),
    _m("step", "the last optimizer step (Prometheus only)", _L, GAUGE),
    _m("groups_in_flight", "groups admitted but not yet trained or dropped", _L, STEP),
    _m("tokens_per_second", "sampled tokens of the batch over the step's wall time", _L, STEP),
    _m("train_tokens_per_second", "sampled tokens of the batch over the optimizer step's time", _L, STEP),
    _m("seconds/wait", "seconds waiting for the batch's scored groups", _L, STEP),
    _m("seconds/old_logprobs", "seconds of the old-logprob (and entropy) pass", _L, STEP),
    _m("seconds/train", "seconds of the optimizer step", _L, STEP),
    _m("seconds/train_wall", "wall seconds of training the batch (every iteration)", _L, STEP),
    _m("seconds/sync", "seconds the weight push took (0 without one)", _L, STEP),
    _m("seconds/step", "wall seconds of the whole step", _L, STEP),
    _m("dynamic_sampling/skipped_groups", "zero-std groups skipped while filling this batch", _L, STEP),
    _m("dynamic_sampling/capped", "1 when the batch was cut short at max_replacement_groups skipped groups", _L, STEP),
)

_COUNTERS = (
    *(
        _m(f"counters/{name}", meaning, _L, STEP)
        for name, meaning in (
            ("groups_admitted", "groups let into the pipeline (cumulative)"),
            ("groups_trained", "groups trained on (cumulative)"),
            ("groups_stale_dropped", "groups dropped as too stale (cumulative)"),
            ("groups_zero_std_dropped", "groups dropped for equal rewards (cumulative)"),
            ("groups_from_lost_versions", "groups sampled by versions a restart lost (cumulative)"),
            ("groups_already_trained", "redelivered groups already trained (cumulative)"),
            ("groups_rejected", "groups that failed validation (cumulative)"),
            ("groups_nonfinite", "groups of a batch none of whose steps was applied: not finite (cumulative)"),
            ("weight_pushes", "weight pushes that succeeded (cumulative)"),
            ("weight_push_failures", "weight pushes that failed (cumulative)"),
            ("input_tokens_seen", "prompt and completion tokens trained on (cumulative)"),
        )
    ),
    _m("train/nonfinite_steps", "optimizer steps not applied: loss or gradient norm not finite (cumulative)", _L, STEP),
    _m("counters/eval_orphans", "evaluation groups that came back after their round ended", _L, EVAL),
    _m("stream/scored/recovered", "scored groups a failed read left pending, read again (cumulative)", _L, STEP),
)

_TRAJECTORIES = (
    _m("tools/call_frequency", "tool calls per trajectory", _L, STEP, "tools/call_frequency"),
    _m("tools/failure_frequency", "failed tool calls over tool calls", _L, STEP, "tools/failure_frequency"),
    _m("tools/num_turns/mean", "mean assistant turns per trajectory", _L, STEP),
    _m("tools/num_turns/max", "most assistant turns of a trajectory", _L, STEP),
    _m("trajectories/mean_tokens", "mean tokens per trajectory, tool results and template included", _L, STEP),
    _m("trajectories/cut_frequency", "share of trajectories cut before they ended", _L, STEP),
    _m("trajectories/cut/<reason>", "share cut for one reason: max_turns, token_budget, context, template_break",
       _L, STEP),
    _m("trajectories/template_breaks", "trajectories whose chat template broke (must stay 0)", f"{_L}, {GENERATOR}",
       STEP),
    _m("env/latency_seconds/p50", "median seconds of an environment call", _L, STEP),
    _m("env/latency_seconds/p95", "95th percentile seconds of an environment call", _L, STEP),
)  # fmt: skip

_EVAL = (
    _m("eval/prompts", "held-out prompts that came back", _L, EVAL),
    _m("eval/missing", "held-out prompts that did not come back in time", _L, EVAL),
    _m("eval/seconds", "wall seconds of the evaluation round", _L, EVAL),
    _m("eval/reward", "mean combined reward on the held-out prompts", _L, EVAL),
    _m("eval/reward_std", "standard deviation of the held-out rewards", _L, EVAL),
    _m("eval/rewards/<function>/mean", "one reward function's mean on the held-out prompts", _L, EVAL),
    _m("eval/completions/mean_length", "mean held-out completion length", _L, EVAL),
    _m("eval/completions/clipped_ratio", "share of held-out completions cut at the token limit", _L, EVAL),
    _m("eval/policy_version/min", "oldest policy version that sampled a held-out prompt", _L, EVAL),
    _m("eval/policy_version/max", "newest policy version that finished a held-out prompt", _L, EVAL),
    _m("eval/tools/call_frequency", "held-out tool calls per trajectory", _L, EVAL),
    _m("eval/tools/failure_frequency", "held-out failed tool calls over tool calls", _L, EVAL),
    _m("eval/tools/num_turns/mean", "held-out mean assistant turns per trajectory", _L, EVAL),
    _m("eval/tools/num_turns/max", "held-out most assistant turns of a trajectory", _L, EVAL),
)

_SCORER = (
    _m("scorer/groups", "groups scored for training", SCORER, COUNTER),
    _m("scorer/groups_evaluated", "held-out groups scored for evaluation", SCORER, COUNTER),
    _m("scorer/groups_zero_std", "groups whose rewards were all equal", SCORER, COUNTER),
    _m("scorer/groups_dropped", "zero-std groups dropped (drop_zero_std_groups)", SCORER, COUNTER),
    _m(
        "scorer/groups_dead_lettered",
        "groups dead-lettered: a required reward failed for max_reward_wait_s",
        SCORER,
        COUNTER,
    ),
    _m("scorer/group_retries", "retries of held groups' required rewards", SCORER, COUNTER),
    _m("scorer/failures", "groups that failed to score", SCORER, COUNTER),
    _m("scorer/rejected", "rollouts that failed validation", SCORER, COUNTER),
    _m("scorer/groups_nonfinite", "groups dead-lettered: their rewards or advantages were not finite", SCORER, COUNTER),
    _m("scorer/groups_held", "groups held while a reward function is out", SCORER, GAUGE),
    _m("scorer/intake_paused", "1 while the scorer takes no new rollouts", SCORER, GAUGE),
    _m("rewards/<function>/calls", "calls of one reward function", SCORER, COUNTER),
    _m("rewards/<function>/errors", "calls that failed (outages)", SCORER, COUNTER),
    _m("rewards/<function>/short_circuited", "calls skipped while its breaker was open", SCORER, COUNTER),
    _m("rewards/<function>/nan_values", "NaN rewards it returned", SCORER, COUNTER),
    _m("rewards/<function>/bugs", "failures of an in-process function that are not outages", SCORER, COUNTER),
    _m("rewards/<function>/bad_inputs", "groups that could not be put to it", SCORER, COUNTER),
    _m("rewards/<function>/timeouts", "Python calls abandoned at timeout_s", SCORER, COUNTER),
    _m("rewards/<function>/retried_5xx", "retries after an HTTP 5xx", SCORER, COUNTER),
    _m("rewards/<function>/retried_transport", "retries after a connection error", SCORER, COUNTER),
    _m("rewards/<function>/latency_seconds_total", "seconds spent in its calls", SCORER, COUNTER),
    _m("rewards/<function>/breaker_open", "1 while its circuit breaker is open", SCORER, GAUGE),
    _m("rewards/<function>/hung_threads", "threads still running abandoned calls", SCORER, GAUGE),
    _m("stream/rollouts/claimed", "rollouts claimed from another consumer (stopped, or handed back)", SCORER, COUNTER),
    _m("stream/rollouts/recovered", "rollouts a failed read left pending, read again", SCORER, COUNTER),
    _m("stream/rollouts/dead_lettered", "rollouts moved to the dead-letter stream", SCORER, COUNTER),
    _m("stream/rollouts/duplicates", "rollouts delivered twice and skipped", SCORER, COUNTER),
)

_GENERATOR = (
    _m("generator/prompts", "prompts turned into rollouts", GENERATOR, COUNTER),
    _m("generator/completions", "completions sampled", GENERATOR, COUNTER),
    _m("generator/tokens", "tokens sampled", GENERATOR, COUNTER),
    _m("generator/failures", "prompts whose sampling failed (delivered again)", GENERATOR, COUNTER),
    _m("generator/rejected", "prompt tasks that failed validation", GENERATOR, COUNTER),
    _m(
        "generator/nonfinite_groups",
        "groups dead-lettered: the engine gave NaN, infinite or positive logprobs",
        GENERATOR,
        COUNTER,
    ),
    _m(
        "generator/rolled_back",
        "groups sampled while the weights went back a version: sampled again",
        GENERATOR,
        COUNTER,
    ),
    _m(
        "generator/abandoned",
        "multi-turn prompts given up after an environment fault (redelivered)",
        GENERATOR,
        COUNTER,
    ),
    _m("generator/heartbeat_errors", "registry heartbeats that failed", GENERATOR, COUNTER),
    _m("generator/gpu_lease_errors", "GPU lease renewals that failed", GENERATOR, COUNTER),
    _m("generator/tokens_per_second", "recent sampled tokens per second", GENERATOR, GAUGE),
    _m("generator/requests_in_flight", "prompts being sampled", GENERATOR, GAUGE),
    _m("generator/engine_requests", "requests inside the vLLM engine", GENERATOR, GAUGE),
    _m("generator/prompt_stream_lag", "prompts waiting in the prompts stream", GENERATOR, GAUGE),
    _m("generator/policy_version", "the policy version the engine holds", GENERATOR, GAUGE),
    _m("generator/weights_ok", "0 after a failed weight update, until the next one succeeds", GENERATOR, GAUGE),
    _m(
        "stream/prompts/claimed",
        "prompt tasks claimed from another consumer (stopped, or handed back)",
        GENERATOR,
        COUNTER,
    ),
    _m("stream/prompts/recovered", "prompt tasks a failed read left pending, read again", GENERATOR, COUNTER),
    _m("stream/prompts/dead_lettered", "prompt tasks moved to the dead-letter stream", GENERATOR, COUNTER),
    _m("stream/prompts/malformed", "prompt tasks that could not be decoded", GENERATOR, COUNTER),
    _m("stream/prompts/duplicates", "prompt tasks delivered twice and skipped", GENERATOR, COUNTER),
    _m("env/calls/<outcome>", "environment calls by outcome: ok, retried, fault, tool_error", GENERATOR, COUNTER),
    _m("env/sessions_opened", "environment sessions opened", GENERATOR, COUNTER),
    _m("env/close_failures", "environment sessions that failed to close", GENERATOR, COUNTER),
    _m("env/sessions_open", "environment sessions open now", GENERATOR, GAUGE),
    _m("env/accepting", "1 while the environment takes new sessions", GENERATOR, GAUGE),
    _m("registry/invalid", "registry entries this process refused: invalid, or claiming a live id", EVERY, COUNTER),
)

# In the reference's order: the learner's step record, its evaluation record, then each service's Prometheus.
METRICS: tuple[Metric, ...] = (
    _REWARDS + _COMPLETIONS + _LOSS + _PIPELINE + _COUNTERS + _TRAJECTORIES + _EVAL + _SCORER + _GENERATOR
)
SECTIONS: tuple[tuple[str, tuple[Metric, ...]], ...] = (
    ("Rewards", _REWARDS),
    ("Completions and tokens", _COMPLETIONS),
    ("Loss and optimizer", _LOSS),
    ("Pipeline, staleness and time", _PIPELINE),
    ("Counters", _COUNTERS),
    ("Multi-turn trajectories and tools", _TRAJECTORIES),
    ("Evaluation", _EVAL),
    ("Scorer", _SCORER),
    ("Generator and every service", _GENERATOR),
)


def lookup(name: str) -> Metric | None:
    """The entry that stands for an emitted ``name`` (``rewards/accuracy/mean`` -> ``rewards/<function>/mean``);
    an exact entry wins over a placeholder one. None: the name is not in the registry."""
    exact = [m for m in METRICS if m.name == name]
    if exact:
        return exact[0]
    return next((m for m in METRICS if m.pattern().match(name)), None)
