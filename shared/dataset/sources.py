"""Reading the rows of ``[data] source``, whatever holds them, as a list of plain dicts.

=======================================  ===============================================================
``source``                               read with
=======================================  ===============================================================
``builtin:arithmetic``                   :mod:`shared.dataset.tasks` (conversational: the question is
                                         the user's turn); one split, ``train``
a ``.jsonl``/``.json``/``.parquet``/     ``datasets.load_dataset("json" | "parquet" | "csv")``; a
``.csv`` file, a list of them, or a      directory's files are read whole, or only those whose name holds
directory of them                        the split's name when some do; one kind per source
a directory written by ``save_to_disk``  ``datasets.load_from_disk`` (a ``DatasetDict``: the named split)
any other name (``openai/gsm8k``)        ``datasets.load_dataset(name, dataset_config, split=name)``: it
                                         must be in the local Hugging Face cache when the Hub is out of
                                         reach; the error says how to put it there
=======================================  ===============================================================

A relative file or folder is looked for beside the configuration file, then in the working directory
(:mod:`shared.config.locations`, the rule for every name a configuration gives); a name found in neither that
cannot be a dataset's is refused with the places looked at.

Splits are datasets' split strings (:func:`shared.config.data.parse_split`): ``train_split = "train[:90%]"``
reads split ``train`` as above and keeps its first 90% of rows, for every kind of source alike. Evaluation
rows come from ``eval_split`` or from the last ``eval_fraction`` of the training split; every row is keyed by
what its split name resolved to and its index there (:data:`RowKey`), and an evaluation row that is also a
training row is refused.

Which columns reach the reward functions, and how the prompt is built, is :mod:`services.learner.data.feeder`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shared.config.data import DataSettings, parse_split
from shared.config.locations import locate, looked_in, search_dirs
from shared.dataset.tasks import BUILTIN_TASKS, HELD_OUT_SEED_OFFSET, held_out_rows, training_rows

FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
ONE_SPLIT = "train"  # the name of the one split of a built-in task, a file, or files read whole
# What datasets' save_to_disk writes beside the Arrow files: one split, or a DatasetDict of several.
SAVED_DATASET_MARKERS = (("dataset_info.json", "state.json"), ("dataset_dict.json",))


class DataError(ValueError):
    """The configured data cannot be read, or a row does not fit the rules (the message says how to fix it)."""


RowKey = tuple[str, int]  # (the file, split or task a row was read from, the row's index there)
Keyed = list[tuple[RowKey, dict[str, Any]]]


def read_source(data: DataSettings, limit: int | None = None) -> list[dict[str, Any]]:
    """The training rows: ``data.train_split`` of ``data.source``, less the ``eval_fraction`` held out; only the
    first ``limit`` of them when given (the rest are never converted to dicts: the start-up check's few rows)."""
    selected, size = _select(data, data.train_split, "train_split", limit)
    held = 0 if data.eval_fraction is None else held_out_count(size, data.eval_fraction)
    return [row for _, row in selected[: size - held]]


def read_eval_source(data: DataSettings) -> list[dict[str, Any]]:
    """The evaluation rows of ``data.eval_split`` or ``data.eval_fraction``, in the source's order; DataError
    when neither is set, or when one of them is also a training row."""
    if data.eval_split is None and data.eval_fraction is None:
        raise DataError("no evaluation split: set data.eval_split or data.eval_fraction")
    training, held = _hold_out(_select(data, data.train_split, "train_split")[0], data.eval_fraction)
    evaluated = held if data.eval_split is None else _select(data, data.eval_split, "eval_split")[0]
    shared = overlap([key for key, _ in training], [key for key, _ in evaluated])
    if shared:
        chosen = f"eval_split = {data.eval_split!r}" if data.eval_split else f"eval_fraction = {data.eval_fraction}"
        raise DataError(
            f"data.{chosen} selects {shared} rows that data.train_split = {data.train_split!r} also selects; "
            "evaluation rows are never training rows: make the two disjoint (e.g. train_split = 'train[:90%]' "
            "and eval_split = 'train[90%:]'), or hold rows out with data.eval_fraction"
        )
    return [row for _, row in evaluated]


def held_out_count(size: int, fraction: float) -> int:
    """How many of ``size`` rows ``eval_fraction = fraction`` holds out: the nearest whole number, at least one,
    leaving at least one training row."""
    count = max(1, round(size * fraction))
    if count >= size:
        raise DataError(f"data.eval_fraction = {fraction} of {size} rows leaves no training row; lower it or add rows")
    return count


def overlap(training: list[RowKey], evaluated: list[RowKey]) -> int:
    """How many evaluation rows are also training rows."""
    trained = set(training)
    return sum(key in trained for key in evaluated)


def read_keyed(data: DataSettings, spec: str, field: str) -> Keyed:
    """The rows split string ``spec`` selects of ``data.source``, each with its :data:`RowKey`, to compare two
    selections with :func:`overlap` (``field``: the setting an error names, as ``data.<field>``)."""
    return _select(data, spec, field)[0]


def _hold_out(rows: Keyed, fraction: float | None) -> tuple[Keyed, Keyed]:
    """``rows`` split into the training rows and the last ``fraction`` held out (none without one)."""
    if fraction is None:
        return rows, []
    cut = len(rows) - held_out_count(len(rows), fraction)
    return rows[:cut], rows[cut:]


def _select(data: DataSettings, spec: str, field: str, limit: int | None = None) -> tuple[Keyed, int]:
    """The rows ``spec`` (a split string: names, slices, ``+``) selects, each with its :data:`RowKey` (only the
    first ``limit`` when given), and how many it selects in all."""
    problem = split_problem(data, spec, field)
    if problem:
        raise DataError(problem)
    read: dict[str, _Rows] = {}
    selected: Keyed = []
    size = 0
    for part in parse_split(spec):
        if part.name not in read:
            read[part.name] = _split_rows(data, part.name, field)
        rows = read[part.name]
        try:
            start, stop = part.bounds(len(rows))
        except ValueError as exc:
            raise DataError(f"data.{field}: {exc}") from None
        size += max(stop - start, 0)
        wanted = stop if limit is None else min(stop, start + max(limit - len(selected), 0))
        selected.extend(rows[start:wanted])
    if not size:
        sizes = ", ".join(f"{name}: {len(rows)}" for name, rows in read.items())
        raise DataError(f"data.{field} {spec!r} selects no row of {data.source} (rows per split: {sizes})")
    return selected, size


class _Rows:
    """The rows of one split, keyed as :data:`Keyed`, in parts (a ``datasets.Dataset`` or a list of dicts, each
    with the origin of its keys) converted to dicts only when sliced: a few rows of a large split cost little."""

    def __init__(self, parts: list[tuple[str, Any]]) -> None:
        self.parts = parts

    def __len__(self) -> int:
        return sum(len(rows) for _, rows in self.parts)

    def __getitem__(self, bounds: slice) -> Keyed:
        start, stop, _ = bounds.indices(len(self))
        keyed: Keyed = []
        offset = 0
        for origin, rows in self.parts:
            first, last = max(start - offset, 0), min(stop - offset, len(rows))
            if first < last:
                piece = rows[first:last] if isinstance(rows, list) else rows.select(range(first, last)).to_list()
                keyed.extend(((origin, first + i), row) for i, row in enumerate(piece))
            offset += len(rows)
        return keyed


def split_problems(data: DataSettings, fields: Sequence[str] = ("train_split", "eval_split")) -> list[str]:
    """Why ``data.train_split`` or ``data.eval_split`` (those of ``fields``) names a split that ``data.source``
    cannot have (see :func:`split_problem`), without reading a row: the start-up check runs it for the
    evaluation split, which it does not read (reading the training rows raises the same message)."""
    specs = [(field, getattr(data, field)) for field in fields]
    return [problem for field, spec in specs if spec and (problem := split_problem(data, spec, field))]


def split_problem(data: DataSettings, spec: str, field: str) -> str | None:
    """Why split string ``spec`` (``data.<field>``) names a split the source cannot have, or None; from names
    alone. A built-in task, a file or a list of files is read whole as one split, ``train`` (the name datasets
    gives it), so any other name would read the same rows again; a directory's split is the files whose names
    hold it. A saved dataset or a ``datasets`` name knows its own splits, and says so when it is read."""
    sources = data.source if isinstance(data.source, list) else [data.source]
    names = {part.name for part in parse_split(spec)} - {ONE_SPLIT}
    if not names:
        return None
    name = sorted(names)[0]
    fix = "slice it ('train[90%:]') or set data.eval_fraction"
    if len(sources) == 1 and sources[0].startswith("builtin:"):
        return (
            f"data.{field} {spec!r}: a built-in task has one split, 'train'; {fix}, or evaluate on new problems "
            "with learner.eval_data = 'held_out'"
        )
    dirs = search_dirs()
    paths = [locate(source, dirs) or Path(source).expanduser() for source in sources]
    if len(paths) == 1 and (_is_saved_dataset(paths[0]) or not (paths[0].exists() or _looks_like_a_path(sources[0]))):
        return None
    if all(path.is_dir() for path in paths):
        files = [f.name for path in paths for f in path.rglob("*") if f.suffix.lower() in FILE_KINDS]
        if all(any(n in f for f in files) for n in names):
            return None
        return (
            f"data.{field} {spec!r}: no file of {data.source} has {name!r} in its name, so it holds no split "
            f"{name!r} (its files without a split's name are the one split 'train'); name the files "
            f"'{name}-*.jsonl', {fix}"
        )
    return (
        f"data.{field} {spec!r}: {data.source} is read whole as one split, 'train' (a file has no split "
        f"{name!r}; another name would read the same rows); {fix}, or point data.source at a directory whose "
        f"file names hold the split's name ('{name}-*.jsonl')"
    )


def _split_rows(data: DataSettings, split: str, field: str) -> _Rows:
    """Every row of split ``split`` of ``data.source``, keyed by where it was read from: two split names that
    read the same file (any name of a single file, say) give its rows the same keys."""
    sources = data.source if isinstance(data.source, list) else [data.source]
    if len(sources) == 1 and sources[0].startswith("builtin:"):
        return _Rows([(sources[0], _builtin(sources[0].removeprefix("builtin:"), data))])
    dirs = search_dirs()
    found = [locate(source, dirs) for source in sources]
    if len(sources) == 1 and found[0] is None and not _looks_like_a_path(sources[0]):
        return _Rows([(split, _read_named(sources[0], data, split))])
    missing = [source for source, path in zip(sources, found, strict=True) if path is None]
    if missing:
        raise DataError(f"data source {missing[0]} does not exist (looked at {looked_in(missing[0], dirs)})")
    paths = [path for path in found if path is not None]
    if len(paths) == 1 and _is_saved_dataset(paths[0]):
        return _read_saved(paths[0], split, field)
    return _read_files(paths, _files_of(paths, split))


def _builtin(name: str, data: DataSettings) -> list[dict[str, Any]]:
    return _conversational(_builtin_task(name, data))


def _builtin_task(name: str, data: DataSettings) -> list[dict[str, str]]:
    """The training rows of built-in task ``name``, as ``question``/``answer`` text."""
    if name not in BUILTIN_TASKS:
        raise DataError(f"unknown built-in task {name!r}; available: {', '.join(BUILTIN_TASKS)}")
    return training_rows(name, data.builtin_size, data.builtin_max_operand, data.shuffle_seed)


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
    seed = data.shuffle_seed + HELD_OUT_SEED_OFFSET  # another stream of problems than the training rows'
    return _conversational(held_out_rows(name, size, data.builtin_max_operand, seed, exclude=training))


def _looks_like_a_path(source: str) -> bool:
    """A source that cannot be a dataset name (``owner/name``): it has a file suffix, starts like a path, or
    has more than one ``/``."""
    return Path(source).suffix.lower() in FILE_KINDS or source.startswith(("/", ".", "~")) or source.count("/") > 1


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any(all((path / name).is_file() for name in names) for names in SAVED_DATASET_MARKERS)


def _read_saved(path: Path, split: str, field: str) -> _Rows:
    """A directory written by ``Dataset.save_to_disk`` (one split, whatever its name) or
    ``DatasetDict.save_to_disk`` (the split named ``split``)."""
    from datasets import DatasetDict, load_from_disk

    dataset = load_from_disk(str(path))
    if not isinstance(dataset, DatasetDict):
        return _Rows([(str(path.resolve()), dataset)])  # resolved: one key however the path is written
    if split not in dataset:
        raise DataError(f"{path} holds the splits {', '.join(dataset)}, not {split!r}; set data.{field}")
    return _Rows([(split, dataset[split])])


def _files_of(paths: list[Path], split: str) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_file():
            files.append(path)
            continue
        found = sorted(p for p in path.rglob("*") if p.suffix.lower() in FILE_KINDS)
        in_split = [f for f in found if split and split in f.name]
        files.extend(in_split or found)
    return files


def _read_files(paths: list[Path], files: list[Path]) -> _Rows:
    """``files``, one after the other (each read as a split of its own, so that a row's key is its file's)."""
    if not files:
        raise DataError(f"{', '.join(map(str, paths))} holds no {'/'.join(FILE_KINDS)} files")
    unknown = [f for f in files if f.suffix.lower() not in FILE_KINDS]
    if unknown:
        raise DataError(f"cannot read {unknown[0]}: data files end in {', '.join(FILE_KINDS)}")
    kinds = {FILE_KINDS[f.suffix.lower()] for f in files}
    if len(kinds) > 1:
        raise DataError(f"the data source mixes {' and '.join(sorted(kinds))} files; point data.source at one kind")
    from datasets import load_dataset

    per_file = load_dataset(kinds.pop(), data_files={f"file{i}": str(f) for i, f in enumerate(files)})
    return _Rows([(str(f.resolve()), per_file[f"file{i}"]) for i, f in enumerate(files)])


def _read_named(name: str, data: DataSettings, split: str) -> Any:
    """Split ``split`` of a ``datasets`` name (whole: its slice is taken here, as for every source): from the
    Hub when it is reachable, else from the local cache."""
    import datasets

    try:
        dataset = datasets.load_dataset(name, data.dataset_config, split=split)
    except Exception as exc:  # datasets raises many types: unreachable Hub, missing config or split, ...
        raise DataError(
            f"data.source {name!r} is not a local file or directory, and datasets.load_dataset({name!r}"
            f"{', ' + repr(data.dataset_config) if data.dataset_config else ''}, split={split!r}) failed: "
            f"{type(exc).__name__}: {exc}. Without the Hub, a dataset name must be in the local Hugging Face cache "
            f"({datasets.config.HF_DATASETS_CACHE}): load it once where the Hub is reachable, then run with "
            "HF_DATASETS_OFFLINE=1 (and the same HF_HOME); or save it (to_parquet, to_json or save_to_disk) and "
            "set data.source to that path"
        ) from exc
    return dataset  # a datasets.Dataset
