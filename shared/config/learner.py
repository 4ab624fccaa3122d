"""Learner settings: ``[learner]`` in TOML (``[data]``: :mod:`shared.config.data`), ``LEARNER_*`` in the environment.

Batch vocabulary (the README's "Batch arithmetic" section draws it):

* ``groups_per_step`` prompts per optimizer step, each sampled ``group_size`` (G) times, so
  ``completions per step = groups_per_step * G``;
* ``micro_batch_size`` completions per forward/backward (accumulation: ``completions per step / micro_batch_size``);
* ``num_iterations`` optimizer steps on each batch (TRL's mu), ``sync_every`` steps between weight pushes;
* ``max_staleness``: groups sampled more than this many policy versions ago are dropped;
* admission: at most ``(max_staleness + 1) * groups_per_step`` groups in flight.

The fields come in groups, one model each (:class:`BatchSettings`, :class:`SamplingSettings`, ...), each with the
checks that read its fields alone; :class:`LearnerSettings` inherits them all, so ``[learner]`` and ``LEARNER_*``
stay flat, and keeps the checks that read several groups.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
import secrets
import time
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from shared.config.base import DEFAULT_TEXT, ServiceSettings
from shared.config.bounds import EntryBoundsSettings
from shared.config.data import DataSettings, parse_split
from shared.config.http_server import HttpServerSettings
from shared.config.objective import Objective
from shared.config.sampling import SamplingSettings
from shared.config.stream_consumer import StreamConsumerSettings
from shared.config.weight_push import WeightPushSettings

log = logging.getLogger(__name__)


# Where the learner reports besides metrics.jsonl (TRL's report_to values), and the packages two of them need.
ReportTo = Literal["tensorboard", "wandb", "trackio"]
DEFAULT_REPORT_TO: tuple[ReportTo, ...] = ("tensorboard",)
TRACKER_PACKAGES: dict[str, str] = {"wandb": "wandb", "trackio": "trackio"}


def missing_trackers(report_to: list[ReportTo]) -> list[str]:
    """A problem for each tracker in ``report_to`` whose package this environment lacks, naming the install
    command: asked for, it is never skipped in silence. (TensorBoard comes with the learner's torch.)"""
    return [
        f"learner.report_to includes {name!r} but {package} is not installed in the learner's environment: "
        f"pip install {package} (or remove {name!r} from report_to)"
        for name, package in TRACKER_PACKAGES.items()
        if name in report_to and importlib.util.find_spec(package) is None
    ]


_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@functools.cache
def default_run_name() -> str:
    """A new run's name: when this process first asked, and a few random characters so that two runs started
    together differ. One per process, so loading the file twice gives the same settings; a restarted
    process is a new run unless the name is set."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


class ModelSettings(BaseModel):
    """The policy's weights: where they come from, their dtype and the device they train on."""

    model: str = Field("", description="Path of the initial model (transformers checkpoint directory).")
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Master weights and AdamW state. float32 keeps every update; bfloat16 halves their memory but "
        "rounds away steps below half a bf16 unit (most of them at lr 1e-6) and computes in bfloat16.",
    )
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Forward and backward dtype (autocast on one device, FSDP2 mixed precision under torchrun; "
        "gradients stay float32); auto: bfloat16 where the device computes in it (CUDA; CPUs with AMX or "
        "AVX512-BF16), else float32 (emulated bf16 is ~16x slower).",
    )
    dtype: Literal["auto", "float32", "bfloat16"] | None = Field(
        None, description="Deprecated: read as compute_dtype over param_dtype master weights (a warning says so)."
    )
    device: str = Field("cpu", description="Torch device: cpu or cuda.")
    threads: int = Field(0, ge=0, description="Torch CPU threads (0: torch's default).")
    keep_freed_memory: bool = Field(
        True, description="cpu: glibc malloc keeps what a step frees for the next (host_memory.py); false: defaults."
    )

    @model_validator(mode="after")
    def _translate_dtype(self) -> ModelSettings:
        """The old ``dtype`` (weights and compute in one dtype) becomes ``compute_dtype`` over float32 weights."""
        if self.dtype is None:
            return self
        if "compute_dtype" in self.model_fields_set and self.compute_dtype != self.dtype:
            raise ValueError(
                f"learner.dtype ({self.dtype!r}) is deprecated and contradicts compute_dtype "
                f"({self.compute_dtype!r}); remove dtype"
            )
        log.warning(
            "learner.dtype is deprecated: dtype = %r is read as compute_dtype = %r with %s master weights "
            "(param_dtype); rename it to compute_dtype",
            self.dtype,
            self.dtype,
            self.param_dtype,
        )
        self.compute_dtype = self.dtype
        self.dtype = None
        return self

    @model_validator(mode="after")
    def _precision(self) -> ModelSettings:
        if self.param_dtype == "bfloat16" and self.compute_dtype == "float32":
            raise ValueError(
                "param_dtype = 'bfloat16' computes in bfloat16; set compute_dtype = 'bfloat16' (or 'auto'), "
                "or keep float32 master weights with param_dtype = 'float32'"
            )
        if not self.model:
            raise ValueError("learner.model is required: set LEARNER_MODEL to a checkpoint directory")
        return self


class BatchSettings(BaseModel):
    """Batch arithmetic (the module's docstring draws it): groups per step, micro-batches, steps, staleness."""

    group_size: int = Field(8, description="G: completions per prompt (at least 2).")
    groups_per_step: int = Field(4, ge=1, description="Prompts (groups) per optimizer step.")
    micro_batch_size: int = Field(8, ge=1, description="Completions per forward/backward pass.")
    max_tokens_per_micro_batch: int | Literal["auto"] = Field(
        "auto",
        description="Token budget of a micro-batch: its completions are packed without padding into one row of at "
        "most this many prompt + completion tokens (a group's prompt counted once with shared prompts), "
        "micro_batch_size completions at most; a longer sequence goes alone. 0: padded micro-batches of "
        "micro_batch_size rows. auto: micro_batch_size x (max_prompt_length + max_completion_length), the padded "
        "worst case, on the CPU and on CUDA with flash-attn, where packing is the faster; 0 on CUDA without "
        "flash-attn, where SDPA's packing mask is dense and padding is the faster (bench/learner.py compares them).",
    )
    share_prompts: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Compute each group's prompt once for its G completions. auto: on for the CPU (about half "
        "the compute there), off for CUDA, where it is the slower (bench/learner.py --share-prompts compares "
        "them). Never under torchrun.",
    )
    no_grad_micro_batch_size: int = Field(
        0,
        ge=0,
        description="Completions per no-grad pass (old logprobs, reference model): it keeps no activations for a "
        "backward, so it can take more than micro_batch_size (0: micro_batch_size).",
    )
    logprob_chunk_tokens: int = Field(
        1024,
        ge=0,
        description="Completion tokens whose logits exist at once: the LM head, log-softmax and entropy run on "
        "chunks of this many tokens (recomputed in the backward), so the [tokens x vocab] float32 logits never "
        "exist (0: whole logits, as before; needed for models that change logits after their LM head, e.g. "
        "Gemma's softcapping).",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Activation checkpointing per decoder layer (TRL's name): a training pass keeps each layer's "
        "input and recomputes the layer's activations in the backward, for less memory at the cost of about one "
        "more forward per step; same values and gradients (padded, packed and shared-prompt passes, LoRA, FSDP2).",
    )
    warm_up: bool = Field(
        True,
        description="Make AdamW's state (its two moments, 8 bytes per trained parameter) while the first rollouts "
        "are sampled, not in the first step, which is then as long as the others. "
        "Changes no number. One process only (not under torchrun).",
    )
    num_iterations: int = Field(1, ge=1, description="Optimizer steps per batch (TRL's num_iterations, mu).")
    sync_every: int = Field(1, ge=1, description="Optimizer steps between weight pushes to the generators.")
    max_staleness: int = Field(1, ge=0, description="Oldest trainable group, in policy versions behind.")
    max_steps: int = Field(100, ge=1, description="Optimizer steps to run.")

    @field_validator("group_size")
    @classmethod
    def _group_of_two(cls, value: int) -> int:
        if value < 2:
            raise ValueError(
                f"group_size (G) is {value}; it must be at least 2: GRPO's advantage compares the completions "
                "of one prompt with each other"
            )
        return value

    @property
    def completions_per_step(self) -> int:
        return self.groups_per_step * self.group_size

    @property
    def admission_bound(self) -> int:
        return (self.max_staleness + 1) * self.groups_per_step

    @model_validator(mode="after")
    def _micro_batches_fit(self) -> BatchSettings:
        if self.micro_batch_size > self.completions_per_step:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) exceeds the completions per step "
                f"({self.groups_per_step} groups x G={self.group_size} = {self.completions_per_step}); lower it"
            )
        if self.completions_per_step % self.micro_batch_size:
            fitting = _divisor_below(self.completions_per_step, self.micro_batch_size)
            raise ValueError(
                f"completions per step ({self.completions_per_step}) must be a multiple of micro_batch_size "
                f"({self.micro_batch_size}); e.g. micro_batch_size = {fitting}"
            )
        return self


class EvaluationSettings(BaseModel):
    """Evaluation on held-out prompts (README, "Evaluation")."""

    eval_data: str | list[str] | None = Field(
        None,
        description="Held-out prompts, read like data.source with the [data] table's prompt rules; 'held_out': "
        "new problems of the built-in training task, none of them a training row; None: none here (data.eval_split "
        "or data.eval_fraction may hold rows of data.source out instead; with neither, no evaluation).",
    )
    eval_split: str | None = Field(
        None,
        description="Split of eval_data to read, a name or a datasets-style slice ('test[:500]') (None: the split "
        "names of data.train_split, without their slices).",
    )
    eval_samples: int = Field(100, ge=1, description="Prompts per evaluation: the first eval_samples of eval_data.")
    eval_every: int = Field(
        0, ge=0, description="Steps between evaluations (0: only at the start and after the last step)."
    )
    eval_on_start: bool = Field(True, description="Evaluate the initial weights before the first step.")
    eval_temperature: float = Field(0.0, ge=0, description="Sampling temperature of evaluation (0: greedy).")
    eval_group_size: int = Field(1, ge=1, description="Completions per held-out prompt.")
    eval_timeout_s: float = Field(
        1800.0, gt=0, description="Longest wait for one evaluation's completions; then it is given up (logged)."
    )


class UpdateSettings(BaseModel):
    """How a step updates the policy: the groups it may wait for, its old logprobs, the optimizer, LoRA."""

    max_replacement_groups: int | None = Field(
        None,
        ge=0,
        description="Dynamic sampling cap: zero-std groups one step may skip and wait to replace; past it the step "
        "trains on what it has (dynamic_sampling/capped). None: no cap.",
    )
    old_logprobs: Literal["recompute", "reuse", "behaviour"] = Field(
        "recompute",
        description="recompute: a no-grad pass before the update; reuse: with num_iterations = 1 the training "
        "forward's detached logprobs are the same numbers (TRL does this), saving a forward pass; behaviour: the "
        "generator's, so the ratio is clipped around the policy that sampled (no importance weights, no pass).",
    )

    # Optimizer.
    lr: float = Field(1e-6, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.99, ge=0, lt=1, description="AdamW beta2.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps, then cosine decay to min_lr_ratio.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a share of lr.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    seed: int = Field(0, description="Torch seed.")

    # LoRA.
    lora_rank: int = Field(0, ge=0, description="LoRA rank (0: full fine-tuning).")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA alpha.")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Modules LoRA adapts.",
    )


class RunSettings(BaseModel):
    """The run directory, checkpoints and observability."""

    run_name: str = Field(
        default_factory=default_run_name,
        description="This run's name: its checkpoints, metrics and logs go to <runs_dir>/<run_name>/. Only a run "
        "of the same name continues from them (asyncgrpo run --run-name NAME).",
        json_schema_extra={DEFAULT_TEXT: "timestamped (YYYYmmdd-HHMMSS-xxxx)"},
    )
    runs_dir: str = Field("runs", description="Where run directories are made.")
    resume_from: str = Field(
        "",
        description="A checkpoint (.../step-N), or a directory of them, this run starts from while it has none "
        "of its own; its model and settings must match this run's.",
    )
    checkpoint_dir: str = Field(
        "", description="Where checkpoints go (shared with generators); empty: <runs_dir>/<run_name>/checkpoints."
    )
    checkpoint_every: int = Field(10, ge=1, description="Steps between checkpoints (groups are acked then).")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk.")
    resume: bool = Field(
        True,
        description="Continue from this run's newest checkpoint (one of another run, model or settings is "
        "refused with the reason); false: refuse to start when the run already has checkpoints.",
    )
    log_dir: str = Field(
        "",
        description="metrics.jsonl, batches.jsonl, dropped.jsonl, completions.jsonl and TensorBoard events; empty: "
        "the run directory.",
    )
    progress: Literal["auto", "on", "off"] = Field("auto", description="Rich progress bar (auto: in a terminal).")
    log_completions: int = Field(
        0,
        ge=0,
        description="Steps between tables of sampled completions with each reward and the advantage "
        "(completions.jsonl and every report_to; TRL's log_completions); 0: none.",
    )
    num_completions_to_log: int = Field(
        16,
        ge=1,
        description="Completions per table: the batch's first, group by group (TRL's num_completions_to_print).",
    )
    report_to: list[ReportTo] = Field(
        default_factory=lambda: list(DEFAULT_REPORT_TO),
        description="Where metrics and completion tables go besides metrics.jsonl (TRL's report_to; [] for none); "
        "wandb and trackio must be installed in the learner's environment.",
    )
    tracking_project: str = Field(
        "", description="W&B and trackio project (the run is run_name); empty: WANDB_PROJECT, else 'asyncgrpo'."
    )
    wandb_entity: str = Field("", description="W&B entity (user or team); empty: WANDB_ENTITY, else your default.")

    @field_validator("report_to")
    @classmethod
    def _report_once(cls, value: list[ReportTo]) -> list[ReportTo]:
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"report_to names {', '.join(repeated)} more than once; name each tracker once")
        return value

    @field_validator("run_name")
    @classmethod
    def _directory_name(cls, value: str) -> str:
        if not _RUN_NAME.fullmatch(value):
            raise ValueError(
                f"run_name {value!r} must be a directory name: letters, digits, '.', '_' and '-', "
                "starting with a letter or digit"
            )
        return value

    @model_validator(mode="after")
    def _run_directory(self) -> RunSettings:
        """Checkpoints and metrics default to the run directory; explicit directories are kept as given."""
        if not self.checkpoint_dir:
            self.checkpoint_dir = str(self.run_dir / "checkpoints")
        if not self.log_dir:
            self.log_dir = str(self.run_dir)
        return self

    @property
    def run_dir(self) -> Path:
        """``<runs_dir>/<run_name>``: this run's checkpoints, metrics and (under ``asyncgrpo run``) its logs."""
        return Path(self.runs_dir) / self.run_name


# The bases in the reverse of the README's order: pydantic lists the fields of the last base first.
class LearnerSettings(
    WeightPushSettings,
    RunSettings,
    UpdateSettings,
    EvaluationSettings,
    SamplingSettings,
    BatchSettings,
    ModelSettings,
    EntryBoundsSettings,
    HttpServerSettings,
    StreamConsumerSettings,
    ServiceSettings,
    Objective,
):
    """The learner's settings: the groups above and the objective's (loss, KL, masks, entropy, importance
    correction, :class:`~shared.config.objective.Objective`), inherited, flat in ``[learner]``; its own fields
    are the service's HTTP server and stream delivery, and its checks those that read several groups."""

    model_config = SettingsConfigDict(env_prefix="LEARNER_", extra="forbid", env_nested_delimiter="__")
    toml_table = "learner"
    extra_toml_tables: ClassVar[dict[str, str]] = {"data": "data"}

    data: DataSettings = Field(default_factory=DataSettings)
    OVERRIDES: ClassVar[dict[str, str]] = {
        "port": "each service its own port, so all of them run on one host",
        "claim_idle_ms": "the learner's groups stay pending until the checkpoint after their step, and a restarted "
        "learner re-reads them under its own name, so a claim gains nothing and hands a stalled learner's "
        "groups out again",
        "max_deliveries": "every restart between checkpoints re-reads each group trained since the last one (a "
        "delivery), and a dead-lettered group loses G completions sampled and scored",
    }
    port: int = Field(8003, ge=0, le=65535, description="HTTP port (/health, /ready, /metrics).")
    claim_idle_ms: int = Field(
        600_000, ge=100, description="Scored groups pending this long without a keepalive are claimed."
    )
    max_deliveries: int = Field(5, ge=1, description="Deliveries of a scored group before it is dead-lettered.")
    gpu_memory_share: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Share of its GPU's memory the learner's tensors may take (one-GPU mode: the rest is "
        "vLLM's; torch.cuda.set_per_process_memory_fraction).",
    )

    def start_problems(self) -> list[str]:
        """Checks of the learner's own environment (run when it starts): the trackers it reports to."""
        return super().start_problems() + missing_trackers(self.report_to)

    def context_problem(self, context: int) -> str | None:
        """Why a prompt and its completion do not fit a model of ``context`` tokens (0: unknown), or None.
        Checked here against ``model_context`` and by the learner against the loaded model's own context."""
        if context and self.max_prompt_length + self.max_completion_length > context:
            return (
                f"max_prompt_length ({self.max_prompt_length}) + max_completion_length "
                f"({self.max_completion_length}) exceeds the model's context ({context}); lower either"
            )
        return None

    @model_validator(mode="after")
    def _check(self) -> LearnerSettings:
        context_problem = self.context_problem(self.model_context)
        if context_problem:
            raise ValueError(context_problem)
        if self.old_logprobs == "reuse" and self.num_iterations > 1:
            raise ValueError("old_logprobs = 'reuse' needs num_iterations = 1 (later iterations need the old policy)")
        if self.old_logprobs == "behaviour" and (problem := self.behaviour_logprobs_problem()):
            raise ValueError(problem)
        if self.min_completion_length > self.max_completion_length:
            raise ValueError(
                f"min_completion_length ({self.min_completion_length}) exceeds max_completion_length "
                f"({self.max_completion_length}); lower it"
            )
        if self.mask_truncated_completions and self.min_completion_length >= self.max_completion_length:
            raise ValueError("mask_truncated_completions with min_completion_length = max_completion_length masks "
                             "every completion (each one runs to the limit): drop one of them")  # fmt: skip
        _check_eval(self)
        return self


def _check_eval(s: LearnerSettings) -> None:
    """One source of evaluation rows: ``eval_data`` (a file of its own, or ``"held_out"`` problems of the built-in
    training task) or ``data.eval_split`` / ``data.eval_fraction`` (rows of ``data.source``); ``eval_split``
    only beside a file of ``eval_data``."""
    source, data = s.data.source, s.data
    if s.eval_data == "held_out" and not (isinstance(source, str) and source.startswith("builtin:")):
        raise ValueError(
            f"eval_data = 'held_out' draws new problems of a built-in task, and data.source is {source!r}: set "
            "eval_data to a file or dataset of held-out rows (read with the [data] table's prompt rules)"
        )
    in_data = [f"data.{name}" for name in ("eval_split", "eval_fraction") if getattr(data, name) is not None]
    if s.eval_data is not None and in_data:
        raise ValueError(
            f"two sources of evaluation rows: learner.eval_data ({s.eval_data!r}) and {in_data[0]}; keep "
            "eval_data for rows of their own, or the data table's for rows held out of data.source"
        )
    if s.eval_split is not None and s.eval_data in (None, "held_out"):
        raise ValueError(
            f"learner.eval_split ({s.eval_split!r}) picks the split of learner.eval_data, which is "
            f"{s.eval_data!r}; for a split of data.source set data.eval_split instead"
        )
    try:
        parse_split(s.eval_split or "train")
    except ValueError as exc:
        raise ValueError(f"learner.eval_split: {exc}") from None


def _divisor_below(n: int, limit: int) -> int:
    return max(d for d in range(1, limit + 1) if n % d == 0)
