"""Generator settings: ``[generator]`` in the TOML file, ``GENERATOR_*`` in the environment."""

from __future__ import annotations

import socket
from typing import ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from shared.config.base import DEFAULT_TEXT, HOSTNAME_BASED, ServiceSettings
from shared.config.bounds import EntryBoundsSettings
from shared.config.environment import EnvironmentSettings
from shared.config.http_server import HttpServerSettings
from shared.config.stream_consumer import StreamConsumerSettings
from shared.gpu_placement import leasable_gpus, parse_gpu_list


class GeneratorSettings(EntryBoundsSettings, HttpServerSettings, StreamConsumerSettings, ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="GENERATOR_", extra="forbid", env_nested_delimiter="__")
    toml_table = "generator"
    extra_toml_tables: ClassVar[dict[str, str]] = {"environment": "environment"}
    requires_api_token = True  # its control endpoints (weights, pause) take the bearer token

    environment: EnvironmentSettings | None = Field(
        None,
        description="The [environment] table: with one, each sample is a multi-turn trajectory with tools "
        "(docs/guides/multi-turn.md); without, one completion.",
        json_schema_extra={DEFAULT_TEXT: "none: its own table"},
    )

    model: str = Field("", description="Path of the initial model (a transformers/vLLM checkpoint directory).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Engine dtype. 'auto': on CPU the one it computes in (bfloat16 with AMX or AVX512-BF16, else "
        "float32, as the learner's compute_dtype 'auto'); on GPU the checkpoint's.",
    )
    max_model_len: int = Field(2048, ge=16, description="Longest prompt + completion the engine accepts.")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV cache size in GiB on CPU (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="Share of GPU memory vLLM may take.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per replica (vLLM tensor parallelism).")
    enforce_eager: bool = Field(True, description="Skip torch.compile/CUDA graphs (faster start, slower decode).")
    max_num_seqs: int = Field(64, ge=1, description="Sequences the engine batches at once.")
    block_size: int | None = Field(
        None,
        ge=1,
        description="Tokens per KV-cache block (vLLM's block_size; None: 32 on CPUs, vLLM's default on GPUs, 16 on "
        "most). On CPUs vLLM's own default, 128, sampled half as fast: 2 AVX-512 BF16 cores, bench/generator.py "
        "--repeats 2 (the demo's prompts, G 8, 64 tokens), 32 gave 581 sampled tokens/s and 128 gave 270 "
        "(docs/benchmarks.md). A multi-turn trajectory's next turn also recomputes the tokens after its last full "
        "block, so smaller blocks recompute less per turn (the CPU backend wants a multiple of 32).",
    )
    in_flight_at_push: Literal["recompute", "keep"] = Field(
        "recompute",
        description="What a weight push does to the requests sampling when it lands. recompute: preempt them and "
        "recompute their KV cache under the new weights (vLLM's reset_prefix_cache(reset_running_requests=True)); "
        "keep: keep the KV computed so far, the rest of each is sampled by the new weights reading it (prime-rl and "
        "PipelineRL do so), which spares the recompute where pushes land mid-batch (bench/push_mid_batch.py measures "
        "it; docs/concepts/algorithm.md). Either way a request's tokens "
        "are stamped with the version at its submission (at most the oldest that sampled any), its behaviour "
        "logprobs are those it was sampled with, and it reads no KV computed under weights older than its stamp: "
        "each load salts the prefix cache anew (vLLM's cache_salt), so a request submitted after a push meets no "
        "block of one submitted before.",
    )
    max_prompts_in_flight: int = Field(
        16, ge=1, description="Prompts read from the stream and sampling at once (each is G sequences)."
    )
    generator_id: str = Field(
        default_factory=lambda: f"gen-{socket.gethostname()}",
        description="This replica's name (unique).",
        json_schema_extra=HOSTNAME_BASED,
    )
    OVERRIDES: ClassVar[dict[str, str]] = {
        "port": "each service its own port, so all of them run on one host",
        "max_request_bytes": "POST /generate and the weight announcement carry bodies of megabytes",
        "claim_idle_ms": "a prompt taken from a replica that is alive but stalled is sampled twice (G completions, "
        "multi-turn ones with their tool calls), where a rollout scored twice costs a reward call",
    }
    port: int = Field(8001, ge=0, le=65535, description="HTTP port (0 picks a free one).")
    max_request_bytes: int = Field(
        16 << 20,
        ge=1024,
        description="Largest HTTP request body taken (413 past it, counted as it arrives). The largest "
        "legitimate ones: POST /generate, 256 prompts at ~8 bytes of JSON per prompt token (256 prompts of 8k "
        "tokens: 16 MiB), and the learner's weight announcement, ~140 bytes per parameter tensor (a 94-layer, "
        "128-expert MoE: 36k tensors, 5 MB). Raise it for longer prompts.",
    )
    claim_idle_ms: int = Field(
        60_000, ge=100, description="Prompts pending this long without a keepalive (a dead replica's) move."
    )
    public_url: str = Field(
        "", description="URL the learner reaches this replica at; default http://<this host's IP>:<port>."
    )
    heartbeat_ttl_s: float = Field(
        15.0,
        gt=0,
        description=(
            "A replica silent this long is considered gone; also the TTL of its GPU lease (renewed every third of it)."
        ),
    )
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
    gpu_count: int | Literal["auto"] = Field(
        0,
        description="GPUs on this host to lease one from: a number, 'auto' (counted with NVML), or 0: no lease "
        "(CPU, or GPUs the orchestrator already gave this replica, as Kubernetes does); see 'GPU box'.",
    )
    learner_gpus: str = Field(
        "",
        description="GPU indices the learner uses on this host, e.g. '0' or '0,1' (compose passes LEARNER_GPUS); "
        "generators never lease them unless colocated.",
    )
    colocated: bool = Field(
        False,
        description="One-GPU mode: lease the learner's GPU and share it; gpu_memory_utilization + "
        "learner.gpu_memory_share must be <= 1 (checked with the whole file).",
    )
    gpu_host_key: str = Field(
        default_factory=lambda: socket.gethostname(),
        description="GPU lease namespace: every replica that sees the same GPUs must use the same one (compose "
        "passes GPU_HOST_KEY, Kubernetes the node name); default: this host's name.",
        json_schema_extra=HOSTNAME_BASED,
    )
    omp_cpus: str = Field(
        "",
        description="CPU cores for the CPU engine's threads, e.g. '0' or '0-3' (VLLM_CPU_OMP_THREADS_BIND).",
    )
    weight_shm_dir: str = Field(
        "/dev/shm",
        description="CPU engine: shared-memory directory for weight pushes; a CPU learner that sees it (same "
        "host and user) sends weights through it instead of gloo. Empty: gloo only.",
    )
    keep_freed_memory: bool = Field(
        True,
        description="CPU engine: vLLM's engine processes keep the memory a step frees for the next (glibc malloc "
        "through GLIBC_TUNABLES: no mmap for large blocks, no trim below 2 GiB; the worker's page faults while "
        "sampling fell from 15,000-20,000 to under 50 a second, bench/generator.py, 2-core AVX2 EPYC). false: "
        "glibc's defaults.",
    )
    cpu_weights_in_place: bool = Field(
        False,
        description="CPU engine, pushes over gloo (not shared memory): parameters become views of the "
        "weight-push buffers, so a push needs no loading (bench/weight_push.py), but linear layers compute with "
        "torch's linear instead of vLLM's prepacked oneDNN kernels, 12-44% slower per layer at 8-24 rows on an "
        "AVX2 CPU. For push-bound runs.",
    )

    @model_validator(mode="after")
    def _check(self) -> GeneratorSettings:
        if not self.model:
            raise ValueError("generator.model is required: set GENERATOR_MODEL to a checkpoint directory")
        if self.tensor_parallel_size > 1 and self.gpu_count == 0:
            raise ValueError("tensor_parallel_size > 1 needs GPUs: set generator.gpu_count")
        self._check_placement()
        return self

    def _check_placement(self) -> None:
        """The GPU layout, checked before anything starts (the count itself may only be known at start)."""
        learner = parse_gpu_list(self.learner_gpus)
        if self.gpu_count == 0:
            if self.colocated:
                raise ValueError("colocated mode leases the learner's GPU: set generator.gpu_count (e.g. 'auto')")
            return
        if isinstance(self.gpu_count, int):
            if self.gpu_count < 0:
                raise ValueError(f"gpu_count is {self.gpu_count}: a number of GPUs, 'auto' or 0")
            candidates = leasable_gpus(self.gpu_count, learner, self.colocated)
            if len(candidates) < self.tensor_parallel_size:
                raise ValueError(
                    f"tensor_parallel_size {self.tensor_parallel_size} needs that many GPUs, but only "
                    f"{list(candidates)} may be leased; lower it or give the learner fewer (learner_gpus)"
                )
        elif self.colocated and not learner:
            raise ValueError("colocated mode shares the learner's GPU: set generator.learner_gpus (LEARNER_GPUS)")

    @property
    def learner_gpu_indices(self) -> tuple[int, ...]:
        return parse_gpu_list(self.learner_gpus)

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
