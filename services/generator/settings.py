"""Generator settings: ``[generator]`` in the TOML file, ``GENERATOR_*`` in the environment."""

from __future__ import annotations

import socket
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from shared.settings import ServiceSettings


class GeneratorSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="GENERATOR_", extra="forbid", env_nested_delimiter="__")
    toml_table = "generator"

    model: str = Field("", description="Path of the initial model (a transformers/vLLM checkpoint directory).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Engine dtype; 'auto' takes the checkpoint's (float32 is exact on CPU)."
    )
    max_model_len: int = Field(2048, ge=16, description="Longest prompt + completion the engine accepts.")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV cache size in GiB on CPU (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="Share of GPU memory vLLM may take.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per replica (vLLM tensor parallelism).")
    enforce_eager: bool = Field(True, description="Skip torch.compile/CUDA graphs (faster start, slower decode).")
    max_num_seqs: int = Field(64, ge=1, description="Sequences the engine batches at once.")
    max_prompts_in_flight: int = Field(
        16, ge=1, description="Prompts read from the stream and sampling at once (each is G sequences)."
    )
    generator_id: str = Field(
        default_factory=lambda: f"gen-{socket.gethostname()}", description="This replica's name (unique)."
    )
    host: str = Field("0.0.0.0", description="Address the HTTP server binds.")
    port: int = Field(8001, ge=0, le=65535, description="HTTP port (0 picks a free one).")
    public_url: str = Field(
        "", description="URL the learner reaches this replica at; default http://<this host's IP>:<port>."
    )
    heartbeat_ttl_s: float = Field(15.0, gt=0, description="A replica silent this long is considered gone.")
    claim_idle_ms: int = Field(60_000, ge=100, description="Prompts pending this long on a dead replica move.")
    max_deliveries: int = Field(3, ge=1, description="Deliveries of a prompt before it is dead-lettered.")
    max_rollout_backlog: int = Field(
        256, ge=1, description="Rollouts waiting for scorers before this replica stops generating."
    )
    weight_timeout_s: float = Field(300.0, gt=0, description="Longest a weight push may take.")
    weight_join_timeout_s: float = Field(
        30.0, gt=0, description="Longest to wait for every member of a push's group (a dead peer aborts it)."
    )
    generate_token_budget: int = Field(
        65536, ge=1, description="POST /generate: most prompts x n x max_tokens one request may ask for."
    )
    gpu_count: int = Field(
        0, ge=0, description="GPUs on this host to lease one from (0: CPU, no lease; see 'GPU leases')."
    )
    gpu_host_key: str = Field(
        default_factory=socket.gethostname, description="Name of the host whose GPUs the lease counts."
    )
    omp_cpus: str = Field(
        "",
        description="CPU cores for the CPU engine's threads, e.g. '0' or '0-3' (VLLM_CPU_OMP_THREADS_BIND).",
    )

    @model_validator(mode="after")
    def _check(self) -> GeneratorSettings:
        if not self.model:
            raise ValueError("generator.model is required: set GENERATOR_MODEL to a checkpoint directory")
        if not self.api_token.get_secret_value():
            raise ValueError("api_token is required: set API_TOKEN (control endpoints need a bearer token)")
        if self.tensor_parallel_size > 1 and self.gpu_count == 0:
            raise ValueError("tensor_parallel_size > 1 needs GPUs: set generator.gpu_count")
        return self

    def url(self, bound_port: int) -> str:
        """Where the learner reaches this replica: ``public_url``, else this host's IP (a container's or a
        pod's own address, which other containers resolve without DNS) and the bound port."""
        if self.public_url:
            return self.public_url
        try:
            address = socket.gethostbyname(socket.gethostname())
        except OSError:
            address = "127.0.0.1"
        return f"http://{address}:{bound_port}"
