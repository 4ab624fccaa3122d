"""Launcher settings: ``[launcher]`` in the TOML file, read only by ``asyncgrpo run`` on one machine."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class LauncherSettings(BaseModel):
    """``[launcher]``: how many processes of each kind to start here."""

    model_config = ConfigDict(extra="forbid")

    generators: int = Field(1, ge=1, description="Generator replicas to start.")
    generator_cpus: list[str] = Field(
        default_factory=list, description="CPU cores per generator replica on CPU (e.g. ['0', '1'])."
    )
    learner_cpus: str = Field("", description="CPU cores the learner is pinned to with taskset (e.g. '1').")
    scorers: int = Field(1, ge=1, description="Scorer replicas to start.")
    example_plugin: bool = Field(False, description="Also start the example HTTP reward plugin on port 9000.")
    log_dir: str = Field("runs/logs", description="Where the services' logs go.")
    first_generator_port: int = Field(8101, ge=1, description="Generator i listens on this port + i.")
    stop_timeout_s: float = Field(60.0, gt=0, description="Grace period before SIGKILL at shutdown.")
