"""Scorer settings: ``[scorer]`` (and ``[[scorer.rewards]]``) in the TOML file, ``SCORER_*`` in the env."""

from __future__ import annotations

import difflib
import math
import socket
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from shared.config import endpoint
from shared.config.base import HOSTNAME_BASED, ServiceSettings
from shared.config.bounds import EntryBoundsSettings
from shared.config.http_server import HttpServerSettings
from shared.config.objective import AlgorithmRecipe
from shared.config.stream_consumer import StreamConsumerSettings
from shared.records import AdvantageSpec

# The built-in reward functions the scorer implements (services/scorer/rewards/builtin.py, a test keeps the
# two in step): each one's range of values, for checking a BNPO configuration's bounds at start, and the
# parameters its ``params`` table accepts.
BUILTIN_RANGES: dict[str, tuple[float, float]] = {
    "correctness": (0.0, 1.0),
    "digit": (0.0, 1.0),
    "hard_format": (0.0, 1.0),
    "soft_format": (0.0, 1.0),
    "mark": (0.0, 1.0),
    "overlong": (-1.0, 0.0),
    "env_reward": (-math.inf, math.inf),  # the environment's get_reward(): its range is the environment's
}
BUILTIN_PARAMS: dict[str, set[str]] = {"overlong": {"buffer"}}


class RewardSpec(BaseModel):
    """One reward function: a built-in (by name), a Python plugin (``function``) or HTTP plugin (``url``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="Built-in name, or the label of a plugin.")
    weight: float = Field(1.0, description="Multiplies this function's reward in the combined reward.")
    required: bool = Field(
        True,
        description="A failure holds the group back (retried until max_reward_wait_s, then dead-lettered) and "
        "an open breaker pauses the scorer; False: a failure gives NaN for this reward on that group.",
    )
    function: str | None = Field(None, description="Python plugin 'module:function' (TRL's signature).")
    url: str | None = Field(None, description="HTTP plugin endpoint (protocol asyncgrpo.reward/v1).")
    params: dict[str, Any] = Field(default_factory=dict, description="Built-in parameters (overlong: buffer).")
    batched: bool = Field(
        False,
        description="Call the function once over several groups' completions, as TRL calls a reward once over "
        "a step's whole generation batch: the groups this scorer holds for it, up to scorer.groups_per_step (else "
        "max_groups_in_flight), are put together (after at most scorer.reward_batch_wait_s) and its values split "
        "back per group; timeout_s covers the whole call. Python functions only (built-in or function =); False: "
        "once per group.",
    )
    timeout_s: endpoint.TimeoutS = 10.0
    retries: endpoint.Retries = 2
    backoff_s: endpoint.BackoffS = 0.2
    concurrency: endpoint.Concurrency = 8
    breaker_failures: endpoint.BreakerFailures = 5
    breaker_reset_s: endpoint.BreakerResetS = 30.0
    health_url: str | None = Field(None, description="HTTP plugin: probed at start; default <url dir>/health.")
    headers: endpoint.Headers = Field(default_factory=dict)
    bearer_token: endpoint.BearerToken = None
    bearer_token_env: endpoint.BearerTokenEnv = None

    @model_validator(mode="after")
    def _one_kind(self) -> RewardSpec:
        if self.function and self.url:
            raise ValueError(f"reward {self.name!r}: set either function (Python plugin) or url (HTTP), not both")
        if self.batched and self.url:
            raise ValueError(
                f"reward {self.name!r}: batched = true applies to Python functions (built-in or function = "
                "'module:function'); an HTTP plugin is sent one group per request: remove batched"
            )
        if self.url is not None:
            for url in (self.url, self.health_url):
                if url is not None and urlsplit(url).scheme not in ("http", "https"):
                    raise ValueError(f"reward {self.name!r}: plugin URL {url!r} must start with http:// or https://")
        elif self.function is None and self.name not in BUILTIN_RANGES:
            close = difflib.get_close_matches(self.name, BUILTIN_RANGES, n=3)
            guess = f" (did you mean {' or '.join(repr(name) for name in close)}?)" if close else ""
            raise ValueError(
                f"unknown reward {self.name!r}: built-ins are {', '.join(sorted(BUILTIN_RANGES))}{guess}; "
                "for your own, set function = 'module:function' (Python) or url = 'http://...' (HTTP plugin)"
            )
        elif self.function is None:
            allowed = BUILTIN_PARAMS.get(self.name, set())
            unknown = sorted(set(self.params) - allowed)
            if unknown:
                raise ValueError(
                    f"reward {self.name!r} takes no parameter {', '.join(unknown)}"
                    f" (it takes: {', '.join(sorted(allowed)) or 'none'})"
                )
        elif ":" not in self.function:
            raise ValueError(f"reward {self.name!r}: function must be 'module:function', got {self.function!r}")
        self._check_auth()
        return self

    def _check_auth(self) -> None:
        owner = f"reward {self.name!r}"
        problem = endpoint.auth_problem(
            self.url, self.headers, self.bearer_token, self.bearer_token_env, owner=owner, server="HTTP plugins"
        )
        if problem is not None:
            raise ValueError(problem)

    def start_problems(self) -> list[str]:
        """Checks of the scorer's own environment, run when the scorer starts (never by another service
        validating the whole file: the variable is set in the scorer's container only)."""
        return endpoint.token_env_problems(self.bearer_token_env, owner=f"reward {self.name!r}", service="scorer")

    def request_headers(self) -> dict[str, str]:
        """The headers to send to an HTTP plugin, secrets revealed (never log the result)."""
        return endpoint.request_headers(self.headers, self.bearer_token, self.bearer_token_env)

    @property
    def kind(self) -> Literal["builtin", "python", "http"]:
        return "http" if self.url else "python" if self.function else "builtin"


class ScorerSettings(EntryBoundsSettings, HttpServerSettings, StreamConsumerSettings, ServiceSettings, AlgorithmRecipe):
    recipe_table: ClassVar[str] = "scorer"
    model_config = SettingsConfigDict(env_prefix="SCORER_", extra="forbid", env_nested_delimiter="__")
    toml_table = "scorer"

    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="correctness")],
        min_length=1,
        description="Reward functions.",
    )
    estimator: Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "bnpo"] = Field(
        "grpo",
        description="Advantage estimator: grpo, rloo (leave-one-out), reinforce_pp[_baseline] (REINFORCE++, batch "
        "whitened), bnpo (0/1-like rewards).",
    )
    reward_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize",
        description="Several rewards: normalise their weighted sum (TRL default), or each in its group, then sum "
        "and normalise over the batch (GDPO).",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="GRPO std scaling: group (TRL default), batch, none (Dr. GRPO)."
    )
    std_unbiased: bool = Field(True, description="Bessel-corrected std (TRL); False: population std (DeepSeek).")
    advantage_eps: float = Field(1e-4, ge=0, description="Added to the std before dividing.")
    reward_min: float = Field(0.0, description="BNPO: lowest possible combined reward.")
    reward_max: float = Field(1.0, description="BNPO: highest possible combined reward.")
    drop_zero_std_groups: bool = Field(
        False,
        description="DAPO dynamic sampling: mark groups whose rewards all agree so the learner skips them.",
    )
    scorer_id: str = Field(
        default_factory=lambda: f"scorer-{socket.gethostname()}",
        description="Replica name.",
        json_schema_extra=HOSTNAME_BASED,
    )
    max_groups_in_flight: int = Field(8, ge=1, description="Rollouts scored at once (plugins are I/O bound).")
    groups_per_step: int | None = Field(
        None,
        ge=1,
        description="The learner's groups_per_step, as batched rewards see it: one call covers up to this many "
        "groups (TRL's generation batch). None: the learner's, where the file's [learner] table (or [common]) sets "
        "it, else max_groups_in_flight; set it here only for a scorer whose file has no [learner] table (a value "
        "that differs from the learner's is refused). Must not exceed max_groups_in_flight when a reward is batched.",
    )
    reward_batch_wait_s: float = Field(
        1.0,
        ge=0,
        description="How long a batched reward waits, from the first group of a batch, for the rest (up to "
        "groups_per_step) before it is called over the groups it has; 0: over the groups ready at that moment.",
    )
    max_steps: int | None = Field(
        None,
        ge=1,
        description="The learner's max_steps, as reward functions see it (trainer_state.max_steps). None: the "
        "learner's, where the file's [learner] table (or [common]) sets it, else trainer_state.max_steps is None; "
        "set it here only for a scorer whose file has no [learner] table (a value that differs from the learner's "
        "is refused).",
    )
    max_scored_backlog: int = Field(512, ge=1, description="Scored groups waiting for the learner before we wait.")
    max_reward_wait_s: float = Field(
        1800.0,
        gt=0,
        description="A group whose required reward keeps failing is dead-lettered (with the reason) after "
        "this many seconds of retries, counted from this scorer's first attempt.",
    )
    retry_backoff_s: float = Field(
        1.0, gt=0, description="First delay before a held group's failed required rewards are retried (doubles)."
    )
    retry_backoff_max_s: float = Field(30.0, gt=0, description="Longest delay between a held group's retries.")
    OVERRIDES: ClassVar[dict[str, str]] = {"port": "each service its own port, so all of them run on one host"}
    port: int = Field(8002, ge=0, le=65535, description="HTTP port (/health, /ready, /metrics).")

    @field_validator("rewards")
    @classmethod
    def _unique_names(cls, rewards: list[RewardSpec]) -> list[RewardSpec]:
        names = [r.name for r in rewards]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"reward names must be unique; repeated: {', '.join(duplicates)}")
        return rewards

    @model_validator(mode="after")
    def _estimator_fits(self) -> ScorerSettings:
        if self.estimator != "grpo" and self.scale_rewards != "group":
            raise ValueError(
                f"scale_rewards = {self.scale_rewards!r} shapes the grpo estimator only; estimator = "
                f"{self.estimator!r} normalises its own way: leave scale_rewards at 'group' or use estimator = 'grpo'"
            )
        if self.reward_aggregation == "normalize_then_sum" and self.estimator != "grpo":
            raise ValueError(
                "reward_aggregation = 'normalize_then_sum' (GDPO) makes its own group-then-batch advantages; "
                f"set estimator = 'grpo' (got {self.estimator!r}) or use sum_then_normalize"
            )
        return self

    @model_validator(mode="after")
    def _batch_fits(self) -> ScorerSettings:
        batched = [spec.name for spec in self.rewards if spec.batched]
        if batched and self.batch_groups > self.max_groups_in_flight:
            raise ValueError(
                f"groups_per_step ({self.groups_per_step}) exceeds max_groups_in_flight ({self.max_groups_in_flight}):"
                f" batched reward {batched[0]!r} could never be called over a whole step's groups, since the scorer"
                " holds no more than max_groups_in_flight at once; raise scorer.max_groups_in_flight to at least "
                "groups_per_step (the scorer's, else the learner's)"
            )
        return self

    @model_validator(mode="after")
    def _backoff_order(self) -> ScorerSettings:
        if self.retry_backoff_s > self.retry_backoff_max_s:
            raise ValueError(
                f"retry_backoff_s ({self.retry_backoff_s}) exceeds retry_backoff_max_s ({self.retry_backoff_max_s});"
                " raise retry_backoff_max_s or lower retry_backoff_s"
            )
        return self

    @model_validator(mode="after")
    def _bnpo_bounds(self) -> ScorerSettings:
        if self.estimator != "bnpo":
            return self
        if not self.reward_max > self.reward_min:
            raise ValueError(f"reward_max ({self.reward_max}) must exceed reward_min ({self.reward_min})")
        low = high = 0.0
        for spec in self.rewards:
            if spec.kind != "builtin" or spec.name == "env_reward":
                continue  # a plugin's (or an environment's) range is unknown; checked on every batch instead
            lo, hi = BUILTIN_RANGES[spec.name]
            low += min(lo * spec.weight, hi * spec.weight)
            high += max(lo * spec.weight, hi * spec.weight)
        if low < self.reward_min or high > self.reward_max:
            raise ValueError(
                f"BNPO needs the combined reward inside [reward_min, reward_max] = [{self.reward_min}, "
                f"{self.reward_max}], but these rewards and weights span [{low}, {high}]; set reward_min/"
                "reward_max to cover it or change the weights"
            )
        return self

    def start_problems(self) -> list[str]:
        return super().start_problems() + [problem for spec in self.rewards for problem in spec.start_problems()]

    @property
    def batch_groups(self) -> int:
        """The most groups one call of a batched reward covers: ``groups_per_step``, else
        ``max_groups_in_flight``."""
        return self.groups_per_step or self.max_groups_in_flight

    @property
    def advantage_spec(self) -> AdvantageSpec:
        return AdvantageSpec(
            estimator=self.estimator,
            scale_rewards=self.scale_rewards,
            eps=self.advantage_eps,
            std_unbiased=self.std_unbiased,
            reward_min=self.reward_min,
            reward_max=self.reward_max,
            reward_aggregation=self.reward_aggregation,
            reward_weights=tuple(r.weight for r in self.rewards),
        )
