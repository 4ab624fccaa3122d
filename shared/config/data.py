"""Where the learner's prompts come from: ``[data]`` in the TOML file, ``LEARNER_DATA__*`` in the environment.

A table of its own beside ``[learner]`` (the learner's settings hold it as ``data``); the learner's feeder reads
it, and the checks here are the ones a row's columns must pass to reach the reward functions. Its splits are
datasets' split strings (``train[:90%]``), read here by :func:`parse_split` so that a file with a bad one is
refused when it is loaded; the rows they select are :mod:`shared.dataset.sources`'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.columns import RESERVED_COLUMNS
from shared.records import ChatMessage


class DataSettings(BaseModel):
    """Where prompts come from (``[data]``); README, "Data", has the rules in full.

    TRL's rule: a prompt that is a list of chat messages is chat-templated and its completions reach the reward
    functions as message lists; a prompt that is a string is used as plain text and its completions are strings.
    ``system_prompt``, ``examples`` and ``assistant_prefill`` make a string prompt a conversation. Every column
    but the prompt reaches the reward functions under its own name, renamed only by ``rename_columns``.
    """

    model_config = ConfigDict(extra="forbid")

    source: str | list[str] = Field(
        "builtin:arithmetic",
        description="A JSONL/JSON/Parquet/CSV file, a directory of them or written by datasets' save_to_disk, a "
        "list of files, a datasets name in the local Hugging Face cache, or a built-in task: builtin:arithmetic, "
        "sums, products, compare, count_items, count_letters or calculator.",
    )
    train_split: str = Field(
        "train",
        validation_alias=AliasChoices("train_split", "split"),
        description="Split to train on (also read as split, its former name): a name, or a datasets-style slice "
        "of it, e.g. 'train[:90%]', 'train[:1000]', 'train[10%:20%]', 'train+test'. A directory's files are "
        "those whose name holds the split's name ('train' also: all of them when none does); a file, a list of "
        "files and a built-in task are one split, 'train'; another name is refused at start.",
    )
    eval_split: str | None = Field(
        None,
        description="Split of the same source to evaluate on, written like train_split (e.g. 'test', or "
        "'train[90%:]' beside train_split = 'train[:90%]'); no row of it may be a training row (checked at "
        "start). None: no split (learner.eval_data or eval_fraction may give evaluation rows instead).",
    )
    eval_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Share of train_split's rows held out for evaluation and never trained on: the last ones in "
        "the source's order (round(share x rows), at least one). None: nothing held out.",
    )
    dataset_config: str | None = Field(
        None, description="Configuration (subset) of a datasets name, e.g. 'main' for openai/gsm8k (TRL's)."
    )
    prompt_column: str | None = Field(
        None, description="Column holding the prompt (None: 'prompt', TRL's name, if present, else 'question')."
    )
    answer_column: str | None = Field(
        None,
        description="Shorthand for rename_columns = {<this> = 'answer'} (the built-in correctness reads 'answer').",
    )
    rename_columns: dict[str, str] = Field(
        default_factory=dict,
        description="Columns handed to reward functions under another name, {dataset name = new name}; a dotted "
        "name reaches into a nested column ('reward_model.ground_truth').",
    )
    extra_columns: list[str] = Field(
        default_factory=list,
        description="Columns that must be present (checked at start); every column reaches the reward functions.",
    )
    system_prompt: str = Field(
        "",
        description="System message put first in every prompt ('' for none; a row's own system message wins); a "
        "string prompt becomes a conversation.",
    )
    examples: list[ChatMessage] = Field(
        default_factory=list,
        description="Few-shot turns put after the system prompt; a string prompt becomes a conversation.",
    )
    assistant_prefill: str = Field(
        "", description="Start of the assistant's answer (e.g. '<think>'); a string prompt becomes a conversation."
    )
    shuffle_seed: int = Field(0, description="Seed of the per-epoch shuffle.")
    epochs: int = Field(1, ge=0, description="Passes over the data (0: no limit).")
    builtin_size: int = Field(2000, ge=1, description="A built-in task's number of problems.")
    builtin_max_operand: int = Field(
        50, ge=1, description="A built-in task's largest number (operand, list length or word length)."
    )

    @model_validator(mode="before")
    @classmethod
    def _one_split_name(cls, values: Any) -> Any:
        if isinstance(values, dict) and "split" in values and "train_split" in values:
            raise ValueError("data.split is the former name of data.train_split, and both are set; keep train_split")
        return values

    @field_validator("train_split", "eval_split")
    @classmethod
    def _split_syntax(cls, value: str | None) -> str | None:
        if value is not None:
            parse_split(value)
        return value

    @property
    def renames(self) -> dict[str, str]:
        """``rename_columns`` with ``answer_column`` folded in."""
        if self.answer_column is None:
            return dict(self.rename_columns)
        return {**self.rename_columns, self.answer_column: "answer"}

    @property
    def makes_conversations(self) -> bool:
        """Whether a string prompt becomes a conversation (a system prompt, examples or a prefill is set)."""
        return bool(self.system_prompt or self.examples or self.assistant_prefill)

    @model_validator(mode="after")
    def _check_columns(self) -> DataSettings:
        if isinstance(self.source, list) and not self.source:
            raise ValueError("data.source is an empty list; name at least one file")
        targets = list(self.renames.values())
        reserved = sorted(set(targets) & set(RESERVED_COLUMNS))
        if reserved:
            raise ValueError(
                f"data.rename_columns: {', '.join(reserved)} is an argument of every reward function; pick another name"
            )
        repeated = sorted({name for name in targets if targets.count(name) > 1})
        if repeated:
            raise ValueError(f"data.rename_columns gives several columns the name {', '.join(repeated)}")
        if self.answer_column is not None and self.answer_column in self.rename_columns:
            raise ValueError(f"data.answer_column {self.answer_column!r} is also renamed in rename_columns; keep one")
        return self

    @model_validator(mode="after")
    def _one_evaluation_split(self) -> DataSettings:
        if self.eval_split is not None and self.eval_fraction is not None:
            raise ValueError(
                f"data.eval_split ({self.eval_split!r}) and data.eval_fraction ({self.eval_fraction}) both choose "
                "the evaluation rows; keep one"
            )
        return self


# datasets' split strings (``datasets.ReadInstruction.from_spec``): ``name``, ``name[start:stop]`` with bounds
# that are row counts or percentages (negative: from the end), a percent rounding, parts joined with ``+``.
_SPLIT_PART = re.compile(
    r"(?P<name>\w+(?:\.\w+)*)"
    r"(?:\[(?:(?P<start>-?\d+)(?P<start_pct>%)?)?:(?:(?P<stop>-?\d+)(?P<stop_pct>%)?)?\])?"
    r"(?:\((?P<rounding>[^)]*)\))?"
)
_SPLIT_HELP = "write a split name or a slice of one, e.g. 'train', 'train[:90%]', 'train[90%:]', 'train[:1000]'"
Rounding = Literal["closest", "pct1_dropremainder"]


@dataclass(frozen=True)
class SplitPart:
    """One part of a split string: a split's name and the slice of its rows to read (None: from the start or
    to the end). Percent bounds are rounded as datasets rounds them."""

    name: str
    start: int | None = None
    stop: int | None = None
    percent: bool = False
    rounding: Rounding = "closest"

    def bounds(self, size: int) -> tuple[int, int]:
        """The ``[start, stop)`` rows of this part in a split of ``size`` rows (datasets' arithmetic)."""
        start = 0 if self.start is None else self._rows(self.start, size)
        stop = size if self.stop is None else self._rows(self.stop, size)
        if start < 0:
            start = max(size + start, 0)
        if stop < 0:
            stop = max(size + stop, 0)
        return min(start, size), min(stop, size)

    def _rows(self, bound: int, size: int) -> int:
        if not self.percent:
            return bound
        if self.rounding == "closest":
            return round(bound * size / 100)
        if size < 100:
            raise ValueError(
                f"split {self.name!r} has {size} rows, and pct1_dropremainder rounding needs at least 100 (fewer "
                "always select nothing); drop '(pct1_dropremainder)'"
            )
        return bound * (size // 100)


def parse_split(spec: str) -> tuple[SplitPart, ...]:
    """``spec`` (``'train[:90%]'``, ``'train+test[:100]'``) as its parts; ValueError saying what is wrong."""
    return tuple(_split_part(part, spec) for part in re.split(r"\s*\+\s*", spec.strip()))


def _split_part(text: str, spec: str) -> SplitPart:
    match = _SPLIT_PART.fullmatch(text)
    if match is None:
        raise ValueError(f"split {spec!r}: cannot read {text!r}; {_SPLIT_HELP}")
    start_pct, stop_pct = bool(match["start_pct"]), bool(match["stop_pct"])
    start, stop = (None if match[k] is None else int(match[k]) for k in ("start", "stop"))
    if (start_pct and stop is not None and not stop_pct) or (stop_pct and start is not None and not start_pct):
        raise ValueError(f"split {spec!r}: {text!r} mixes a row count and a percentage; use one unit for both")
    percent = start_pct or stop_pct
    if percent and any(b is not None and abs(b) > 100 for b in (start, stop)):
        raise ValueError(f"split {spec!r}: {text!r} has a percentage beyond 100%; write -100% to 100%")
    written = match["rounding"]
    if written is not None and written not in ("closest", "pct1_dropremainder"):
        raise ValueError(f"split {spec!r}: rounding {written!r} is unknown; write (closest) or (pct1_dropremainder)")
    if written is not None and not percent:
        raise ValueError(f"split {spec!r}: a rounding applies to percent slices only ('train[:10%](closest)')")
    rounding: Rounding = "pct1_dropremainder" if written == "pct1_dropremainder" else "closest"
    return SplitPart(match["name"], start, stop, percent, rounding)


def unsliced(spec: str) -> str:
    """The split names of ``spec`` without their slices (``'train[:90%]+test'`` -> ``'train+test'``)."""
    return "+".join(part.name for part in parse_split(spec))
