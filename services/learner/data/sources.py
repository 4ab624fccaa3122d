"""Reading the rows of ``[data] source``, whatever holds them, as a list of plain dicts.

=======================================  ===============================================================
``source``                               read with
=======================================  ===============================================================
``builtin:arithmetic``                   :mod:`services.learner.data.tasks` (conversational: the question is
                                         the user's turn)
a ``.jsonl``/``.json``/``.parquet``/     ``datasets.load_dataset("json" | "parquet" | "csv")``; a
``.csv`` file, a list of them, or a      directory's files are read whole, or only those whose name holds
directory of them                        ``split`` when some do; one kind per source
a directory written by ``save_to_disk``  ``datasets.load_from_disk`` (a ``DatasetDict``: its ``split``)
any other name (``openai/gsm8k``)        ``datasets.load_dataset(name, dataset_config, split=split)``: it
                                         must be in the local Hugging Face cache when the Hub is out of
                                         reach; the error says how to put it there
=======================================  ===============================================================

Which columns reach the reward functions, and how the prompt is built, is :mod:`services.learner.data.feeder`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.learner.data.tasks import BUILTIN_TASKS, held_out_rows
from shared.config.learner import DataSettings

FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# What datasets' save_to_disk writes beside the Arrow files: one split, or a DatasetDict of several.
SAVED_DATASET_MARKERS = (("dataset_info.json", "state.json"), ("dataset_dict.json",))


class DataError(ValueError):
    """The configured data cannot be read, or a row does not fit the rules (the message says how to fix it)."""


def read_source(data: DataSettings) -> list[dict[str, Any]]:
    """Every row of ``data.source``, as dicts of Python values."""
    sources = data.source if isinstance(data.source, list) else [data.source]
    if len(sources) == 1 and sources[0].startswith("builtin:"):
        return _builtin(sources[0].removeprefix("builtin:"), data)
    paths = [Path(source).expanduser() for source in sources]
    if len(paths) == 1 and _is_saved_dataset(paths[0]):
        return _read_saved(paths[0], data.split)
    if len(sources) == 1 and not paths[0].exists() and not _looks_like_a_path(sources[0]):
        return _read_named(sources[0], data)
    return _read_files(paths, data.split)


def _builtin(name: str, data: DataSettings) -> list[dict[str, Any]]:
    return _conversational(_builtin_task(name, data))


def _builtin_task(name: str, data: DataSettings) -> list[dict[str, str]]:
    """The training rows of built-in task ``name``, as ``question``/``answer`` text."""
    if name not in BUILTIN_TASKS:
        raise DataError(f"unknown built-in task {name!r}; available: {', '.join(BUILTIN_TASKS)}")
    return BUILTIN_TASKS[name](data.builtin_size, data.builtin_max_operand, data.shuffle_seed + 1234)


def _conversational(rows: list[dict[str, str]]) -> list[dict[str, Any]]:
    """A built-in task is conversational: its question is the user's turn, as it always was."""
    return [{**row, "question": [{"role": "user", "content": row["question"]}]} for row in rows]


def read_held_out(data: DataSettings, size: int) -> list[dict[str, Any]]:
    """``eval_data = "held_out"``: ``size`` new problems of the built-in training task, none of them a
    training row (where the task has that many other questions: see :func:`held_out_rows`)."""
    source = data.source
    if not (isinstance(source, str) and source.startswith("builtin:")):
        raise DataError(
            f"eval_data = 'held_out' draws new problems of a built-in task, and data.source is {source!r}; "
            "set eval_data to a file or dataset of held-out rows"
        )
    name = source.removeprefix("builtin:")
    training = _builtin_task(name, data)
    seed = data.shuffle_seed + 4321  # another stream of problems than the training rows' (seed + 1234)
    return _conversational(held_out_rows(name, size, data.builtin_max_operand, seed, exclude=training))


def _looks_like_a_path(source: str) -> bool:
    """A source that cannot be a dataset name (``owner/name``): it has a file suffix, starts like a path, or
    has more than one ``/``."""
    return Path(source).suffix.lower() in FILE_KINDS or source.startswith(("/", ".", "~")) or source.count("/") > 1


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any(all((path / name).is_file() for name in names) for names in SAVED_DATASET_MARKERS)


def _read_saved(path: Path, split: str) -> list[dict[str, Any]]:
    """A directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    from datasets import DatasetDict, load_from_disk

    dataset = load_from_disk(str(path))
    if isinstance(dataset, DatasetDict):
        if split not in dataset:
            raise DataError(f"{path} holds the splits {', '.join(dataset)}, not {split!r}; set data.split")
        dataset = dataset[split]
    return dataset.to_list()


def _files_of(paths: list[Path], split: str) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if not path.exists():
            raise DataError(f"data source {path} does not exist (the learner's working directory is {Path.cwd()})")
        if path.is_file():
            files.append(path)
            continue
        found = sorted(p for p in path.rglob("*") if p.suffix.lower() in FILE_KINDS)
        in_split = [f for f in found if split and split in f.name]
        files.extend(in_split or found)
    return files


def _read_files(paths: list[Path], split: str) -> list[dict[str, Any]]:
    files = _files_of(paths, split)
    if not files:
        raise DataError(f"{', '.join(map(str, paths))} holds no {'/'.join(FILE_KINDS)} files")
    unknown = [f for f in files if f.suffix.lower() not in FILE_KINDS]
    if unknown:
        raise DataError(f"cannot read {unknown[0]}: data files end in {', '.join(FILE_KINDS)}")
    kinds = {FILE_KINDS[f.suffix.lower()] for f in files}
    if len(kinds) > 1:
        raise DataError(f"the data source mixes {' and '.join(sorted(kinds))} files; point data.source at one kind")
    from datasets import load_dataset

    dataset = load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train")
    return dataset.to_list()


def _read_named(name: str, data: DataSettings) -> list[dict[str, Any]]:
    """A ``datasets`` name: from the Hub when it is reachable, else from the local cache."""
    import datasets

    try:
        dataset = datasets.load_dataset(name, data.dataset_config, split=data.split)
    except Exception as exc:  # datasets raises many types: unreachable Hub, missing config or split, ...
        raise DataError(
            f"data.source {name!r} is not a local file or directory, and datasets.load_dataset({name!r}"
            f"{', ' + repr(data.dataset_config) if data.dataset_config else ''}, split={data.split!r}) failed: "
            f"{type(exc).__name__}: {exc}. Without the Hub, a dataset name must be in the local Hugging Face cache "
            f"({datasets.config.HF_DATASETS_CACHE}): load it once where the Hub is reachable, then run with "
            "HF_DATASETS_OFFLINE=1 (and the same HF_HOME); or save it (to_parquet, to_json or save_to_disk) and "
            "set data.source to that path"
        ) from exc
    return dataset.to_list()
