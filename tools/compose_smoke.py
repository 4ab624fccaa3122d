"""`make compose-smoke`: the stack users start (docker-compose.yml with deploy/cpu.yml), built and run on a CPU.

Phases, each timed: the engine (deploy/engine.sh: Debian's docker.io and docker-compose when missing, dockerd
when none answers), the base images (deploy/local-base.sh, from Debian's archive), the images (the scorer image
and the CPU variant of deploy/gpu.Dockerfile, pip's settings as build secrets: deploy/pip_build_config.py),
`up` with two generator replicas, the least-privilege checks (users, capabilities, read-only mounts, no
published port, Redis ACL users), a few training steps of SmolLM2-135M-Instruct, `docker kill` of one generator
and of the scorer mid-run and their start again, the learner's exit 0, the accounting (no admitted group lost,
none trained twice: the final checkpoint's trained group ids and counters, the run's drops and what is left in
the streams), and `down -v`. Exits non-zero at the first failure, with the failing container's logs.

Run it with Debian's python3 (/usr/bin/python3, which has PyYAML: docker-compose depends on it). Settings by
environment: MODEL_DIR (a prepared model; default ~/.cache/asyncgrpo/smollm2-135m-instruct, made by `asyncgrpo
prepare-model`), SMOKE_BASES=public (build on the pinned public images instead of local ones), TORCH_INDEX (where
the CPU torch comes from; empty: from pip's settings), SMOKE_TIMEOUT_S (the training phase's limit).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "asyncgrpo-smoke"
VERSION = "0.1.0"
SCORER_IMAGE, CPU_IMAGE = f"asyncgrpo-scorer:{VERSION}", f"asyncgrpo-cpu:{VERSION}"
LOCAL_PYTHON, LOCAL_REDIS = "asyncgrpo-local/python:3.11", "asyncgrpo-local/redis:7.0"
RUN_NAME = "compose-cpu"  # configs/compose-cpu.toml's run_name and max_steps
MAX_STEPS, GROUPS_PER_STEP = 8, 2
KILL_AT_STEP = 3
PIP_PORT = 8765
CPU_LOCKS = "requirements/torch-cpu.txt requirements/cpu.txt"  # deploy/cpu.yml's build arguments
CPU_APT_PACKAGES = "libnuma1 g++"
SECRETS = ("API_TOKEN", "REDIS_PASSWORD", "REDIS_GENERATOR_PASSWORD", "REDIS_SCORER_PASSWORD")
SECRETS += ("REDIS_LEARNER_PASSWORD", "PLUGIN_TOKEN")


class SmokeFailed(RuntimeError):
    """A phase failed; the message says which and why."""


def sh(*args: str, env: dict[str, str] | None = None, check: bool = True, quiet: bool = False) -> str:
    """Runs a command; its stdout, or SmokeFailed with its output."""
    result = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    if check and result.returncode != 0:
        raise SmokeFailed(
            f"{' '.join(args[:6])} … exited {result.returncode}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    if not quiet and result.returncode != 0:
        print(result.stderr[-2000:], file=sys.stderr)
    return result.stdout


def docker_for_builds() -> str:
    """A docker client whose `build` does BuildKit: the default one if it has buildx, else Debian's 20.10 client."""
    if subprocess.run(["docker", "buildx", "version"], capture_output=True, check=False).returncode == 0:
        return "docker"
    if Path("/usr/bin/docker").exists():
        return "/usr/bin/docker"
    raise SmokeFailed("no docker client that builds with BuildKit: install docker-buildx, or Debian's docker.io")


def compose_command() -> list[str]:
    """`docker compose` (v2) where it exists, else docker-compose (v1, Debian's)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise SmokeFailed("no Compose client: apt-get install docker-compose")


class Smoke:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.docker = docker_for_builds()
        self.compose = compose_command()
        self.model = Path(os.environ.get("MODEL_DIR", Path.home() / ".cache/asyncgrpo/smollm2-135m-instruct"))
        if not (self.model / "config.json").is_file():
            raise SmokeFailed(f"MODEL_DIR={self.model} holds no model: run `asyncgrpo prepare-model` or set MODEL_DIR")
        self.env = {**os.environ, **{name: secrets.token_hex(24) for name in SECRETS}}
        self.env["REDIS_IMAGE"] = "redis:7.2" if os.environ.get("SMOKE_BASES") == "public" else LOCAL_REDIS
        self.pip_server: subprocess.Popen[bytes] | None = None
        self.phases: list[tuple[str, float]] = []
        self.killed: set[str] = set()

    # Phases ------------------------------------------------------------------------------------------------
    def phase(self, name: str, action) -> None:
        print(f"== {name}", flush=True)
        start = time.monotonic()
        action()
        self.phases.append((name, time.monotonic() - start))
        print(f"== {name}: {self.phases[-1][1]:.0f} s", flush=True)

    def engine(self) -> None:
        subprocess.run([str(ROOT / "deploy/engine.sh")], check=True)

    def bases(self) -> None:
        if os.environ.get("SMOKE_BASES") != "public":
            subprocess.run([str(ROOT / "deploy/local-base.sh")], check=True, env={**self.env, "DOCKER": self.docker})

    def images(self) -> None:
        secret = self.work / "pip"
        sh(sys.executable, str(ROOT / "deploy/pip_build_config.py"), "write", str(secret), "--port", str(PIP_PORT))
        served = any((secret / "serve").iterdir())
        if served:
            command = [sys.executable, str(ROOT / "deploy/pip_build_config.py"), "serve", str(secret)]
            self.pip_server = subprocess.Popen([*command, "--port", str(PIP_PORT)])
        torch_index = os.environ.get("TORCH_INDEX", "" if served else "https://download.pytorch.org/whl/cpu")
        public = os.environ.get("SMOKE_BASES") == "public"
        python_311 = None if public else LOCAL_PYTHON
        self.build("deploy/scorer.Dockerfile", SCORER_IMAGE, python_311, {"TORCH_INDEX": torch_index}, secret)
        cpu = {"TORCH_INDEX": torch_index, "LOCKS": CPU_LOCKS, "APT_PACKAGES": CPU_APT_PACKAGES}
        if public:  # the scorer image's pinned Python 3.11 (the CPU lock's)
            cpu["BASE_IMAGE"] = scorer_base()
        self.build("deploy/gpu.Dockerfile", CPU_IMAGE, python_311, cpu, secret)

    def build(self, dockerfile: str, tag: str, base: str | None, args: dict[str, str], secret: Path) -> None:
        build_args = [f"--build-arg={k}={v}" for k, v in {**({"BASE_IMAGE": base} if base else {}), **args}.items()]
        pip_secrets = [f"--secret=id=pipconf,src={secret / 'pip.conf'}", f"--secret=id=cacert,src={secret / 'cacert'}"]
        env = {**self.env, "DOCKER_BUILDKIT": "1"}
        print(f"   build {tag} from {dockerfile}", flush=True)
        options = ["--network=host", *pip_secrets, *build_args, "-f", dockerfile, "-t", tag]
        sh(self.docker, "build", *options, str(ROOT), env=env)

    def model_copy(self) -> None:
        """MODEL_DIR copied into the work folder, readable by the services' uid 10001 (a model directory only
        root may read fails every service's start: the containers never run as root)."""
        copy = self.work / "model"
        shutil.copytree(self.model, copy)
        for path in [copy, *copy.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        self.work.chmod(0o755)
        self.env["MODEL_DIR"] = str(copy)

    def check_images(self) -> None:
        """Inside each image: every module imports and torch/vLLM are the CPU builds (deploy/image_check.py);
        no index setting or host certificate in its history or files (tools/image_leaks.py)."""
        with open(ROOT / "deploy/image_check.py") as check:
            command = ["docker", "run", "--rm", "-i", "--entrypoint", "python", CPU_IMAGE, "-", "--expect", "cpu"]
            result = subprocess.run(command, stdin=check, capture_output=True, text=True, check=False)
        must(result.returncode == 0, f"the import check failed in {CPU_IMAGE}:\n{result.stderr[-3000:]}")
        print(f"   {CPU_IMAGE}: {result.stdout.strip().splitlines()[-1]}")
        leaks = subprocess.run(
            [sys.executable, str(ROOT / "tools/image_leaks.py"), SCORER_IMAGE, CPU_IMAGE], check=False
        )
        must(leaks.returncode == 0, "an image holds this machine's index settings or certificates (above)")

    def up(self) -> None:
        self.model_copy()
        resolved = sh(*self.compose, "-f", "docker-compose.yml", "-f", "deploy/cpu.yml", "config", env=self.cwd_env())
        self.file = self.work / "compose.yml"  # holds the run's passwords: the work folder is the user's only
        self.file.write_text(yaml.safe_dump(without_gpu_reservations(yaml.safe_load(resolved))))
        self.run_compose("up", "-d", "--no-build", "--scale", "generator=2")

    def least_privilege(self) -> None:
        for service in ("generator", "scorer", "learner", "reward-plugin"):
            for container in self.containers(service):
                uid = sh("docker", "exec", container, "id", "-u").strip()
                info = self.inspect(container)
                must(uid == "10001", f"{service} runs as uid {uid}, not 10001")
                must(info["HostConfig"]["CapDrop"] == ["ALL"], f"{service} keeps capabilities")
                must("no-new-privileges:true" in info["HostConfig"]["SecurityOpt"], f"{service} may gain privileges")
        for service in ("redis", "generator", "scorer", "learner", "reward-plugin"):
            for container in self.containers(service):
                must(not self.inspect(container)["HostConfig"]["PortBindings"], f"{service} publishes a port")
        for container in self.containers("generator"):
            mounts = {m["Destination"]: m for m in self.inspect(container)["Mounts"]}
            must(not mounts["/checkpoints"]["RW"] and not mounts["/models/initial"]["RW"], "generator mounts rw")
        must(sh("docker", "exec", self.containers("redis")[0], "id", "-u").strip() != "0", "redis runs as root")
        denied = json.loads(self.probe(ACL_PROBE))
        print(f"   Redis refuses: {json.dumps(denied)}")
        must(all(denied.values()), f"a Redis user may do what its ACL forbids: {denied}")

    def train_with_kills(self) -> None:
        limit = float(os.environ.get("SMOKE_TIMEOUT_S", "1500"))
        deadline = time.monotonic() + limit
        self.wait(lambda: self.step() >= KILL_AT_STEP, f"step {KILL_AT_STEP}", deadline)
        generator, scorer = self.containers("generator")[0], self.containers("scorer")[0]
        self.killed |= {generator, scorer}
        sh("docker", "kill", generator, scorer)
        print(f"   docker kill one generator and the scorer at step {self.step()}", flush=True)
        time.sleep(5)
        sh("docker", "start", generator, scorer)
        self.wait(lambda: self.learner_state()["Status"] == "exited", "the learner's exit", deadline)
        code = self.learner_state()["ExitCode"]
        must(code == 0, f"the learner exited {code}")

    def accounting(self) -> None:
        counts = json.loads(self.probe(ACCOUNTING_PROBE.replace("RUN_NAME", RUN_NAME), volumes=True))
        print(f"   {json.dumps(counts)}")
        must(counts["step"] == MAX_STEPS, f"the run ended at step {counts['step']}, not {MAX_STEPS}")
        must(counts["trained_twice"] == 0, f"{counts['trained_twice']} groups trained twice")
        must(counts["lost"] == 0, f"{counts['lost']} admitted groups lost")
        must(counts["trained"] == MAX_STEPS * GROUPS_PER_STEP, "a step trained fewer groups than it should")

    def down(self) -> None:
        if getattr(self, "file", None):
            self.run_compose("down", "-v", "--remove-orphans")
        if self.pip_server:
            self.pip_server.terminate()
            self.pip_server.wait(10)

    # Helpers -----------------------------------------------------------------------------------------------
    def cwd_env(self) -> dict[str, str]:
        return {**self.env, "PWD": str(ROOT)}

    def run_compose(self, *args: str) -> str:
        return sh(*self.compose, "-p", PROJECT, "-f", str(self.file), *args, env=self.cwd_env())

    def containers(self, service: str) -> list[str]:
        return sorted(self.run_compose("ps", "-q", service).split())

    def inspect(self, container: str) -> dict:
        return json.loads(sh("docker", "inspect", container))[0]

    def learner_state(self) -> dict:
        return self.inspect(self.containers("learner")[0])["State"]

    def step(self) -> int:
        """The learner's last step in its metrics.jsonl (0 before the first)."""
        learner = self.containers("learner")[0]
        path = f"/checkpoints/{RUN_NAME}/metrics.jsonl"
        lines = sh("docker", "exec", learner, "cat", path, check=False, quiet=True).splitlines()
        return max((json.loads(line).get("step", 0) for line in lines if line.startswith("{")), default=0)

    def wait(self, done, what: str, deadline: float) -> None:
        while not done():
            self.no_restarts()
            state = self.learner_state()
            if state["Status"] == "exited" and what != "the learner's exit":
                raise SmokeFailed(f"the learner exited ({self.learner_state()['ExitCode']}) before {what}")
            if time.monotonic() > deadline:
                raise SmokeFailed(f"no {what} within the time limit (SMOKE_TIMEOUT_S)")
            time.sleep(5)

    def no_restarts(self) -> None:
        """SmokeFailed if a container the smoke did not kill failed and was restarted."""
        for service in ("redis", "reward-plugin", "generator", "scorer", "learner"):
            for container in self.containers(service):
                info = self.inspect(container)
                if container not in self.killed and (info["RestartCount"] or info["State"]["Restarting"]):
                    count = info["RestartCount"]
                    raise SmokeFailed(f"{service} {container[:12]} stopped and was restarted by its policy ({count}x)")

    def probe(self, code: str, *, volumes: bool = False) -> str:
        """Runs Python in a throw-away scorer container on the run's network (Redis as its administrator)."""
        mounts = ["-v", f"{PROJECT}_checkpoints:/checkpoints:ro"] if volumes else []
        env = {**self.env, "REDIS_URL": f"redis://default:{self.env['REDIS_PASSWORD']}@redis:6379/0"}
        for role in ("generator", "scorer"):
            env[f"{role.upper()}_URL"] = f"redis://{role}:{self.env[f'REDIS_{role.upper()}_PASSWORD']}@redis:6379/0"
        names = ["REDIS_URL", "GENERATOR_URL", "SCORER_URL", "STREAM_PREFIX"]
        env.setdefault("STREAM_PREFIX", "grpo")
        variables = [f"--env={name}" for name in names]  # values from this process's environment, not argv
        network = f"--network={PROJECT}_default"
        command = ["docker", "run", "--rm", network, "--cap-drop=ALL", *variables, *mounts, "--entrypoint", "python"]
        return sh(*command, SCORER_IMAGE, "-c", code, env=env)

    def report_failure(self) -> None:
        if not getattr(self, "file", None):
            return
        for line in self.run_compose("ps").splitlines():
            print(f"   {line}")
        for service in ("generator", "scorer", "learner", "reward-plugin", "redis"):
            for container in self.containers(service):
                logs = subprocess.run(["docker", "logs", "--tail", "25", container], capture_output=True, text=True)
                print(f"--- {service} {container[:12]} (last lines)\n{logs.stdout}{logs.stderr}")


def without_gpu_reservations(config: dict) -> dict:
    """The resolved file without its GPU device reservations: an override cannot remove a list entry in
    Compose v1 (v2 has `!reset`), and a host without NVIDIA's runtime refuses them."""
    for service in config["services"].values():
        reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
        reservations.pop("devices", None)
    return config


def scorer_base() -> str:
    """The scorer Dockerfile's default BASE_IMAGE (the pinned public Python 3.11)."""
    for line in (ROOT / "deploy/scorer.Dockerfile").read_text().splitlines():
        if line.startswith("ARG BASE_IMAGE="):
            return line.removeprefix("ARG BASE_IMAGE=")
    raise SmokeFailed("deploy/scorer.Dockerfile has no ARG BASE_IMAGE")


def must(condition: bool, message: str) -> None:
    if not condition:
        raise SmokeFailed(message)


# Runs in a scorer container: True for each thing Redis must refuse.
ACL_PROBE = """
import json, os, redis
p = os.environ["STREAM_PREFIX"]
def refused(url, *command):
    try:
        redis.Redis.from_url(url).execute_command(*command)
    except (redis.exceptions.NoPermissionError, redis.exceptions.AuthenticationError, redis.exceptions.ResponseError):
        return True
    return False
print(json.dumps({
    "no_password": refused("redis://redis:6379/0", "XLEN", p + ":prompts"),
    "scorer_reads_prompts": refused(os.environ["SCORER_URL"], "XLEN", p + ":prompts"),
    "generator_writes_weights": refused(os.environ["GENERATOR_URL"], "SET", p + ":weights:latest", "x"),
    "generator_flushall": refused(os.environ["GENERATOR_URL"], "FLUSHALL"),
}))
"""

# Runs in a scorer container with the checkpoints volume: the run's accounting, from the newest checkpoint (its
# trained group ids and counters), dropped.jsonl and the groups still in Redis (streams, dead letters).
ACCOUNTING_PROBE = """
import collections, json, os, pathlib, redis
run = pathlib.Path("/checkpoints/RUN_NAME")
steps = [p for p in (run / "checkpoints").glob("step-*") if p.name.split("-")[1].isdigit()]
last = max(steps, key=lambda p: int(p.name.split("-")[1]))
state = json.loads((last / "state.json").read_text())
trained = collections.Counter(state["trained_group_ids"])
drops_file = run / "dropped.jsonl"
drops = [json.loads(l) for l in drops_file.read_text().splitlines()] if drops_file.exists() else []
dropped = {d["group_id"] for d in drops if d.get("reason") != "already_trained"}
r, p = redis.Redis.from_url(os.environ["REDIS_URL"]), os.environ["STREAM_PREFIX"]
waiting = set()
for name in ("prompts", "rollouts", "scored", "dead"):
    if r.exists(f"{p}:{name}"):
        waiting |= {f[b"id"].decode() for _, f in r.xrange(f"{p}:{name}") if b"id" in f}
counters = state["counters"]
settled = len(set(trained)) + len(dropped) + int(counters.get("groups_rejected", 0))
in_redis = len(waiting - set(trained) - dropped)
print(json.dumps({
    "step": state["step"], "admitted": int(counters["groups_admitted"]), "trained": len(set(trained)),
    "dropped": dict(collections.Counter(d.get("reason") for d in drops)), "in_redis": in_redis,
    "lost": int(counters["groups_admitted"]) - settled - in_redis,
    "trained_twice": sum(1 for n in trained.values() if n > 1),
    "counters": {k: int(v) for k, v in counters.items()},
}))
"""


def _terminated(signum: int, frame: object) -> None:
    raise SmokeFailed(f"stopped by signal {signum}")


def main() -> int:
    os.chdir(ROOT)
    signal.signal(signal.SIGTERM, _terminated)
    with tempfile.TemporaryDirectory(prefix="asyncgrpo-smoke-") as work:
        smoke = None
        try:
            smoke = Smoke(Path(work))
            for name, action in [
                ("engine", smoke.engine),
                ("bases", smoke.bases),
                ("images", smoke.images),
                ("images checked", smoke.check_images),
                ("up", smoke.up),
                ("least privilege", smoke.least_privilege),
                ("train, kill, restart", smoke.train_with_kills),
                ("accounting", smoke.accounting),
            ]:
                smoke.phase(name, action)
        except (SmokeFailed, subprocess.CalledProcessError) as failure:
            print(f"compose smoke FAILED: {failure}", file=sys.stderr)
            if smoke:
                smoke.report_failure()
                smoke.down()
            return 1
        except BaseException:
            if smoke:
                smoke.down()
            raise
        smoke.phase("down", smoke.down)
        print("compose smoke passed: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in smoke.phases))
        return 0


if __name__ == "__main__":
    sys.exit(main())
