"""``asyncgrpo config explain``: where the prompts come from, the batch arithmetic of one step, the same run in
TRL and verl, and the start-up check's result (:mod:`services.launcher.preflight`).

Our vocabulary (README, "Batch arithmetic"): ``groups_per_step`` prompts per optimizer step, ``group_size``
(G) completions each, ``completions per step = groups_per_step * G``, ``micro_batch_size`` completions per
forward/backward, ``gradient accumulation = completions per step / micro_batch_size``, ``num_iterations``
optimizer steps per batch, ``sync_every`` steps per weight push, ``max_staleness``, and the admission bound
``(max_staleness + 1) * groups_per_step`` groups in flight.

TRL: ``generation_batch_size = per_device_train_batch_size * num_processes * steps_per_generation``
completions, ``/ num_generations`` distinct prompts; an optimizer step uses
``per_device_train_batch_size * num_processes * gradient_accumulation_steps`` of them.
verl: ``data.train_batch_size * rollout.n`` sequences per step; ``n_gpus / tensor_model_parallel_size``
rollout workers share the prompts; ``ppo_mini_batch_size`` (prompts) is multiplied by n, then divided by
the GPU count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.launcher.preflight import Problem
from shared.config.data import DataSettings
from shared.config.objective import ALGORITHMS, recipe_overrides
from shared.config.pipeline import PipelineConfig

# Our loss type -> the verl loss_agg_mode that aggregates as it does.
_VERL_AGG_FROM_OURS = {
    "dapo": "token-mean",
    "bnpo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "luspo": "seq-mean-token-sum",
    "seq_sum": "seq-mean-token-sum",
    "cispo": "token-mean",
    "sapo": "seq-mean-token-mean",
    "vespo": "token-mean",
    "geo_mean": "seq-mean-token-mean",
    "kl_cov": "token-mean",
}


@dataclass(frozen=True)
class TrlBatch:
    completions_per_generation: int
    prompts_per_generation: int
    completions_per_optimizer_step: int
    prompts_per_optimizer_step: int
    optimizer_steps_per_generation: int


def trl_batch(
    per_device_train_batch_size: int,
    num_generations: int,
    *,
    num_processes: int = 1,
    steps_per_generation: int | None = None,
    gradient_accumulation_steps: int = 1,
) -> TrlBatch:
    """TRL GRPOTrainer: what one generation block and one optimizer step hold."""
    steps = steps_per_generation or gradient_accumulation_steps
    generation = per_device_train_batch_size * num_processes * steps
    if generation % num_generations:
        raise ValueError(
            f"TRL needs generation_batch_size ({generation}) divisible by num_generations ({num_generations})"
        )
    per_step = per_device_train_batch_size * num_processes * gradient_accumulation_steps
    return TrlBatch(
        generation,
        generation // num_generations,
        per_step,
        per_step // num_generations,
        max(1, steps // gradient_accumulation_steps),
    )


@dataclass(frozen=True)
class VerlBatch:
    sequences_per_step: int
    rollout_workers: int
    prompts_per_rollout_worker: int
    mini_batch_sequences: int
    mini_batch_sequences_per_gpu: int
    optimizer_steps_per_rollout: int


def verl_batch(
    train_batch_size: int,
    rollout_n: int,
    n_gpus: int,
    *,
    tensor_model_parallel_size: int = 1,
    ppo_mini_batch_size: int | None = None,
) -> VerlBatch:
    """verl's ppo_trainer: sequences per step, rollout workers, and the normalised mini-batch."""
    workers = n_gpus // tensor_model_parallel_size
    mini = ppo_mini_batch_size or train_batch_size
    return VerlBatch(
        sequences_per_step=train_batch_size * rollout_n,
        rollout_workers=workers,
        prompts_per_rollout_worker=train_batch_size // workers,
        mini_batch_sequences=mini * rollout_n,
        mini_batch_sequences_per_gpu=mini * rollout_n // n_gpus,
        optimizer_steps_per_rollout=train_batch_size // mini,
    )


def explain(pipeline: PipelineConfig, problems: Sequence[Problem] | None = None) -> str:
    """Where ``pipeline``'s prompts come from, one optimizer step in our words, its TRL and verl settings, and
    the start-up check's ``problems`` (None: the check was not run)."""
    sections = [
        _data(pipeline.learner.data),
        _our_step(pipeline),
        _trajectory(pipeline),
        _algorithm(pipeline),
        _in_trl(pipeline),
        _in_verl(pipeline),
    ]
    if problems is not None:
        sections.append(_start_check(problems))
    return "\n\n".join("\n".join(lines) for lines in sections)


def _data(data: DataSettings) -> list[str]:
    """The data source, and what of each row the prompt and the reward functions get."""
    renames = ", ".join(f"{old} -> {new}" for old, new in data.renames.items())
    framing = [
        f"system prompt {data.system_prompt[:40]!r}" if data.system_prompt else "",
        f"{len(data.examples)} example turns" if data.examples else "",
        f"assistant prefill {data.assistant_prefill!r}" if data.assistant_prefill else "",
    ]
    return [
        "Data",
        f"  source                                  {data.source!r}  (split {data.train_split!r})",
        f"  prompt column                           {data.prompt_column or 'prompt, else question'}",
        f"  prompt framing                          {', '.join(f for f in framing if f) or 'none (as in the rows)'}",
        f"  columns renamed for the rewards         {renames or 'none (every column under its own name)'}",
        f"  columns required (extra_columns)        {', '.join(data.extra_columns) or 'none'}",
        f"  epochs                                  {data.epochs or 'no limit'}  (shuffle_seed {data.shuffle_seed})",
    ]


def _start_check(problems: Sequence[Problem]) -> list[str]:
    """The start-up check's verdict: each problem, or that none was found."""
    if not problems:
        return ["Start-up check: passed (rewards, environment and the rewards' columns)"]
    return [
        f"Start-up check: {len(problems)} problem(s); asyncgrpo run would refuse to start",
        *(f"  - {p}" for p in problems),
    ]


# The settings across the scorer and the learner that make an algorithm, in the order explain shows them.
_ALGORITHM_FIELDS = (
    ("scorer", "estimator"),
    ("scorer", "scale_rewards"),
    ("scorer", "drop_zero_std_groups"),
    ("learner", "loss_type"),
    ("learner", "ratio_level"),
    ("learner", "epsilon_low"),
    ("learner", "epsilon_high"),
)


def _algorithm(pipeline: PipelineConfig) -> list[str]:
    """The algorithm's settings in both tables, each marked as the recipe's or as overriding it."""
    name = pipeline.learner.algorithm or pipeline.scorer.algorithm
    lines = [f"Algorithm: {name} (the recipe fills both tables)" if name else "Algorithm (no recipe: algorithm unset)"]
    overrides = {table: recipe_overrides(table, getattr(pipeline, table)) for table in ("scorer", "learner")}
    for table, field in _ALGORITHM_FIELDS:
        settings = getattr(pipeline, table)
        recipe = ALGORITHMS.get(settings.algorithm or "", {}).get(table, {})
        where = ""
        if field in overrides[table]:
            where = f"overrides the recipe's {overrides[table][field][0]!r}"
        elif field in recipe:
            where = "recipe"
        value = f"{getattr(settings, field)!r:<12}({where})" if where else repr(getattr(settings, field))
        lines.append(f"  {table + '.' + field:<40}{value}")
    lines.append(f"  {'learner aggregation':<40}{pipeline.learner.resolved_aggregation!r}")
    lines += [f"  note: {note}" for note in pipeline.algorithm_notes()]
    return lines


def _our_step(pipeline: PipelineConfig) -> list[str]:
    s = pipeline.learner
    completions = s.completions_per_step
    tokens = completions * (s.max_prompt_length + s.max_completion_length)
    return [
        "One optimizer step",
        f"  prompts (groups_per_step)               {s.groups_per_step}",
        f"  completions per prompt (G)              {s.group_size}",
        f"  completions                             {completions}",
        f"  token upper bound                       {tokens}  ({completions} x (max_prompt_length "
        f"{s.max_prompt_length} + max_completion_length {s.max_completion_length}))",
        f"  completion tokens at most               {completions * s.max_completion_length}",
        f"  micro-batches (gradient accumulation)   {completions // s.micro_batch_size}  of {s.micro_batch_size} "
        "completions",
        f"  optimizer steps per batch               {s.num_iterations}  (num_iterations)",
        f"  optimizer steps per weight sync         {s.sync_every}",
        f"  groups admitted in flight at most       {s.admission_bound}  ((max_staleness {s.max_staleness} + 1) x "
        f"{s.groups_per_step})",
        f"  generator replicas here                 {pipeline.launcher.generators}",
    ]


def _trajectory(pipeline: PipelineConfig) -> list[str]:
    """With an ``[environment]``: what one multi-turn trajectory may hold (docs/concepts/multi-turn-design.md §2.6)."""
    environment, s, g = pipeline.generator.environment, pipeline.learner, pipeline.generator
    if environment is None:
        return ["Per sample: one completion (no [environment] table)"]
    source = environment.python or environment.url or "tools " + ", ".join(environment.tools)
    in_flight = g.max_prompts_in_flight * s.group_size
    return [
        f"Per trajectory (environment {source}, tool parser {environment.tool_parser})",
        f"  prompt                                  <= max_prompt_length {s.max_prompt_length}",
        f"  after the prompt                        <= max_completion_length {s.max_completion_length} tokens: "
        "sampled turns + template tokens + tool results",
        f"  one tool result                         <= max_tool_response_tokens {environment.max_tool_response_tokens}"
        " content tokens (+ the template's wrapper)",
        f"  assistant turns                         <= max_turns {environment.max_turns} (the last gets what is left "
        f"of {s.max_completion_length})",
        f"  engine context                          <= {s.max_prompt_length + s.max_completion_length} = "
        f"{s.max_prompt_length} + {s.max_completion_length} (generator.max_model_len {g.max_model_len})",
        f"  trajectories in flight                  <= max_prompts_in_flight {g.max_prompts_in_flight} x G "
        f"{s.group_size} = {in_flight} (engine batch max_num_seqs {g.max_num_seqs}); to hide the environment's "
        "latency keep it >= max_num_seqs x (1 + env latency / turn time)",
        "  trained on                              sampled tokens only (loss_mask); tool and template tokens are "
        "context",
    ]


def _in_trl(pipeline: PipelineConfig) -> list[str]:
    s = pipeline.learner
    micro = s.completions_per_step // s.micro_batch_size
    return [
        "The same run in TRL (GRPOConfig, one process)",
        f"  num_generations = {s.group_size}",
        f"  per_device_train_batch_size = {s.micro_batch_size}",
        f"  gradient_accumulation_steps = {micro}",
        f"  steps_per_generation = {micro}",
        f"  num_iterations = {s.num_iterations}",
        f"  max_completion_length = {s.max_completion_length}",
        f"  max_prompt_length = {s.max_prompt_length}",
        f"  learning_rate = {s.lr}",
        f"  beta = {s.beta}",
        f"  epsilon = {s.epsilon_low}, epsilon_high = {s.epsilon_high}",
        f'  loss_type = "{s.loss_type}"',
        f'  scale_rewards = "{pipeline.scorer.scale_rewards}"',
        f"  temperature = {s.temperature}",
        "  (TRL trains on-policy or within one generation block; our max_staleness has no TRL equivalent)",
        *(
            ["  (drop_zero_std_groups: TRL's GRPOTrainer has no dynamic sampling; it trains every group it samples)"]
            if pipeline.scorer.drop_zero_std_groups
            else []
        ),
    ]


def _in_verl(pipeline: PipelineConfig) -> list[str]:
    s = pipeline.learner
    return [
        "The same run in verl (ppo_trainer.yaml, n_gpus_per_node = 1)",
        f"  data.train_batch_size = {s.groups_per_step}",
        f"  actor_rollout_ref.rollout.n = {s.group_size}",
        f"  actor_rollout_ref.actor.ppo_mini_batch_size = {s.groups_per_step}",
        f"  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = {s.micro_batch_size}",
        f"  actor_rollout_ref.actor.ppo_epochs = {s.num_iterations}",
        f"  actor_rollout_ref.actor.optim.lr = {s.lr}",
        f"  actor_rollout_ref.actor.clip_ratio_low = {s.epsilon_low}, clip_ratio_high = {s.epsilon_high}",
        f'  actor_rollout_ref.actor.loss_agg_mode = "{_VERL_AGG_FROM_OURS[s.loss_type]}"',
        f"  actor_rollout_ref.actor.use_kl_loss = {str(s.beta > 0).lower()}, kl_loss_coef = {s.beta}",
        f"  data.max_prompt_length = {s.max_prompt_length}, data.max_response_length = {s.max_completion_length}",
        f"  algorithm.norm_adv_by_std_in_grpo = {str(pipeline.scorer.scale_rewards != 'none').lower()}",
        *(_verl_filter_groups(s.max_replacement_groups) if pipeline.scorer.drop_zero_std_groups else []),
    ]


def _verl_filter_groups(max_replacement_groups: int | None) -> list[str]:
    """verl's dynamic sampling (``algorithm.filter_groups``, applied by its DAPO recipe's trainer,
    ``recipe.dapo.main_dapo``; ``seq_reward``: a sequence's summed reward before any KL, which our scorer's combined
    reward is). Its bound counts generation batches of ``data.gen_batch_size`` prompts and stops the run when
    reached; ours (``max_replacement_groups``) counts single groups and trains on what the step has, so only "no
    bound" maps."""
    bound = (
        "max_num_gen_batches = 0 (no bound, as max_replacement_groups = None)"
        if max_replacement_groups is None
        else f"max_num_gen_batches: verl counts batches and stops there; our max_replacement_groups = "
        f"{max_replacement_groups} groups, then trains on what it has"
    )
    return [
        f'  algorithm.filter_groups.enable = true, metric = "seq_reward", {bound}',
        "  (filter_groups is applied by verl's DAPO recipe trainer, recipe.dapo.main_dapo)",
    ]
