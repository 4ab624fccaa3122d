"""Where the learner's prompts come from: ``[data]`` in the TOML file, ``LEARNER_DATA__*`` in the environment.

A table of its own beside ``[learner]`` (the learner's settings hold it as ``data``); the learner's feeder reads
it, and the checks here are the ones a row's columns must pass to reach the reward functions.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
    split: str = Field("train", description="Split to read when the source has several.")
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
