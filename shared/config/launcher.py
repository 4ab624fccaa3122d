"""Launcher settings: ``[launcher]`` in the TOML file, read only by ``asyncgrpo run`` on one machine."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# ``model = "@smollm2"`` (generator and learner): SmolLM2-135M-Instruct, which ``asyncgrpo run`` prepares once
# (``asyncgrpo prepare-model``) and passes to the services as a path. Other services need a real path.
MODEL_PLACEHOLDERS = ("@smollm2",)


class LauncherSettings(BaseModel):
    """``[launcher]``: how many processes of each kind to start here."""

    model_config = ConfigDict(extra="forbid")

    generators: int = Field(1, ge=1, description="Generator replicas to start.")
    generator_cpus: list[str] = Field(
        default_factory=list,
        description="CPU cores per generator replica on CPU (e.g. ['0', '1']): its processes are pinned to them "
        "with taskset and its engine's threads bound to them (VLLM_CPU_OMP_THREADS_BIND).",
    )
    learner_cpus: str = Field("", description="CPU cores the learner is pinned to with taskset (e.g. '1').")
    scorers: int = Field(1, ge=1, description="Scorer replicas to start.")
    scorer_cpus: str = Field(
        "", description="CPU cores the scorers are pinned to with taskset (e.g. '0': off the learner's cores)."
    )
    example_plugin: bool = Field(False, description="Also start the example HTTP reward plugin on port 9000.")
    log_dir: str = Field("", description="Where the services' logs go; empty: logs/ in the run directory.")
    first_generator_port: int = Field(
        0,
        ge=0,
        description="0: every service gets a free port (printed at start; a learner port set in [learner] is "
        "kept). N: generator i listens on N + i, scorer i on N + 90 + i, the learner on its own ports.",
    )
    stop_timeout_s: float = Field(60.0, gt=0, description="Grace period before SIGKILL at shutdown.")
    redis_allow_no_auth: bool = Field(
        False,
        description="Use a Redis named by REDIS_URL that takes commands without a password (a warning at every "
        "start); false: refused. Without REDIS_URL, asyncgrpo run starts its own, with a password.",
    )


def model_placeholder_problem(table: str, model: str) -> str | None:
    """Why ``asyncgrpo run`` cannot start from ``[table] model`` (an unknown ``@`` placeholder), or None."""
    if not model.startswith("@") or model in MODEL_PLACEHOLDERS:
        return None
    return (
        f"{table}.model = {model!r} is not a model asyncgrpo run can prepare (it knows "
        f"{', '.join(MODEL_PLACEHOLDERS)}): set it to a model directory"
    )
