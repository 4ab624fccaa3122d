"""The generated reference pages: current, complete (every setting, CLI option and metric has an entry), and the
pieces they are made from (the metric registry, the benchmark results file and ``bench/record.py``)."""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import inspect
import json
import math
import re
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import BaseModel

from bench import record as bench_record
from services.launcher.docs_tables import TABLES, default_text, settings_tables
from services.learner.evaluation import eval_metrics
from services.learner.metrics.batch_metrics import (
    batch_metrics,
    clip_ratio_extremes,
    sampling_logp_difference_metrics,
    terminated_length_metrics,
)
from services.learner.metrics.counters import Counters
from services.learner.objective.importance import importance_weight_metrics
from services.learner.objective.loss import BatchNormalisers, LossInputs, compute_loss
from shared.advantages import completion_metrics, reward_function_metrics, reward_metrics
from shared.config.objective import LOSS_TYPES, Objective
from shared.metric_names import COUNTER, GAUGE, METRICS, Metric, lookup
from tests.support.factories import make_rollout, make_scored, make_trajectory_rollout
from tests.support.processes import ROOT
from tools import docs_reference as ref

# --- the pages are current --------------------------------------------------------------------------------------


def test_every_page_is_what_the_code_makes():
    out_of_date = ref.stale(ref.pages())
    assert not out_of_date, (
        f"{[str(p.relative_to(ROOT)) for p in out_of_date]}: run python tools/docs_reference.py --write"
    )


def test_the_check_names_a_changed_and_a_missing_page(tmp_path):
    same, changed, missing = tmp_path / "same.md", tmp_path / "changed.md", tmp_path / "missing.md"
    same.write_text("a\n")
    changed.write_text("old\n")
    assert ref.stale({same: "a\n", changed: "new\n", missing: "x\n"}) == [changed, missing]


def _sections(page: str, level: int) -> dict[str, str]:
    """Heading text -> the page's text up to the next heading of that level or above."""
    parts = re.split(rf"^(#{{1,{level}}} .+)$", page, flags=re.MULTILINE)
    return {parts[i].lstrip("# ").strip("`"): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


# --- every setting, CLI option and metric has an entry ----------------------------------------------------------


def test_every_setting_has_a_reference_entry():
    tables = _sections((ROOT / "docs/reference/settings.md").read_text(), 4)
    for cls, _, table in TABLES:
        rows = tables.get(f"[{table}]", "")
        missing = [name for name in cls.model_fields if f"| `{name}` |" not in rows]
        assert not missing, f"docs/reference/settings.md [{table}] lacks {missing}: run tools/docs_reference.py --write"


# Settings models of shared/config that are not a table of their own (nor a part of one), and why.
_NOT_TABLES = {
    "PipelineConfig": "the whole file: one table per service",
    "EnvServerSettings": "set by python -m services.env_server's options (docs/reference/cli.md)",
}


def test_every_settings_model_is_a_table_or_part_of_one():
    parts = {base for cls, _, _ in TABLES for base in cls.__mro__}  # LearnerSettings is made of BatchSettings...
    seen = set()
    for path in sorted((ROOT / "shared" / "config").glob("*.py")):
        module = importlib.import_module(f"shared.config.{path.stem}")
        for node in ast.parse(path.read_text()).body:
            cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
            if isinstance(cls, type) and issubclass(cls, BaseModel):
                seen.add(node.name)
                assert cls in parts or node.name in _NOT_TABLES, (
                    f"{path.name}: {node.name} is in no settings table: add it to docs_tables.TABLES"
                )
    assert set(_NOT_TABLES) <= seen, f"_NOT_TABLES names models that are gone: {set(_NOT_TABLES) - seen}"


def _commands(command: str, parser: argparse.ArgumentParser):
    yield command, parser
    for name, _, sub in ref.subcommands(parser):
        yield from _commands(f"{command} {name}", sub)


def test_every_cli_option_has_a_reference_entry():
    sections = _sections((ROOT / "docs/reference/cli.md").read_text(), 6)
    for top, parser in ref.entry_points():
        for command, sub in _commands(top, parser):
            assert command in sections, f"docs/reference/cli.md has no section for {command}"
            body = sections[command]
            missing = [ref.option_name(a) for a in ref.options(sub) if f"| `{ref.option_name(a)}` |" not in body]
            assert not missing, f"docs/reference/cli.md's {command} lacks {missing}"


def test_the_cli_reference_covers_each_entry_point():
    commands = [command for command, _ in ref.entry_points()]
    assert commands[0] == "asyncgrpo"
    assert {"python -m services.env_server", "python -m services.reward_plugin", "python -m services.learner"} <= set(
        commands
    )


def test_every_registered_metric_has_a_reference_entry():
    page = (ROOT / "docs/reference/metrics.md").read_text()
    missing = [m.name for m in METRICS if f"| `{m.name}` |" not in page]
    assert not missing, f"docs/reference/metrics.md lacks {missing}"


# --- the metric registry against the source ---------------------------------------------------------------------

_NAMESPACED = re.compile(r"[a-z][a-z0-9_]*(/([a-z0-9_]+|<x>))+$")
_METRIC_DICT = re.compile(r"metric|sums|seconds|flags")
# Strings the scan finds that are not metric names, and what they are.
_NOT_METRICS = {
    "application/json": "a content type",
    "ipc/weights": "a key of the weight push's store",
    "ipc/done/<x>": "a key of the weight push's store",
    "entropy/acting_sum": "summed across ranks, not logged",
    "entropy/acting_tokens": "summed across ranks, not logged",
    "last_entropy": "the entropy controller's checkpointed state",
    "input_tokens": "popped by the train loop into the cumulative num_tokens",
    "load_seconds": "a weight update's phase time, in its log line and /weights/update answer",
    "receive_wait_seconds": "a weight update's phase time, in its log line and /weights/update answer",
}
# Families written with a computed name, whose members the figures test below gets by calling the code.
_CALLED = {"counters/<x>": "the Counters fields", "eval/<x>": "eval_metrics' names"}


def _text(node: ast.AST) -> str | None:
    """A string constant, or an f-string with each ``{...}`` as ``<x>``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "<x>" for v in node.values)
    return None


def _returns_metrics(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return function.returns is not None and ast.unparse(function.returns) == "dict[str, float]"


def _dict_keys(node: ast.AST) -> list[str]:
    keys = [_text(k) for k in node.keys if k is not None] if isinstance(node, ast.Dict) else []
    return [k for k in keys if k]


def _metric_dict_keys(tree: ast.AST) -> set[str]:
    """Keys of the dicts that hold metrics: returned by a ``-> dict[str, float]`` function, built in a function
    named ``*metrics*``, or assigned to (or subscripted on) a name like ``metrics``, ``sums``, ``seconds``,
    ``flags``."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _returns_metrics(node):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Return) and inner.value is not None:
                    found.update(_dict_keys(inner.value))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and "metrics" in node.name:
            for inner in ast.walk(node):
                found.update(_dict_keys(inner))
        if isinstance(node, ast.Assign):
            for target in node.targets:
                name = ast.unparse(target.value if isinstance(target, ast.Subscript) else target)
                if _METRIC_DICT.search(name):
                    found.update(_dict_keys(node.value))
                    if isinstance(target, ast.Subscript) and _text(target.slice):
                        found.add(_text(target.slice))
    return found


def source_metric_names() -> dict[str, str]:
    """Every metric-like name in services/ and shared/ (the registry itself left out) -> a file that has it."""
    names: dict[str, str] = {}
    for path in sorted([*(ROOT / "services").rglob("*.py"), *(ROOT / "shared").rglob("*.py")]):
        if path.name == "metric_names.py":
            continue
        tree = ast.parse(path.read_text())
        texts = {t for node in ast.walk(tree) if (t := _text(node)) and _NAMESPACED.match(t)}
        for name in texts | _metric_dict_keys(tree):
            names.setdefault(name, str(path.relative_to(ROOT)))
    return names


def _registered(name: str) -> bool:
    """``name`` (``<x>`` for an f-string's value) stands for registered metrics: with ``<x>`` as a sample value,
    or as the registry's own placeholder."""
    sample = name.replace("<x>", "sample")
    return lookup(sample) is not None or any(re.sub(r"<[a-z_]+>", "<x>", m.name) == name for m in METRICS)


def test_every_metric_name_in_the_source_is_registered():
    skipped = _NOT_METRICS.keys() | _CALLED.keys()
    unknown = {n: where for n, where in source_metric_names().items() if n not in skipped and not _registered(n)}
    assert not unknown, f"metric names not in shared/metric_names.py (add each with its meaning): {unknown}"


def test_every_registered_metric_is_emitted():
    """A name in the registry that neither the source nor a call of the code emits is stale."""
    emitted = set(source_metric_names()) | called_metric_names() | {"step"}  # "step": MetricsSink.write adds it
    shapes = {re.sub(r"<[a-z_]+>", "<x>", n) for n in emitted}
    stale = [
        m.name
        for m in METRICS
        if re.sub(r"<[a-z_]+>", "<x>", m.name) not in shapes
        and not any(m.pattern().match(n.replace("<x>", "sample")) for n in emitted)
    ]
    assert not stale, f"registered but never emitted (remove them): {stale}"


def test_the_scan_finds_metric_dicts_and_leaves_other_strings():
    tree = ast.parse(
        "def figures() -> dict[str, float]:\n    return {'alpha': 1.0}\n"
        "def write_metrics():\n    line = {'epsilon': 5}\n"
        "metrics['beta'] = 2\nsums = {'gamma': 3}\nother = {'delta': 4}\nx = f'ns/{y}/z'\n"
    )
    assert _metric_dict_keys(tree) == {"alpha", "beta", "gamma", "epsilon"}
    assert _registered("rewards/<x>/mean") and not _registered("no/such/<x>")


def _loss_metric_names() -> set[str]:
    """The names compute_loss emits with every loss type, a reference model and the off-policy mask."""
    torch.manual_seed(0)
    shape = (2, 5)
    names: set[str] = set()
    for loss_type in LOSS_TYPES:
        logprobs = (-torch.rand(shape)).requires_grad_()
        inputs = LossInputs(
            logprobs=logprobs,
            old_logprobs=-torch.rand(shape),
            advantages=torch.tensor([1.0, -1.0]),
            mask=torch.ones(shape),
            ref_logprobs=-torch.rand(shape),
            behaviour_logprobs=-torch.rand(shape),
            entropies=torch.rand(shape),
        )
        config = Objective(loss_type=loss_type, beta=0.1, off_policy_mask_threshold=0.5)
        names |= set(compute_loss(inputs, config, BatchNormalisers.of_batch(inputs.mask)).metrics)
    return names


def _batch_and_eval_names() -> set[str]:
    """The names of a step's batch figures and of an evaluation, single-turn and multi-turn."""
    single = [make_scored(make_rollout(seed=seed)) for seed in range(2)]
    multi = [make_scored(make_trajectory_rollout())]
    names: set[str] = set()
    for groups in (single, multi):
        names |= set(batch_metrics(groups, policy_version=5)) | set(eval_metrics(groups, wanted=3, seconds=1.0))
    assert {"tools/call_frequency", "eval/tools/call_frequency", "eval/rewards/f0/mean"} <= names  # both kinds ran
    return names


@functools.cache
def called_metric_names() -> frozenset[str]:
    """The names the metric functions return when called: rewards, lengths, sampling, the loss of every loss
    type, the counters, a step's batch figures and an evaluation's."""
    rewards = np.array([1.0, 0.0, 1.0, 1.0])
    weights, mask = torch.tensor([[0.9, 1.1]]), torch.ones(1, 2)
    return frozenset(
        {
            *reward_metrics(rewards, 2),
            *reward_function_metrics(["accuracy", "format/strict"], np.ones((4, 2))),
            *completion_metrics([3, 4], [False, True]),
            *terminated_length_metrics([3, 4], [True, False]),
            *sampling_logp_difference_metrics(torch.zeros(1, 2), torch.ones(1, 2), mask),
            *clip_ratio_extremes([{"clip_ratio/low_mean": 0.1, "clip_ratio/high_mean": 0.2}]),
            *importance_weight_metrics(weights, mask),
            *Counters().figures(),
            *_loss_metric_names(),
            *_batch_and_eval_names(),
        }
    )


def test_the_figures_the_code_returns_are_registered():
    unknown = sorted(name for name in called_metric_names() if lookup(name) is None and name not in _NOT_METRICS)
    assert not unknown, f"emitted but not in shared/metric_names.py: {unknown}"


def test_lookup_matches_placeholders_and_prefers_an_exact_entry():
    assert lookup("rewards/accuracy/mean").name == "rewards/<function>/mean"
    assert lookup("rewards/format/strict/std").name == "rewards/<function>/std"  # a function name with "/"
    assert lookup("env/calls/fault").name == "env/calls/<outcome>"
    assert lookup("env/calls/a/b") is None  # other placeholders are one segment
    assert lookup("reward").name == "reward"
    assert lookup("no_such_metric") is None


def test_the_prometheus_column_is_the_scraped_name():
    counter = Metric("rewards/<function>/calls", "m", "scorer", COUNTER)
    assert ref.prometheus_text(counter) == 'asyncgrpo_rewards_calls_total{function="…"}'
    assert ref.prometheus_text(Metric("env/calls/<outcome>", "m", "generator", COUNTER)) == (
        "asyncgrpo_env_calls_<outcome>_total"
    )
    assert ref.prometheus_text(Metric("scorer/groups_held", "m", "scorer", GAUGE)) == "asyncgrpo_scorer_groups_held"


# --- the command-line reader ------------------------------------------------------------------------------------


def test_captured_parser_takes_the_parser_without_running_the_command():
    ran = []

    def command() -> None:
        parser = argparse.ArgumentParser(prog="x")
        parser.add_argument("--n", type=int, default=3, help="how many")
        parser.parse_args(["--n", "1"])
        ran.append(True)

    parser = ref.captured_parser(command)
    assert parser.prog == "x" and not ran
    assert "| `--n` | `3` | how many |" in ref.options_table(parser)
    with pytest.raises(RuntimeError, match="without building"):
        ref.captured_parser(lambda: None)


# --- benchmark results ------------------------------------------------------------------------------------------


def _args(**options) -> argparse.Namespace:
    return argparse.Namespace(**{"quick": False, "record": True, "repeats": 3, **options})


def test_record_appends_one_line_with_its_provenance(tmp_path):
    path = tmp_path / "results.jsonl"
    bench_record.record("transport", {"ours_groups_s": 900.0}, _args(groups=1000), ratio=0.9, goal=">= 0.50", path=path)
    bench_record.record(
        "transport", {"ours_groups_s": 950.0}, _args(groups=1000), ratio=0.95, goal=">= 0.50", path=path
    )
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 2
    first = lines[0]
    assert first["configuration"] == {"groups": 1000}  # --record, --quick and --repeats are not the configuration
    assert first["figures"] == {"ours_groups_s": 900.0} and first["ratio"] == 0.9 and first["goal"] == ">= 0.50"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", first["date"])
    assert re.fullmatch(r"[0-9a-f]{4,}(\+dirty)?|unknown", first["commit"])
    assert first["machine"]["cores"] >= 1 and first["machine"]["cpu"]
    assert ref.read_results(path) == lines


def test_rows_already_in_the_results_file_do_not_make_the_next_record_dirty(tmp_path):
    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)  # fmt: skip

    results = tmp_path / bench_record.RESULTS.relative_to(bench_record.ROOT)
    results.parent.mkdir()
    results.write_text("")
    (tmp_path / "bench.py").write_text("print(1)\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "start")
    head = bench_record.commit(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{4,}", head)
    results.write_text('{"bench": "weight_push"}\n')  # the first of a bench's two rows, not committed yet
    assert bench_record.commit(tmp_path) == head
    (tmp_path / "bench.py").write_text("print(2)\n")  # what runs changed: dirty
    assert bench_record.commit(tmp_path) == f"{head}+dirty"


@pytest.mark.parametrize(
    ("args", "figures", "ratio", "why"),
    [
        (_args(quick=True), {"a": 1.0}, 1.0, "--quick"),
        (_args(), {"a": math.nan}, 1.0, "finite"),
        (_args(), {"a": 1.0}, math.inf, "finite"),
    ],
)
def test_record_refuses_a_smoke_test_or_a_figure_that_is_not_a_number(tmp_path, args, figures, ratio, why):
    path = tmp_path / "results.jsonl"
    with pytest.raises(bench_record.RecordError, match=why):
        bench_record.record("learner", figures, args, ratio=ratio, goal=">= 0.90", path=path)
    assert not path.exists()


def test_a_quick_record_run_stops_before_it_starts():
    with pytest.raises(SystemExit, match="drop --quick"):
        bench_record.refuse_quick(_args(quick=True))
    bench_record.refuse_quick(_args())  # a real run goes on


def _result(bench: str, config: dict, ratio: float, date: str) -> dict:
    return {
        "bench": bench, "configuration": config, "figures": {"x": 1.0}, "ratio": ratio, "goal": ">= 0.9",
        "machine": {"cpu": "CPU", "cores": 2, "gpu": None}, "date": date, "commit": "abc1234", "command": "c",
    }  # fmt: skip


def test_the_page_shows_the_latest_result_of_each_configuration(tmp_path):
    path = tmp_path / "results.jsonl"
    results = [
        _result("transport", {"groups": 10}, 0.5, "2026-01-01T00:00:00Z"),
        _result("transport", {"groups": 20}, 0.7, "2026-01-02T00:00:00Z"),
        _result("transport", {"groups": 10}, 0.6, "2026-01-03T00:00:00Z"),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in results))
    rows = [line for line in ref.benchmarks_page(path).splitlines() if line.startswith("| transport")]
    assert rows == [
        "| transport | groups=10 | x 1 | 0.60 (>= 0.9) | CPU, 2 cores | 2026-01-03 | `abc1234` |",
        "| transport | groups=20 | x 1 | 0.70 (>= 0.9) | CPU, 2 cores | 2026-01-02 | `abc1234` |",
    ]


def test_a_machine_is_named_with_its_vector_unit_and_keeps_its_own_row(tmp_path):
    assert bench_record.vector_unit("flags\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n") == "AMX"
    assert bench_record.vector_unit("flags\t: fpu avx2 avx512f avx512_bf16\n") == "AVX-512 BF16"
    assert bench_record.vector_unit("flags\t: fpu sse2 avx2 fma\nflags\t: avx512f\n") == "AVX2"  # the first line
    assert bench_record.vector_unit("model name\t: Neoverse\n") is None
    path = tmp_path / "results.jsonl"
    wide = {
        **_result("learner", {}, 2.4, "2026-01-01T00:00:00Z"),
        "machine": {"cpu": "EPYC", "cores": 2, "vector": "AVX-512 BF16"},
    }
    narrow = {
        **_result("learner", {}, 3.0, "2026-01-02T00:00:00Z"),
        "machine": {"cpu": "EPYC", "cores": 2, "vector": "AVX2"},
    }
    path.write_text("".join(json.dumps(r) + "\n" for r in (wide, narrow)))
    rows = [line for line in ref.benchmarks_page(path).splitlines() if line.startswith("| learner")]
    assert [row.split(" | ")[4] for row in rows] == ["EPYC (AVX-512 BF16), 2 cores", "EPYC (AVX2), 2 cores"]


def test_an_empty_history_says_which_command_fills_it(tmp_path):
    page = ref.benchmarks_page(tmp_path / "results.jsonl")
    assert "No result is recorded yet" in page and "--record" in page


def test_a_bad_results_line_is_named(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(_result("a", {}, 1.0, "2026-01-01T00:00:00Z")) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"results.jsonl:2 is not JSON"):
        ref.read_results(path)
    path.write_text('{"bench": "a"}\n')
    with pytest.raises(ValueError, match=r":1 lacks \['commit'"):
        ref.read_results(path)


def test_every_bench_takes_record():
    """Each bench that prints a result has ``--record`` (trl_side.py, trl_async_side.py and held_out.py are
    vs_trl.py's children; record.py, profiling.py and interference.py are helpers: async_vs_sync.py records what
    interference.py measures)."""
    helpers = ("record.py", "profiling.py", "interference.py", "trl_side.py", "trl_async_side.py", "held_out.py")
    helpers += ("__init__.py",)
    for path in sorted((ROOT / "bench").glob("*.py")):
        if path.name in helpers:
            continue
        source = path.read_text()
        assert "add_record_flag(" in source and "record(" in source, f"{path.name} has no --record"
    assert inspect.signature(bench_record.record).parameters.keys() >= {"bench", "figures", "args", "ratio", "goal"}
    assert Path(bench_record.RESULTS) == ROOT / "bench" / "results.jsonl"


def test_computed_defaults_are_declared_on_their_fields(monkeypatch):
    """A default computed from the machine is shown as its field declares, never as this machine's value."""
    computed = [
        f"{cls.__name__}.{name}"
        for cls, _, _ in TABLES
        for name, field in cls.model_fields.items()
        if default_text(field) == "hostname-based"
    ]
    assert computed == [
        "GeneratorSettings.generator_id",
        "GeneratorSettings.gpu_host_key",
        "ScorerSettings.scorer_id",
        "LearnerSettings.weight_sync_host",
    ]
    here = settings_tables()
    monkeypatch.setattr(socket, "gethostname", lambda: "another-machine")
    assert settings_tables() == here
