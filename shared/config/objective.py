"""The objective: every setting of the loss, defined once, torch-free.

:class:`Objective` is the one model of the loss's settings: the learner's settings inherit its fields (they stay
flat in ``[learner]`` and ``LEARNER_*``), and ``services/learner/objective/loss.py`` takes an :class:`Objective`
as it is.
Each field has one default, each cross-field rule one check, each list of names one tuple, here.

``algorithm`` is a shorthand over two services: a named recipe (:data:`ALGORITHMS`) that fills the scorer's
advantage settings and the learner's objective together, e.g. Dr. GRPO is ``scale_rewards = "none"`` in the
scorer *and* ``loss_type = "dr_grpo"`` in the learner. A field set in the file or the environment overrides the
recipe's value (``asyncgrpo config explain`` shows which ones did); the recipe never refuses a combination.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo", "geo_mean", "kl_cov"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
Aggregation = Literal["grpo", "bnpo", "dr_grpo", "dapo", "seq_sum"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
KlEstimator = Literal["k1", "abs", "k2", "k3", "low_var_kl"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KlEstimator)
RatioLevel = Literal["token", "sequence"]

# The aggregation each loss type uses in its peer (TRL 1.16 ``_compute_loss``; verl's recommended mode).
DEFAULT_AGGREGATION: dict[str, Aggregation] = {
    "grpo": "grpo",
    "bnpo": "bnpo",
    "dr_grpo": "dr_grpo",
    "dapo": "dapo",
    "luspo": "seq_sum",
    "cispo": "dapo",
    "sapo": "grpo",
    "vespo": "dapo",
    "geo_mean": "grpo",
    "kl_cov": "dapo",
}
CLIPPED_LOSSES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # a clipped ratio, which delta bounds
TOKEN_ONLY_LOSSES: tuple[str, ...] = ("geo_mean", "kl_cov")  # verl computes their own ratios; no sequence variant


AlgorithmName = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "rloo", "reinforce_pp"]
_GROUP_SCALED = {"estimator": "grpo", "scale_rewards": "group"}
# Each recipe's settings, by table; a table's fields not named keep their defaults. Sources: TRL 1.16's
# GRPOConfig documentation of each paper's settings, and the papers (README, Algorithm).
ALGORITHMS: dict[str, dict[str, dict[str, Any]]] = {
    "grpo": {"scorer": _GROUP_SCALED, "learner": {"loss_type": "grpo"}},
    "dr_grpo": {"scorer": {"estimator": "grpo", "scale_rewards": "none"}, "learner": {"loss_type": "dr_grpo"}},
    "dapo": {
        "scorer": {**_GROUP_SCALED, "drop_zero_std_groups": True},
        "learner": {"loss_type": "dapo", "epsilon_high": 0.28},
    },
    "gspo": {
        "scorer": _GROUP_SCALED,
        "learner": {"loss_type": "grpo", "ratio_level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4},
    },
    "cispo": {"scorer": _GROUP_SCALED, "learner": {"loss_type": "cispo"}},
    "sapo": {"scorer": _GROUP_SCALED, "learner": {"loss_type": "sapo"}},
    "rloo": {"scorer": {"estimator": "rloo", "scale_rewards": "group"}, "learner": {"loss_type": "grpo"}},
    "reinforce_pp": {
        "scorer": {"estimator": "reinforce_pp", "scale_rewards": "group"},
        "learner": {"loss_type": "grpo"},
    },
}
ALGORITHM_KEY = "algorithm"  # also read from the top of the configuration file, for every service that has it


class AlgorithmRecipe(BaseModel):
    """The ``algorithm`` shorthand of a service's settings: the recipe's values for ``recipe_table`` fill the
    fields the file, the environment or the caller left unset."""

    recipe_table: ClassVar[str] = ""

    algorithm: AlgorithmName | None = Field(
        None,
        description="A named recipe (grpo, dr_grpo, dapo, gspo, cispo, sapo, rloo, reinforce_pp) that fills the "
        "scorer's advantage and the learner's objective settings together; a field set explicitly overrides it "
        "(config explain shows which). Usually set once at the top of the file.",
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_recipe(cls, data: Any) -> Any:
        name = data.get(ALGORITHM_KEY) if isinstance(data, dict) else None
        if name not in ALGORITHMS:  # None, or a wrong name the field's own validation reports
            return data
        return {**ALGORITHMS[name].get(cls.recipe_table, {}), **data}


def recipe_overrides(table: str, settings: BaseModel) -> dict[str, tuple[Any, Any]]:
    """``{field: (recipe's value, value in force)}`` for each field of ``table``'s recipe set otherwise."""
    name = getattr(settings, ALGORITHM_KEY, None)
    recipe = ALGORITHMS.get(name, {}).get(table, {}) if name else {}
    return {
        field: (want, getattr(settings, field)) for field, want in recipe.items() if getattr(settings, field) != want
    }


class Objective(AlgorithmRecipe):
    """The loss's settings (README, Algorithm). Defaults: the plain GRPO clip objective without KL."""

    model_config = ConfigDict(extra="forbid")
    recipe_table: ClassVar[str] = "learner"

    loss_type: LossType = Field(
        "grpo",
        description="Objective and its aggregation (README, Algorithm): grpo, bnpo, dr_grpo, dapo, luspo clip "
        "the ratio; cispo, sapo, vespo as TRL; geo_mean (GMPO) and kl_cov as verl.",
    )
    loss_aggregation: Aggregation | None = Field(
        None, description="Override the loss type's aggregation (verl's loss_agg_mode); None: the loss type's own."
    )
    ratio_level: RatioLevel = Field(
        "token", description="Policy ratio per token, or per sequence (GSPO; TRL importance_sampling_level)."
    )
    epsilon_low: float = Field(0.2, ge=0, description="Lower clip: ratio >= 1 - epsilon_low.")
    epsilon_high: float = Field(0.2, ge=0, description="Upper clip: ratio <= 1 + epsilon_high (DAPO: 0.28).")
    delta: float | None = Field(None, description="Two-sided clipping bound on the unclipped ratio (None: off).")
    cispo_clip_max: float = Field(
        5.0, gt=0, description="cispo: cap on the detached ratio (TRL: epsilon_high, 5.0 in ScaleRL; verl: 1 + high)."
    )
    cispo_clip_min: float | None = Field(
        None, ge=0, description="cispo: floor on the ratio (verl: 1 - low; TRL: none)."
    )
    sapo_temperature_pos: float = Field(1.0, gt=0, description="sapo: gate temperature where the advantage is > 0.")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="sapo: gate temperature where the advantage is <= 0.")
    vespo_k_pos: float = Field(2.0, ge=0, description="vespo: power k of the Gamma weight for advantages >= 0.")
    vespo_lambda_pos: float = Field(3.0, gt=0, description="vespo: decay lambda of the Gamma weight, advantages >= 0.")
    vespo_k_neg: float = Field(3.0, ge=0, description="vespo: power k of the Gamma weight for advantages < 0.")
    vespo_lambda_neg: float = Field(2.0, gt=0, description="vespo: decay lambda of the Gamma weight, advantages < 0.")
    kl_cov_ratio: float = Field(0.0002, gt=0, le=1, description="kl_cov: share of tokens given the KL penalty.")
    kl_cov_coef: float = Field(0.1, ge=0, description="kl_cov: coefficient of |log ratio| (verl's ppo_kl_coef).")
    beta: float = Field(0.0, ge=0, description="KL coefficient to the initial model (0: no reference model).")
    kl_estimator: KlEstimator = Field(
        "k3", description="KL estimator: k1, abs, k2 (verl mse), k3 (TRL), low_var_kl (verl's clamped k3)."
    )
    kl_bias_correction: bool = Field(
        True, description="Multiply the KL term by the policy ratio (TRL use_bias_correction_kl; DeepSeek-V3.2)."
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions cut by max_completion_length out of the loss (they keep their advantage)."
    )
    off_policy_mask_threshold: float | None = Field(
        None,
        ge=0,
        description="Drop sequences with advantage < 0 whose mean (behaviour - current) logprob exceeds this "
        "(DeepSeek-V3.2; None: off).",
    )
    top_entropy_quantile: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Train only on the top share of tokens by entropy over the batch (1: all; paper 0.2).",
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient (initial value when adaptive).")
    adaptive_entropy: bool = Field(
        False, description="Skywork-OR1 controller (TRL use_adaptive_entropy): move entropy_coef toward entropy_target."
    )
    entropy_target: float = Field(0.2, ge=0, description="Adaptive: the bonus applies while entropy <= this (nats).")
    entropy_coef_min: float = Field(0.0, ge=0, description="Adaptive: lowest entropy_coef.")
    entropy_coef_max: float = Field(1.0, ge=0, description="Adaptive: highest entropy_coef.")
    entropy_coef_delta: float = Field(0.005, ge=0, description="Adaptive: entropy_coef step per optimizer step.")
    importance_correction: bool = Field(True, description="Weight tokens by pi_old/pi_behaviour (AReaL).")
    importance_level: RatioLevel = Field("token", description="Importance weight per token or sequence.")
    importance_mode: Literal["truncate", "mask"] = Field("truncate", description="Truncate or mask large weights.")
    importance_cap: float = Field(2.0, gt=0, description="Largest importance weight kept.")
    importance_cap_min: float | None = Field(None, description="Smallest importance weight kept (None: no floor).")
    max_completion_length: int = Field(
        256, ge=1, description="Most tokens per completion (the generators' limit; the dr_grpo aggregation's length)."
    )

    @property
    def resolved_aggregation(self) -> Aggregation:
        """``loss_aggregation``, or the loss type's own when it is None."""
        return self.loss_aggregation or DEFAULT_AGGREGATION[self.loss_type]

    @classmethod
    def of(cls, settings: BaseModel) -> Objective:
        """The objective fields of ``settings`` (the learner's, which inherit them), as an :class:`Objective`."""
        return cls.model_construct(**{name: getattr(settings, name) for name in cls.model_fields})

    @model_validator(mode="after")
    def _check_objective(self) -> Objective:
        for problem in objective_problems(self):
            raise ValueError(problem)
        return self


def objective_problems(o: Objective) -> list[str]:
    """Cross-field rules of the objective; each message says how to fix it."""
    problems = []
    if o.delta is not None and o.loss_type not in CLIPPED_LOSSES:
        problems.append(
            f"delta clips the ratio of {', '.join(CLIPPED_LOSSES)}; loss_type = {o.loss_type!r} has no such ratio: "
            "remove delta"
        )
    if o.delta is not None and o.delta <= 1 + o.epsilon_high:
        problems.append(f"delta ({o.delta}) must exceed 1 + epsilon_high ({1 + o.epsilon_high})")
    if o.ratio_level == "sequence" and o.loss_type in TOKEN_ONLY_LOSSES:
        problems.append(f"loss_type = {o.loss_type!r} defines its own ratio; set ratio_level = 'token'")
    if o.cispo_clip_min is not None and o.cispo_clip_min > o.cispo_clip_max:
        problems.append(
            f"cispo_clip_min ({o.cispo_clip_min}) exceeds cispo_clip_max ({o.cispo_clip_max}); lower it or unset it"
        )
    if o.importance_cap_min is not None and o.importance_cap_min > o.importance_cap:
        problems.append(
            f"importance_cap_min ({o.importance_cap_min}) exceeds importance_cap ({o.importance_cap}); lower it"
        )
    return problems + _entropy_problems(o)


def _entropy_problems(o: Objective) -> list[str]:
    if o.entropy_coef_min > o.entropy_coef_max:
        return [f"entropy_coef_min ({o.entropy_coef_min}) exceeds entropy_coef_max ({o.entropy_coef_max}); swap them"]
    if o.adaptive_entropy and not o.entropy_coef_min <= o.entropy_coef <= o.entropy_coef_max:
        return [
            f"adaptive_entropy starts from entropy_coef ({o.entropy_coef}), which lies outside [entropy_coef_min, "
            f"entropy_coef_max] = [{o.entropy_coef_min}, {o.entropy_coef_max}]; set it inside"
        ]
    return []
