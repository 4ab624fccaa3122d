"""What ``config from-trl`` and ``config from-verl`` share: the result, the refusal, reading and writing files.

A translation is our TOML tables, the peer's options with no counterpart here that could change what is
learned (the command refuses them unless ``--allow-unmapped``, then lists them at the top of the output), the
options that change nothing learned and are left out ("no effect here": logging, the Hub, dataloader workers;
listed, never refused), the values whose behaviour differs from the peer's (each with both values: they head
the output and the command's summary line), warnings (a run with no data source of its own) and notes on
what changed meaning. A translation that our settings would refuse is refused with their reasons, so what
the command writes always passes ``config explain`` once the model is filled in.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel

from shared.config.generator import GeneratorSettings
from shared.config.learner import TRACKER_PACKAGES, LearnerSettings, ReportTo
from shared.config.pipeline import PipelineConfig, PipelineError

# Fills the model for the check of a translation that names none (the user gives it before running).
_PLACEHOLDER_MODEL = "/path/to/model"
# data.source's default: what a translated run trains on when the peer's file names no dataset.
BUILTIN_SOURCE = "builtin:arithmetic"


class UnmappedError(ValueError):
    """Options with no counterpart here; the command fails naming them unless --allow-unmapped."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(
            "no counterpart here for: " + ", ".join(names) + " (these may change the algorithm or the data, so "
            "leaving them out could change what is learned; remove them, or pass --allow-unmapped to translate "
            "the rest and list these at the top of the output. Options that change nothing learned, such as "
            "logging, the Hub or dataloader workers, need no flag: they are listed as 'no effect here')"
        )
        self.names = names


class InvalidTranslationError(ValueError):
    """The translated tables are not a valid configuration here; ``problems`` says what to change."""

    def __init__(self, peer: str, problems: list[str]) -> None:
        super().__init__(
            f"the {peer} configuration translates to settings this pipeline refuses:\n  - " + "\n  - ".join(problems)
        )
        self.problems = problems


@dataclass(frozen=True)
class Difference:
    """One setting whose behaviour here differs from the peer's: both values and why (or what to do)."""

    name: str
    peer: str
    theirs: str
    ours: str
    why: str

    def line(self) -> str:
        return f"{self.name}: {self.peer} {self.theirs}; here {self.ours} ({self.why})"

    def short(self) -> str:
        """Both values without their explanations, for the command's summary line; with them where the values
        alone read alike (512 and 512 that behave differently)."""
        theirs, ours = _head(self.theirs), _head(self.ours)
        if theirs == ours:
            theirs, ours = self.theirs, self.ours
        return f"{self.name} ({self.peer} {theirs}, here {ours})"


def _head(shown: str) -> str:
    return shown.split(" (", 1)[0]


@dataclass(frozen=True)
class Translation:
    """Our TOML tables, the peer's options with no counterpart, what behaves differently, and notes."""

    tables: dict[str, Any]
    unmapped: list[str]
    notes: list[str]
    differences: list[Difference] = field(default_factory=list)
    no_effect: dict[str, str] = field(default_factory=dict)  # option -> why leaving it out changes nothing learned
    warnings: list[str] = field(default_factory=list)  # what the user must see before running it


@dataclass
class Draft:
    """A translation being built: our tables, the notes and the differences from ``peer`` found so far."""

    peer: str
    generator: dict[str, Any] = field(default_factory=dict)
    scorer: dict[str, Any] = field(default_factory=dict)
    learner: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)
    given: set[str] = field(default_factory=set)  # the options the peer's file itself sets
    no_effect: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def ignore(self, name: str, why: str) -> None:
        """Leave out ``name``, which changes nothing learned here, saying why (listed, never refused)."""
        self.no_effect[name] = why

    def differ(self, name: str, theirs: Any, ours: Any, why: str) -> None:
        """Record that ``name`` behaves as ``theirs`` in the peer and as ``ours`` here."""
        self.differences.append(Difference(name, self.peer, _shown(theirs), _shown(ours), why))

    def steps_hint(self, epochs: Any) -> str:
        """How to give the step count of a run the peer sizes in epochs."""
        per_step, iterations = ours(self.learner, "groups_per_step"), ours(self.learner, "num_iterations")
        return (
            f"set max_steps = {epochs} x your dataset's prompts / groups_per_step ({per_step}) x num_iterations "
            f"({iterations})"
        )

    def finish(self, rest: Iterable[str], source_option: str) -> Translation:
        """The translation, with the options nothing consumed (``rest``) as unmapped; ``source_option``: the
        peer's name for its dataset, named in the warning when the file gives none."""
        _name_data_source(self, source_option)
        return translation(
            self.generator,
            self.scorer,
            self.learner,
            rest,
            self.notes,
            data=self.data,
            differences=self.differences,
            no_effect=self.no_effect,
            warnings=self.warnings,
        )


def _name_data_source(draft: Draft, source_option: str) -> None:
    """A translated config always names its data: without the peer's dataset, the built-in task, loudly."""
    if draft.data.get("source"):
        return
    draft.data["source"] = BUILTIN_SOURCE
    draft.warnings.append(
        f"the {draft.peer} file names no dataset ({source_option}), so this run would train on asyncgrpo's "
        f"built-in arithmetic task (data.source = {BUILTIN_SOURCE!r}, written out below): set data.source to your "
        "prompts (a datasets name, a JSONL/Parquet file or a directory; README, Data)"
    )


def _shown(value: Any) -> str:
    """Prose as it is; a value as Python writes it (a string setting is passed already quoted: ``repr(x)``)."""
    return value if isinstance(value, str) else repr(value)


def translation(
    generator: dict[str, Any],
    scorer: dict[str, Any],
    learner: dict[str, Any],
    rest: Iterable[str],
    notes: list[str],
    *,
    data: dict[str, Any] | None = None,
    differences: Iterable[Difference] = (),
    no_effect: dict[str, str] | None = None,
    warnings: Iterable[str] = (),
) -> Translation:
    """The non-empty tables (the generator loads the learner's initial model and holds prompt + completion),
    the options nothing consumed (``rest``), sorted, the differences, what was left out to no effect, the
    warnings and the notes."""
    if "model" in learner:
        generator["model"] = learner["model"]
    _fit_model_len(generator, learner)
    tables = {"generator": generator, "scorer": scorer, "learner": learner, "data": data or {}}
    return Translation(
        {k: v for k, v in tables.items() if v},
        sorted(rest),
        list(notes),
        list(differences),
        dict(sorted((no_effect or {}).items())),
        list(warnings),
    )


def ours(table: dict[str, Any], name: str, settings: type[BaseModel] = LearnerSettings) -> Any:
    """The value ``name`` takes here: the translated one, else our default."""
    if name in table:
        return table[name]
    return settings.model_fields[name].get_default(call_default_factory=True)


def _fit_model_len(generator: dict[str, Any], learner: dict[str, Any]) -> None:
    """The engine must hold the longest prompt and completion the learner asks for."""
    needed = ours(learner, "max_prompt_length") + ours(learner, "max_completion_length")
    if needed > ours(generator, "max_model_len", GeneratorSettings):
        generator["max_model_len"] = needed


def fit_micro_batch(learner: dict[str, Any], notes: list[str]) -> None:
    """A micro-batch the peer left unset: ours, or the largest divisor of the completions per step below it."""
    if "micro_batch_size" in learner:
        return
    completions = ours(learner, "groups_per_step") * ours(learner, "group_size")
    default = ours(learner, "micro_batch_size")
    fitting = max(d for d in range(1, min(default, completions) + 1) if completions % d == 0)
    if fitting != default:
        learner["micro_batch_size"] = fitting
        notes.append(f"micro_batch_size = {fitting}: the largest divisor of the {completions} completions per step")


def read_mapping(path: Path) -> dict[str, Any]:
    """A JSON or YAML file of settings, as a mapping."""
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a mapping of settings")
    return data


def check(result: Translation, peer: str) -> None:
    """Raise :class:`InvalidTranslationError` when ``config explain`` would refuse the translation (the model,
    which the user may still have to give, is filled in for the check)."""
    tables = {name: dict(table) for name, table in result.tables.items()}
    for name in ("generator", "learner"):
        tables.setdefault(name, {}).setdefault("model", _PLACEHOLDER_MODEL)
    import tomli_w

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "translated.toml"
        path.write_text(tomli_w.dumps(tables))
        try:
            PipelineConfig.load(path)
        except PipelineError as exc:
            raise InvalidTranslationError(peer, exc.problems) from None


def to_toml(result: Translation, source: Path, kind: str, defaults_from: str) -> str:
    """The tables as TOML, headed by where they came from, what was left out, what differs and the notes."""
    import tomli_w

    header = [
        f"# Translated from {kind} configuration {source} by `asyncgrpo config from-{kind.lower()}`.",
        f"# Options the file leaves out: {defaults_from}.",
    ]
    header.extend(f"# WARNING: {warning}" for warning in result.warnings)
    if result.unmapped:
        header.append("# Options with no counterpart here (not translated, --allow-unmapped):")
        header.extend(f"#   {name}" for name in result.unmapped)
    if result.no_effect:
        header.append("# Options with no effect here (they change nothing learned; not translated):")
        header.extend(f"#   {name}: {why}" for name, why in result.no_effect.items())
    if result.differences:
        header.append(f"# Behaviour that differs from {kind}'s ({kind}'s value; ours):")
        header.extend(f"#   {difference.line()}" for difference in result.differences)
    header.extend(f"# Note: {note}" for note in result.notes)
    return "\n".join(header) + "\n\n" + tomli_w.dumps(result.tables)


def summary(result: Translation, kind: str, written: Path | None) -> str:
    """The command's closing line: where the TOML went, how many options were left out, what differs."""
    where = f"wrote {written}" if written else "translated"
    line = (
        f"{where}; {len(result.unmapped)} option(s) had no counterpart, {len(result.no_effect)} had no effect "
        "here (listed at its top)"
    )
    if not result.differences:
        line += f"; no value differs from {kind}'s"
    else:
        listed = "; ".join(difference.short() for difference in result.differences)
        line += f"; {len(result.differences)} value(s) differ from {kind}'s: {listed}"
    return "".join(f"WARNING: {warning}\n" for warning in result.warnings) + line


def staleness_difference(draft: Draft, theirs: int, theirs_means: str, fix: str) -> None:
    """List our ``max_staleness`` against the peer's ``theirs`` when they differ (``theirs_means``: what the
    peer's value does; ``fix``: how to match it)."""
    here = draft.learner.setdefault("max_staleness", ours(draft.learner, "max_staleness"))
    if here != theirs:
        draft.differ(
            "max_staleness",
            f"{theirs} ({theirs_means})",
            f"{here} (generation runs ahead of training; groups up to {here} policy versions old are trained on)",
            fix,
        )


def warmup_from_share(draft: Draft, share: float, steps_known: bool, refusal: str) -> None:
    """A warm-up given as a share of the run -> ``warmup_steps``; ``refusal`` (what to set instead) when the
    run's length in steps is not known."""
    if not steps_known:
        raise ValueError(refusal)
    draft.learner["warmup_steps"] = math.ceil(share * draft.learner["max_steps"])


def trackers(names: Iterable[str], option: str, draft: Draft) -> None:
    """The peer's trackers (``option``: its setting's name) -> ``learner.report_to``; one that does not exist
    here is listed as having no effect (every metric is in metrics.jsonl anyway)."""
    known = get_args(ReportTo)
    chosen = list(dict.fromkeys(name for name in names if name in known))
    for name in names:
        if name not in known:
            draft.ignore(
                f"{option} {name!r}",
                f"no {name} tracker here (trackers: {', '.join(known)}); every metric is in metrics.jsonl",
            )
    draft.learner["report_to"] = chosen
    for name in chosen:
        if name in TRACKER_PACKAGES:
            draft.notes.append(f"{option} {name!r}: install {TRACKER_PACKAGES[name]} in the learner's environment")


def run_from_directory(directory: Any, option: str, draft: Draft) -> None:
    """A peer's output directory ``.../NAME`` -> ``run_name = "NAME"`` (the default ``asyncgrpo run --run-name``
    overrides) under ``runs_dir = "..."``: checkpoints and metrics follow the run's name, so a second experiment
    from the same file gets its own directory and one started again under its name resumes."""
    path = Path(str(directory))
    name = re.sub(r"[^A-Za-z0-9._-]", "-", path.name).lstrip("._-")
    if not name:
        draft.notes.append(f"{option} = {directory!r} names no run; runs are named by --run-name (or a timestamp)")
        return
    draft.learner["run_name"] = name
    if str(path.parent) not in ("", "."):
        draft.learner["runs_dir"] = str(path.parent)
    draft.notes.append(
        f"{option} = {directory!r} -> run_name = {name!r} in {draft.learner.get('runs_dir', 'runs')}/: "
        "asyncgrpo run --run-name NAME names another run; started again under one name, a run resumes"
    )
