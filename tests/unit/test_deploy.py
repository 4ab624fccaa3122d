"""What can be checked of the deployment here (no Docker engine, no cluster, no GPU): the compose files
resolve (``docker-compose config``) to a safe, complete configuration whose GPU placement is right, they
read the same settings as the launcher, and Dockerfiles and manifests pass their linters and schemas."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from services.reward_plugin.cli import is_loopback as cli_loopback
from services.reward_plugin.cli import parse_args as parse_plugin_args
from shared.allowed_hosts import HostAllowList
from shared.config.generator import GeneratorSettings
from shared.config.learner import LearnerSettings
from shared.config.pipeline import PipelineConfig, PipelineError, load_service
from shared.config.scorer import ScorerSettings
from shared.gpu_placement import leasable_gpus, memory_share_error, parse_gpu_list
from shared.redis_acl import ROLES, deploy_script, secret_name
from tests.support import compose
from tests.support.processes import ROOT

BIN = Path(sys.executable).parent
DEFAULT = ["docker-compose.yml"]
ONE_GPU = ["docker-compose.yml", "deploy/one-gpu.yml"]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
needs_compose = pytest.mark.skipif(compose.compose_command() is None, reason=compose.SKIP_REASON)


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(args), cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )


@needs_compose
@pytest.mark.parametrize("files", [DEFAULT, ONE_GPU], ids=["default", "one-gpu"])
def test_compose_is_safe_and_complete(files):
    services = compose.resolved(files)["services"]
    assert set(services) == {"redis", "generator", "scorer", "learner", "reward-plugin"}
    assert services["learner"]["depends_on"]["redis"]["condition"] == "service_healthy"
    for name, service in services.items():
        assert "ports" not in service, f"{name} publishes a port nobody asked for"
        assert service.get("restart") in {"unless-stopped", "on-failure"}, name
    redis = services["redis"]
    assert "requirepass" in " ".join(redis["command"]) and "REDISCLI_AUTH" in " ".join(redis["healthcheck"]["test"])
    for name in ("generator", "scorer", "learner"):  # each its own Redis user, never the administrator
        url = f"redis://{name}:{compose.REQUIRED_ENV[secret_name(name)]}@redis:6379/0"
        assert compose.environment(services[name])["REDIS_URL"] == url, name
        assert "REDIS_PASSWORD" not in compose.environment(services[name]), name
    for name in ("generator", "scorer", "learner", "reward-plugin"):
        assert services[name]["cap_drop"] == ["ALL"] and "no-new-privileges:true" in services[name]["security_opt"]
    assert "checkpoints:/checkpoints:ro" in services["generator"]["volumes"]  # only the learner writes them
    assert "checkpoints:/checkpoints:rw" in services["learner"]["volumes"]
    for name in ("generator", "learner"):
        service = services[name]
        assert service["ipc"] == "host", name  # vLLM's shared memory; CUDA IPC between the two containers
        assert service["build"]["dockerfile"] == "deploy/gpu.Dockerfile"
        assert service["image"] == f"asyncgrpo-gpu:{VERSION}"
        assert any(str(v).startswith("model-cache:/cache") for v in service["volumes"]), name
        env = compose.environment(service)
        assert env["HF_HOME"].startswith("/cache/") and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    for name in ("scorer", "reward-plugin"):
        assert services[name]["build"]["dockerfile"] == "deploy/scorer.Dockerfile"
        assert services[name]["image"] == f"asyncgrpo-scorer:{VERSION}"


def test_compose_runs_shared_redis_acls_script_with_the_passwords_from_its_environment():
    """The redis container's script is exactly shared.redis_acl's; compose passes every password to it in the
    environment, never on a command line (tests/integration/test_redis_acl.py runs the script)."""
    redis = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["redis"]
    assert redis["command"] == ["sh", "-c", deploy_script("compose")]
    assert set(redis["environment"]) == {"REDIS_PASSWORD", *(secret_name(role) for role in ROLES)}
    assert all(value.startswith("${") for value in redis["environment"].values())
    assert "${REDIS" not in deploy_script("compose").replace("$${REDIS", "")  # compose never fills one in


@needs_compose
def test_compose_leaves_the_redis_passwords_to_the_containers_shell():
    """Resolved by compose with .env's passwords: the prefix is filled in, no password is (the shell does it)."""
    for prefix in ("grpo", "run-7"):
        redis = compose.resolved(DEFAULT, {"STREAM_PREFIX": prefix})["services"]["redis"]
        script = redis["command"][2]
        assert f"(~{prefix}:prompts " in script and "${REDIS_GENERATOR_PASSWORD}" in script
        secrets = [compose.REQUIRED_ENV[name] for name in ("REDIS_PASSWORD", *(secret_name(r) for r in ROLES))]
        assert not [secret for secret in secrets if secret in " ".join(redis["command"])]
        assert {name: redis["environment"][name] for name in (secret_name(r) for r in ROLES)} == {
            secret_name(r): compose.REQUIRED_ENV[secret_name(r)] for r in ROLES
        }


@needs_compose
def test_compose_learner_contacts_only_generators_on_the_compose_network(monkeypatch):
    resolved = compose.resolved(DEFAULT, {"COMPOSE_SUBNET": "10.77.0.0/16"})
    assert resolved["networks"]["default"]["ipam"]["config"] == [{"subnet": "10.77.0.0/16"}]
    env = compose.environment(resolved["services"]["learner"])
    monkeypatch.setenv("LEARNER_ALLOWED_GENERATOR_HOSTS", env["LEARNER_ALLOWED_GENERATOR_HOSTS"])
    learner = LearnerSettings.load(ROOT / "configs" / "gpu.toml")
    assert learner.allowed_generator_hosts == ["10.77.0.0/16"] and learner.weight_sync_bind == ""
    allowed = HostAllowList(learner.allowed_generator_hosts)
    assert allowed.allows("http://10.77.0.5:8001") and not allowed.allows("http://192.168.1.5:8001")


@needs_compose
def test_compose_gives_the_reward_plugin_a_token_the_scorer_sends():
    services = compose.resolved(DEFAULT)["services"]
    token = compose.REQUIRED_ENV["PLUGIN_TOKEN"]
    assert (
        compose.environment(services["reward-plugin"])["PLUGIN_TOKEN"]
        == compose.environment(services["scorer"])["PLUGIN_TOKEN"]
        == token
    )
    for config in ("gpu.toml", "gpu-1.toml"):
        rewards = tomllib.loads((ROOT / "configs" / config).read_text())["scorer"]["rewards"]
        plugins = [reward for reward in rewards if "reward-plugin" in reward.get("url", "")]
        assert plugins and all(reward["bearer_token_env"] == "PLUGIN_TOKEN" for reward in plugins), config


@needs_compose
@pytest.mark.parametrize("missing", sorted(compose.REQUIRED_ENV))
def test_compose_refuses_to_run_without_its_secrets(missing):
    result = compose.resolve(DEFAULT, {missing: ""})
    assert result.returncode != 0 and f"set {missing} in .env" in result.stderr


@needs_compose
@pytest.mark.parametrize(
    ("gpus", "learner_gpus"), [("2", "0"), ("4", "0"), ("8", "0"), ("8", "0,1"), ("8", "6,7"), ("auto", "0")]
)
def test_compose_placement_keeps_generators_off_the_learners_gpus(gpus, learner_gpus):
    services = compose.resolved(DEFAULT, {"GPU_COUNT": gpus, "LEARNER_GPUS": learner_gpus})["services"]
    generator, learner = compose.environment(services["generator"]), compose.environment(services["learner"])
    # One namespace for every replica: set by compose, so not each container's own host name.
    assert generator["GENERATOR_GPU_HOST_KEY"] == "gpu-box"
    assert services["generator"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
    assert generator["GENERATOR_GPU_COUNT"] == gpus and generator.get("GENERATOR_COLOCATED", "false") == "false"
    learner_set = parse_gpu_list(learner["CUDA_VISIBLE_DEVICES"])
    assert learner_set == parse_gpu_list(generator["GENERATOR_LEARNER_GPUS"]) == parse_gpu_list(learner_gpus)
    if gpus != "auto":
        candidates = leasable_gpus(int(gpus), parse_gpu_list(generator["GENERATOR_LEARNER_GPUS"]), colocated=False)
        assert set(candidates).isdisjoint(learner_set)
        assert len(candidates) + len(learner_set) == int(gpus)  # every GPU has a job at --scale generator=len


@needs_compose
def test_one_gpu_override_colocates_on_gpu_0_with_shares_that_fit():
    services = compose.resolved(ONE_GPU)["services"]
    generator, learner = compose.environment(services["generator"]), compose.environment(services["learner"])
    assert generator["GENERATOR_COLOCATED"] == "true" and generator["GENERATOR_GPU_HOST_KEY"] == "gpu-box"
    assert generator["GENERATOR_GPU_COUNT"] == "1" and leasable_gpus(1, (0,), colocated=True) == (0,)
    assert parse_gpu_list(learner["CUDA_VISIBLE_DEVICES"]) == parse_gpu_list(generator["GENERATOR_LEARNER_GPUS"])
    assert services["learner"]["depends_on"]["generator"]["condition"] == "service_healthy"
    assert "/ready" in " ".join(services["generator"]["healthcheck"]["test"])  # vLLM has taken its share first
    assert generator["ASYNCGRPO_CONFIG"] == learner["ASYNCGRPO_CONFIG"] == "/config/gpu-1.toml"
    document = tomllib.loads((ROOT / "configs" / "gpu-1.toml").read_text())
    shares = document["generator"]["gpu_memory_utilization"], document["learner"]["gpu_memory_share"]
    assert memory_share_error(*shares) is None


@needs_compose
@pytest.mark.parametrize("service", ["generator", "scorer", "learner"])
def test_one_gpu_shares_over_the_whole_gpu_stop_every_container(service, monkeypatch):
    """configs/gpu-1.toml turns colocated mode on itself, so the learner's container, whose environment has no
    GENERATOR_* variables, refuses shares that do not fit as well as the generator's."""
    env = compose.environment(compose.resolved(ONE_GPU)["services"][service])
    for variable in [v for v in os.environ if v.split("_")[0] in {"GENERATOR", "SCORER", "LEARNER"}]:
        monkeypatch.delenv(variable)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    path = env["ASYNCGRPO_CONFIG"].replace("/config", str(ROOT / "configs"))
    load_service(path, service)  # as shipped: 0.4 + 0.5
    monkeypatch.setenv("LEARNER_GPU_MEMORY_SHARE", "0.7")
    with pytest.raises(PipelineError, match=r"utilization \(0.4\) \+ learner.gpu_memory_share \(0.7\) = 1.10 exceeds"):
        load_service(path, service)


@needs_compose
@pytest.mark.parametrize("files", [DEFAULT, ONE_GPU], ids=["default", "one-gpu"])
def test_each_container_builds_its_settings_from_what_compose_gives_it(files, monkeypatch):
    services = compose.resolved(files)["services"]
    classes = {"generator": GeneratorSettings, "scorer": ScorerSettings, "learner": LearnerSettings}
    for name, cls in classes.items():
        env = compose.environment(services[name])
        with monkeypatch.context() as patch:
            for variable in [v for v in os.environ if v.split("_")[0] in {"GENERATOR", "SCORER", "LEARNER"}]:
                patch.delenv(variable)
            for variable, value in env.items():
                patch.setenv(variable, value)
            patch.setenv("ASYNCGRPO_CONFIG", env["ASYNCGRPO_CONFIG"].replace("/config", str(ROOT / "configs")))
            settings = cls.load()
        assert settings.redis_url == env["REDIS_URL"], name
        for variable in env:
            prefix = f"{name.upper()}_"
            if variable.startswith(prefix):
                assert variable.removeprefix(prefix).lower() in cls.model_fields, variable


def test_env_example_lists_every_variable_compose_reads():
    read: set[str] = set()
    for name in ONE_GPU:
        text = (ROOT / name).read_text()
        read |= set(re.findall(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)", text))
    listed = set(re.findall(r"^([A-Z_][A-Z0-9_]*)=", (ROOT / ".env.example").read_text(), re.MULTILINE))
    assert read and read <= listed, f"missing from .env.example: {sorted(read - listed)}"
    assert {"API_TOKEN", "REDIS_PASSWORD", "LEARNER_GPUS", "GPU_COUNT", "GPU_HOST_KEY"} <= read
    assert set(compose.REQUIRED_ENV) <= read


def test_every_secret_placeholder_is_one_the_services_refuse_and_says_how_to_make_one():
    """.env.example and the Kubernetes Secret ship placeholders a service refuses at start (change-me...), and
    say how to make a real secret."""
    example = (ROOT / ".env.example").read_text()
    placeholders = dict(re.findall(r"^([A-Z_]+)=(.*)$", example, re.MULTILINE))
    secret = _k8s("namespace-and-config.yaml", "Secret")["stringData"]
    assert set(secret) == set(compose.REQUIRED_ENV)
    for name in compose.REQUIRED_ENV:
        assert placeholders[name].startswith("change-me") and secret[name].startswith("change-me"), name
    make = 'python -c "import secrets; print(secrets.token_urlsafe(32))"'
    assert make in example and make in (ROOT / "deploy" / "k8s" / "namespace-and-config.yaml").read_text()


def test_compose_and_launcher_read_the_same_settings(monkeypatch):
    compose_file = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose_file["x-common-env"]["ASYNCGRPO_CONFIG"] == "/config/gpu.toml"  # configs/ is mounted at /config
    monkeypatch.setenv("API_TOKEN", "x")
    pipeline = PipelineConfig.load(ROOT / "configs" / "gpu.toml")  # the schema `asyncgrpo run` validates
    assert pipeline.learner.weight_sync_host == "learner" and pipeline.generator.port == 8001
    one_gpu = PipelineConfig.load(ROOT / "configs" / "gpu-1.toml")
    assert memory_share_error(one_gpu.generator.gpu_memory_utilization, one_gpu.learner.gpu_memory_share) is None


def test_k8s_images_carry_the_release_tag():
    images = re.findall(r"image:\s*(\S+)", "".join(p.read_text() for p in (ROOT / "deploy" / "k8s").glob("*.yaml")))
    assert images and not any(i.endswith(":latest") or ":" not in i for i in images), images
    ours = {i for i in images if i.startswith("asyncgrpo")}
    assert ours == {f"asyncgrpo-gpu:{VERSION}", f"asyncgrpo-scorer:{VERSION}"}


def test_demo_config_is_valid(monkeypatch):
    monkeypatch.setenv("API_TOKEN", "x")
    pipeline = PipelineConfig.load(ROOT / "configs" / "demo-cpu.toml")
    assert pipeline.learner.model == "@smollm2"


def _k8s_documents() -> list[dict]:
    return [
        document
        for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        if document
    ]


def _k8s(file: str, kind: str, name: str | None = None) -> dict:
    documents = yaml.safe_load_all((ROOT / "deploy" / "k8s" / file).read_text())
    return next(d for d in documents if d and d["kind"] == kind and name in (None, d["metadata"]["name"]))


def _env(container: dict) -> dict[str, str]:
    """A container's variables: a value, or ``secret:<key>`` / ``field:<path>`` where one comes from."""
    out = {}
    for variable in container.get("env", []):
        source = variable.get("valueFrom", {})
        if "secretKeyRef" in source:
            out[variable["name"]] = f"secret:{source['secretKeyRef']['key']}"
        elif "fieldRef" in source:
            out[variable["name"]] = f"field:{source['fieldRef']['fieldPath']}"
        else:
            out[variable["name"]] = variable["value"]
    return out


def test_dockerfiles_run_as_a_user_of_their_own():
    for path in (ROOT / "deploy").glob("*.Dockerfile"):
        users = re.findall(r"^USER\s+(\S+)", path.read_text(), re.MULTILINE)
        assert users and users[-1].split(":")[0] not in ("root", "0"), path.name


def test_k8s_pods_run_without_privilege():
    """Every pod: not root, no privilege escalation, no capability, a read-only root filesystem."""
    pods = [d for d in _k8s_documents() if d["kind"] in ("Deployment", "StatefulSet", "Job")]
    assert {pod["metadata"]["name"] for pod in pods} == {"generator", "learner", "scorer", "reward-plugin", "redis"}
    for pod in pods:
        spec = pod["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] > 0
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
            assert context["capabilities"] == {"drop": ["ALL"]}, pod["metadata"]["name"]
    generator = _k8s("generator.yaml", "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "checkpoints", "mountPath": "/checkpoints", "readOnly": True} in generator["volumeMounts"]


def test_k8s_services_log_in_to_redis_as_their_own_users_made_by_shared_redis_acl():
    redis = _k8s("redis.yaml", "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    env = _env(redis)
    assert redis["command"] == ["sh", "-c", deploy_script("k8s")] and "args" not in redis
    assert "$(" not in deploy_script("k8s")  # the kubelet would put a $(NAME) on the command line
    assert {name: env[name] for name in ("REDIS_PASSWORD", *(secret_name(r) for r in ROLES))} == {
        name: f"secret:{name}" for name in ("REDIS_PASSWORD", *(secret_name(r) for r in ROLES))
    }
    for file, kind, role in [
        ("generator.yaml", "Deployment", "generator"),
        ("scorer.yaml", "Deployment", "scorer"),
        ("learner.yaml", "Job", "learner"),
    ]:
        env = _env(_k8s(file, kind)["spec"]["template"]["spec"]["containers"][0])
        assert env["REDIS_URL"] == f"redis://{role}:$({secret_name(role)})@redis:6379/0", role
        assert env[secret_name(role)] == f"secret:{secret_name(role)}" and "REDIS_PASSWORD" not in env, role


def test_k8s_network_policies_let_only_generators_reach_the_weight_store_and_services_reach_redis():
    learner = _k8s("learner.yaml", "NetworkPolicy")["spec"]
    assert learner["podSelector"] == {"matchLabels": {"app": "learner"}}
    from_generators, http_only = learner["ingress"]
    assert from_generators == {"from": [{"podSelector": {"matchLabels": {"app": "generator"}}}]}
    assert http_only == {"ports": [{"port": 8003, "protocol": "TCP"}]}  # from anyone: HTTP, never 29500
    redis = _k8s("redis.yaml", "NetworkPolicy")["spec"]
    [rule] = redis["ingress"]
    [selector] = rule["from"][0]["podSelector"]["matchExpressions"]
    assert sorted(selector["values"]) == ["generator", "learner", "scorer"] and selector["operator"] == "In"
    [plugin_rule] = _k8s("scorer.yaml", "NetworkPolicy")["spec"]["ingress"]
    assert plugin_rule["from"] == [{"podSelector": {"matchLabels": {"app": "scorer"}}}]
    learner_env = _env(_k8s("learner.yaml", "Job")["spec"]["template"]["spec"]["containers"][0])
    assert learner_env["LEARNER_WEIGHT_SYNC_BIND"] == "field:status.podIP"  # the store: the pod's IP alone


def _plugin_binds_beyond_loopback(command: list[str], monkeypatch) -> bool:
    """Whether the plugin started with ``command`` (``python -m services.reward_plugin ...``) listens where
    another container or pod can reach it (its own parser reads the arguments; no PLUGIN_HOST is set)."""
    monkeypatch.delenv("PLUGIN_HOST", raising=False)
    args = parse_plugin_args("", command[command.index("services.reward_plugin") + 1 :])
    return not cli_loopback(args.host)


@needs_compose
def test_compose_reward_plugin_is_reachable_from_the_scorer(monkeypatch):
    entrypoint = compose.resolved(DEFAULT)["services"]["reward-plugin"]["entrypoint"]
    assert _plugin_binds_beyond_loopback(entrypoint, monkeypatch), entrypoint


def test_k8s_reward_plugin_is_reachable_from_the_scorer(monkeypatch):
    plugin = _k8s("scorer.yaml", "Deployment", "reward-plugin")["spec"]["template"]["spec"]["containers"][0]
    assert _plugin_binds_beyond_loopback(plugin["command"], monkeypatch), plugin["command"]


def test_k8s_configuration_is_valid_and_the_reward_plugin_takes_a_token(tmp_path, monkeypatch):
    monkeypatch.setenv("API_TOKEN", "x")
    config = tmp_path / "pipeline.toml"
    config.write_text(_k8s("namespace-and-config.yaml", "ConfigMap")["data"]["pipeline.toml"])
    pipeline = PipelineConfig.load(config)
    assert pipeline.learner.allowed_generator_hosts == ["10.244.0.0/16"]
    plugin = _k8s("scorer.yaml", "Deployment", "reward-plugin")["spec"]["template"]["spec"]["containers"][0]
    assert _env(plugin)["PLUGIN_TOKEN"] == "secret:PLUGIN_TOKEN"


def test_dockerfiles_pass_hadolint():
    result = _run(str(BIN / "hadolint"), *sorted(str(p) for p in (ROOT / "deploy").rglob("*.Dockerfile")))
    assert result.returncode == 0, result.stdout + result.stderr


def test_manifests_pass_yamllint_and_kubernetes_schemas():
    lint = _run(str(BIN / "yamllint"), "deploy/k8s", "deploy/prometheus", "docker-compose.yml", "deploy/one-gpu.yml")
    assert lint.returncode == 0, lint.stdout
    manifests = sorted(str(p) for p in (ROOT / "deploy" / "k8s").glob("*.yaml"))
    schema = _run(str(BIN / "kubernetes-validate"), "--strict", *manifests)
    assert schema.returncode == 0, schema.stdout + schema.stderr


def test_grafana_dashboard_has_the_required_panels():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "asyncgrpo.json").read_text())
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for needed in ("reward", "staleness", "throughput", "weight sync"):
        assert needed in titles
