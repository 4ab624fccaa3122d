"""Scorer settings: ``[scorer]`` (and ``[[scorer.rewards]]``) in the TOML file, ``SCORER_*`` in the env."""

from __future__ import annotations

import math
import socket
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from shared.config import endpoint
from shared.config.base import HOSTNAME_BASED, ServiceSettings
from shared.config.objective import AlgorithmRecipe
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
        if self.url is not None:
            for url in (self.url, self.health_url):
                if url is not None and urlsplit(url).scheme not in ("http", "https"):
                    raise ValueError(f"reward {self.name!r}: plugin URL {url!r} must start with http:// or https://")
        elif self.function is None and self.name not in BUILTIN_RANGES:
            raise ValueError(
                f"unknown reward {self.name!r}: built-ins are {', '.join(sorted(BUILTIN_RANGES))}; "
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


class ScorerSettings(ServiceSettings, AlgorithmRecipe):
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
    claim_idle_ms: int = Field(30_000, ge=100, description="Rollouts pending this long on a dead scorer move.")
    max_deliveries: int = Field(3, ge=1, description="Deliveries of a rollout before it is dead-lettered.")
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
    host: str = Field("0.0.0.0", description="Address the HTTP server binds.")
    port: int = Field(8002, ge=0, le=65535, description="HTTP port (/health, /ready, /metrics).")
    max_request_bytes: int = Field(
        64 << 10,
        ge=1024,
        description="Largest HTTP request body taken (413 past it). The scorer's endpoints take no body "
        "(its one POST, /shutdown, has none): 64 KiB is ample, and bounds what a client can make it read.",
    )
    api_docs: bool = Field(
        False, description="Serve /docs, /redoc and /openapi.json (behind the API token, like every non-probe path)."
    )

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
