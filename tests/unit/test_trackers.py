"""report_to: a tracker asked for and not installed refuses the start with the install command; what the
trackers receive (TensorBoard read back from its event files, W&B offline from its run directory when wandb is
installed, the W&B and trackio calls through stand-in modules otherwise)."""

from __future__ import annotations

import asyncio
import importlib.machinery
import json
import struct
import sys
import time
import types
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from services.learner.metrics.metric_sinks import MetricsSink
from services.learner.metrics.trackers import TrackingRun, open_trackers, project_name, table_cells
from shared.config.learner import LearnerSettings
from shared.config.pipeline import load_or_exit
from shared.lifecycle import NotStarting
from shared.telemetry import MetricsGauges

ROWS = [
    {"prompt": [{"role": "user", "content": "2+3?"}], "completion": "5", "rewards/accuracy": 1.0, "advantage": 0.5},
    {"prompt": [{"role": "user", "content": "2+3?"}], "completion": "6", "rewards/accuracy": None, "advantage": -0.5},
]


def _sink(log_dir: Path, tracking: TrackingRun | None = None, resumed_step: int | None = None) -> MetricsSink:
    return MetricsSink(log_dir, MetricsGauges(CollectorRegistry()), 10, "off", resumed_step, tracking)


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_a_tracker_that_is_not_installed_refuses_the_start_with_the_install_command(name, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, name, None)  # importing it fails, installed or not
    expected = f"learner.report_to includes {name!r} but {name} is not installed in the learner's environment: "
    expected += f"pip install {name} (or remove {name!r} from report_to)"
    settings = LearnerSettings(model="/m", runs_dir=str(tmp_path), report_to=["tensorboard", name])
    assert settings.start_problems() == [expected]
    with pytest.raises(NotStarting) as refused:
        open_trackers(TrackingRun.from_settings(settings), tmp_path, None)
    assert str(refused.value) == expected
    assert not (tmp_path / "tensorboard").exists()  # nothing opened before the refusal


def test_the_learner_process_refuses_before_anything_starts(monkeypatch, tmp_path, capsys):
    """The learner's start checks (shared.service.main) and build_learner, before the model loads."""
    from services.learner.startup import build_learner

    monkeypatch.setitem(sys.modules, "wandb", None)
    config = tmp_path / "pipeline.toml"
    config.write_text(f'[learner]\nmodel = "/no/model"\nruns_dir = "{tmp_path}"\nreport_to = ["wandb"]\n')
    with pytest.raises(SystemExit) as exited:
        load_or_exit(config, "learner")
    assert exited.value.code == 2 and "pip install wandb" in capsys.readouterr().err
    settings = LearnerSettings.load(config)
    with pytest.raises(NotStarting, match="pip install wandb"):
        asyncio.run(build_learner(settings, client=None, http=None, prometheus=CollectorRegistry()))


def test_report_to_defaults_to_tensorboard_and_names_each_tracker_once():
    assert LearnerSettings(model="/m").report_to == ["tensorboard"]
    assert LearnerSettings(model="/m", report_to=[]).start_problems() == []
    with pytest.raises(ValidationError, match="report_to names tensorboard more than once"):
        LearnerSettings(model="/m", report_to=["tensorboard", "tensorboard"])
    with pytest.raises(ValidationError):
        LearnerSettings(model="/m", report_to=["mlflow"])


def test_the_tracking_run_comes_from_the_settings_with_secrets_masked(tmp_path):
    settings = LearnerSettings(
        model="/m", run_name="r1", runs_dir=str(tmp_path), api_token="s3cret", report_to=[], wandb_entity="team"
    )
    run = TrackingRun.from_settings(settings, environ={"WANDB_PROJECT": "from-env"})
    assert (run.report_to, run.name, run.project, run.entity) == ((), "r1", "from-env", "team")
    assert run.config["run_name"] == "r1" and "s3cret" not in json.dumps(run.config)
    assert TrackingRun.from_settings(settings.model_copy(update={"wandb_entity": ""}), environ={}).entity is None


def test_project_name_precedence():
    assert project_name("mine", {"WANDB_PROJECT": "env"}) == "mine"
    assert project_name("", {"WANDB_PROJECT": "env"}) == "env"
    assert project_name("", {}) == "asyncgrpo"


def test_table_cells_keep_numbers_and_missing_rewards():
    assert table_cells(ROWS) == (
        ["prompt", "completion", "rewards/accuracy", "advantage"],
        [["user: 2+3?", "5", 1.0, 0.5], ["user: 2+3?", "6", None, -0.5]],
    )


def test_no_tracker_leaves_the_files(tmp_path):
    sink = _sink(tmp_path, TrackingRun(report_to=()))
    sink.write(1, {"reward": 1.0})
    sink.write_completions(1, ROWS)
    sink.close()
    assert not (tmp_path / "tensorboard").exists()
    assert [json.loads(line)["completion"] for line in (tmp_path / "completions.jsonl").read_text().splitlines()] == [
        "5",
        "6",
    ]


def test_tensorboard_gets_the_scalars_and_the_completions_table(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = _sink(tmp_path)  # the default: TensorBoard
    sink.write(2, {"reward": 0.75})
    sink.write_completions(2, ROWS)
    sink.write_completions(3, [])  # nothing to show: nothing written
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(2, 0.75)]
    (text,) = events.Tensors("completions/text_summary")
    assert text.step == 2
    table = text.tensor_proto.string_val[0].decode()
    assert table.splitlines()[2] == "| user: 2+3? | 5 | 1.0 | 0.5 |"
    records = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [(r["step"], r["completion"], r["rewards/accuracy"]) for r in records] == [(2, "5", 1.0), (2, "6", None)]


class _StandIn(types.ModuleType):
    """A module that records its calls (for W&B and trackio, which this project's lock does not install)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__spec__ = importlib.machinery.ModuleSpec(name, None)  # found, as an installed one is
        self.calls: list[tuple] = []
        stand_in = self

        class Table:
            def __init__(self, **kwargs) -> None:
                self.kwargs = kwargs

        class Run:
            def log(self, data, step=None) -> None:
                stand_in.calls.append(("log", data, step))

            def finish(self) -> None:
                stand_in.calls.append(("finish",))

        self.Table, self._run = Table, Run()

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self._run

    def log(self, data, step=None) -> None:
        self._run.log(data, step)

    def finish(self) -> None:
        self._run.finish()


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_wandb_and_trackio_get_the_run_the_metrics_at_their_step_and_a_table(name, monkeypatch, tmp_path):
    module = _StandIn(name)
    monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    run = TrackingRun(report_to=(name,), name="r1", project="p", entity="team", config={"lr": 1e-6})
    sink = _sink(tmp_path, run, resumed_step=4)
    sink.write(5, {"reward": 0.5})
    sink.write_completions(6, ROWS)
    sink.close()
    (_, init), (_, metrics, step), (_, logged, table_step), finish = module.calls
    if name == "wandb":
        expected = dict(project="p", entity="team", name="r1", id="r1", dir=str(tmp_path), resume="allow")
        assert init == {**expected, "config": {"lr": 1e-6}}
        assert logged["completions"].kwargs == {
            "columns": ["prompt", "completion", "rewards/accuracy", "advantage"],
            "data": [["user: 2+3?", "5", 1.0, 0.5], ["user: 2+3?", "6", None, -0.5]],
        }
    else:
        assert init == dict(project="p", name="r1", config={"lr": 1e-6}, resume="allow")
        frame = logged["completions"].kwargs["dataframe"]
        assert list(frame.columns) == ["prompt", "completion", "rewards/accuracy", "advantage"]
        assert frame["completion"].tolist() == ["5", "6"]
    assert (metrics, step, table_step, finish) == ({"reward": 0.5}, 5, 6, ("finish",))


def _wandb_records(path: Path) -> list:
    """The records of an offline run's ``run-<id>.wandb`` file (wandb >= 0.19 has no Python reader): a
    LevelDB log, 32 KiB blocks of chunks with a 7-byte header (crc32, length, type: 1 whole record, 2 first,
    3 middle, 4 last), after a 7-byte file header; each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", header
    while pos + header <= len(data):
        if block - pos % block < header:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        if pos + header + length > len(data):  # still being written
            break
        pending += data[pos + header : pos + header + length]
        pos += header + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _finished_records(path: Path, timeout_s: float = 60.0) -> list:
    """The run's records once its ``exit`` record is written: wandb's core process writes the file after
    ``finish()`` returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_records(path) if path.exists() else []
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s"
        time.sleep(0.2)


def _key(item) -> str:
    """A logged name as given: wandb writes it whole or split at its slashes."""
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_writes_what_it_was_given(monkeypatch, tmp_path):
    """The real wandb (skipped where it is not installed: it is not in this project's lock), offline: the run,
    each step's metrics and the completions table, read back from the files it wrote."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-root"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = TrackingRun(report_to=("wandb",), name="offline-r1", project="p", config={"lr": 1e-6})
    sink = _sink(tmp_path / "logs", run)
    for step in (1, 2):
        sink.write(step, {"reward": step / 4, "loss": 1.0})
    sink.write_completions(2, ROWS)
    sink.close()
    assert wandb.run is None  # finished by close
    (run_dir,) = (tmp_path / "wandb-root" / "wandb").glob("offline-run-*-offline-r1")
    records = _finished_records(run_dir / "run-offline-r1.wandb")
    (started,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (started.run_id, started.display_name, started.project) == ("offline-r1", "offline-r1", "p")
    assert {_key(item): item.value_json for item in started.config.update}["lr"] == "1e-6"
    history = [{_key(item): json.loads(item.value_json) for item in r.history.item} for r in records if r.history.item]
    assert [(h["_step"], h["reward"], h["loss"]) for h in history] == [(1, 0.25, 1.0), (2, 0.5, 1.0)]
    assert history[1]["completions/_type"] == "table-file"
    table = json.loads((run_dir / "files" / history[1]["completions/path"]).read_text())
    assert table["columns"] == ["prompt", "completion", "rewards/accuracy", "advantage"]
    assert table["data"] == [["user: 2+3?", "5", 1.0, 0.5], ["user: 2+3?", "6", None, -0.5]]
