"""Classification files: read (label, text) rows from CSV or JSONL with any column layout, and split them.

The ``[data]`` keys of a ``task = "classify"`` run (all optional except ``path``):

  path          training file, ``.csv``, ``.jsonl`` (UTF-8), or ``.json`` / ``.parquet`` (read through ``datasets``)
  test_path     a fixed test file in the same layout; evaluated once at the end and reported as *test*
  text_columns  the text column(s): names, or 0-based indexes with ``no_header``; a comma-separated string
                ("title,description") or a TOML list. Several columns are joined with one space, in the given
                order. Default ``text_field`` when set (the LM corpora's key), else "text".
  label_column  the label column: a name, or a 0-based index with ``no_header``. Default "label".
  no_header     the CSV has no header row (the public AG News files have none): every row is data, and columns
                are named by index, e.g. ``--data.no_header --data.label_column 0 --data.text_columns 1,2``
  val_fraction  share of the training file held out for validation (default 0.1; 0 = none)
  split_seed    seed of the validation split (default 0), independent of ``train.seed``: changing the
                training seed never moves rows between train and validation
  tokenizer, vocab_size   as for language models; the tokenizer is fit on the training rows only

Labels may be any strings or integers (a JSON number becomes its decimal string); the label set is sorted,
numerically when every label is an integer. The validation split is stratified: class c with n_c rows gives
floor or ceil of n_c · val_fraction rows (largest remainders first, so the total is round(n · val_fraction)),
never all of a class's rows, so each class keeps its share within one row.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from diffattn.data.records import RecordError, iter_rows
from diffattn.data.text import DataError, check_text_input
from diffattn.system.untrusted import Refused

DEFAULTS: dict[str, Any] = {"text_columns": "text", "label_column": "label", "no_header": False, "split_seed": 0}


class ClassifyDataError(Refused):
    """The classification data file is missing or malformed; the message names the file and line."""


# ------------------------------------------------------------------------------------------------ columns
def column_list(spec: Any, what: str) -> list[str | int]:
    """``"title,description"`` / ``"1,2"`` / ``["title", 2]`` / ``0`` -> a list of names or indexes (the
    strings that are all digits become ints: whether they are names or indexes is decided by the file)."""
    items = spec if isinstance(spec, (list, tuple)) else [spec] if isinstance(spec, int) else str(spec).split(",")
    out: list[str | int] = []
    for x in items:
        if isinstance(x, bool) or not isinstance(x, (str, int)):
            raise ClassifyDataError(f"data.{what}: expected column names or indexes, got {spec!r}")
        x = x.strip() if isinstance(x, str) else x
        if x == "":
            raise ClassifyDataError(f"data.{what}: empty column name in {spec!r}")
        out.append(int(x) if isinstance(x, str) and x.isdigit() else x)
    if not out:
        raise ClassifyDataError(f"data.{what}: no column given")
    return out


def _header_index(path: Path, header: list[str], col: str | int, what: str) -> int:
    names = [h.strip() for h in header]
    name = str(col)
    if name in names:
        return names.index(name)
    low = [h.lower() for h in names]
    if name.lower() in low:
        return low.index(name.lower())
    hint = " (columns are named by index only with --data.no_header)" if isinstance(col, int) else ""
    raise ClassifyDataError(f"{path}: no column {name!r} for data.{what} in the header row {header!r}{hint};"
                            " set --data.label_column / --data.text_columns, or --data.no_header if the file"
                            " has no header row")


# ------------------------------------------------------------------------------------------------ reading
def _read_utf8(path: Path) -> str:
    if not path.exists():
        raise ClassifyDataError(f"data file {path} does not exist")
    if not path.is_file():
        raise ClassifyDataError(f"data path {path} is not a file")
    try:
        check_text_input([path], "a classification file")  # before it is read whole
    except DataError as e:
        raise ClassifyDataError(str(e)) from None
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ClassifyDataError(f"{path}: not valid UTF-8 (byte {e.start}, line {line}): {e.reason}") from None


def _read_csv(path: Path, text: str, text_cols: list[str | int], label_col: str | int,
              no_header: bool) -> list[tuple[str, str, int]]:
    reader = csv.reader(io.StringIO(text, newline=""))
    rows: list[tuple[str, str, int]] = []
    width = None
    try:
        if no_header:
            bad = [c for c in [label_col, *text_cols] if not isinstance(c, int)]
            if bad:
                raise ClassifyDataError(
                    f"{path}: with data.no_header, columns are 0-based indexes, got {bad}; e.g."
                    " --data.label_column 0 --data.text_columns 1,2")
            li, tis = label_col, list(text_cols)
        else:
            try:
                header = next(reader)
            except StopIteration:
                raise ClassifyDataError(f"{path}: empty file (a header row naming the columns is expected;"
                                        " use --data.no_header if there is none)") from None
            li = _header_index(path, header, label_col, "label_column")
            tis = [_header_index(path, header, c, "text_columns") for c in text_cols]
            width = len(header)
        need = max(li, *tis) + 1
        for row in reader:
            if not row or all(not c.strip() for c in row):
                continue  # blank line
            if width is not None and len(row) != width:
                raise ClassifyDataError(f"{path}: line {reader.line_num}: {len(row)} fields, the header has"
                                        f" {width}")
            if len(row) < need:
                raise ClassifyDataError(f"{path}: line {reader.line_num}: {len(row)} fields, column index"
                                        f" {need - 1} is needed")
            rows.append((row[li], " ".join(row[i] for i in tis), reader.line_num))
    except csv.Error as e:
        raise ClassifyDataError(f"{path}: line {reader.line_num}: {e}") from None
    return rows


def _read_jsonl(path: Path, text: str, text_cols: list[str | int], label_col: str | int
                ) -> list[tuple[str, str, int]]:
    keys = [str(c) for c in [label_col, *text_cols]]
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ClassifyDataError(f"{path}: line {n}: invalid JSON: {e.msg}") from None
        if not isinstance(obj, dict):
            want = ", ".join(f'"{k}": ...' for k in keys)
            raise ClassifyDataError(f"{path}: line {n}: expected an object {{{want}}}, got {type(obj).__name__}")
        missing = [k for k in keys if k not in obj]
        if missing:
            has = ", ".join(f'"{k}"' for k in obj) or "none"
            raise ClassifyDataError(f'{path}: line {n}: no "{missing[0]}" key (its keys: {has}); name the fields '
                                    "with --data.text_columns and --data.label_column")
        label = obj[str(label_col)]
        if isinstance(label, bool) or not isinstance(label, (str, int)):
            raise ClassifyDataError(f"{path}: line {n}: label must be a string or an integer, got {label!r}")
        parts = [obj[str(c)] for c in text_cols]
        for p in parts:
            if not isinstance(p, str):
                raise ClassifyDataError(f"{path}: line {n}: text must be a string, got {type(p).__name__}")
        rows.append((str(label), " ".join(parts), n))
    return rows


def _read_records(path: Path, text_cols: list[str | int], label_col: str | int) -> list[tuple[str, str, int]]:
    """Rows of a ``.parquet`` or ``.json`` file, read through ``datasets`` (see :mod:`diffattn.data.records`)."""
    if not path.is_file():
        raise ClassifyDataError(f"data file {path} does not exist")
    label_key, text_keys = str(label_col), [str(c) for c in text_cols]
    rows = []
    try:
        for _, n, row in iter_rows([path], [label_key, *text_keys]):
            label = row[label_key]
            if isinstance(label, bool) or not isinstance(label, (str, int)):
                raise ClassifyDataError(f"{path}: row {n}: label must be a string or an integer, got {label!r}")
            parts = [row[k] for k in text_keys]
            bad = [p for p in parts if not isinstance(p, str)]
            if bad:
                raise ClassifyDataError(f"{path}: row {n}: text must be a string, got {type(bad[0]).__name__}")
            rows.append((str(label), " ".join(parts), n))
    except RecordError as e:
        raise ClassifyDataError(str(e).replace("--data.text_field", "--data.text_columns / --data.label_column")
                                ) from None
    return rows


def read_examples(path: str | Path, *, text_columns: Any = "text", label_column: Any = "label",
                  no_header: bool = False) -> list[tuple[str, str]]:
    """(label, text) pairs from a ``.csv``, ``.jsonl``, ``.json`` or ``.parquet`` file (columns as in the module
    docstring). Raises ClassifyDataError naming the file (and line) for a missing file, non-UTF-8 bytes, an unknown
    column, malformed lines, empty labels or texts."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".jsonl", ".ndjson", ".json", ".parquet"):
        raise ClassifyDataError(f"{path}: unsupported data file type {suffix!r}; use .csv, .jsonl, .json or .parquet")
    text_cols = column_list(text_columns, "text_columns")
    label_col = column_list(label_column, "label_column")
    if len(label_col) != 1:
        raise ClassifyDataError(f"data.label_column: one column, got {label_column!r}")
    if no_header and suffix != ".csv":
        raise ClassifyDataError(f"{path}: data.no_header applies to CSV files; JSONL rows name their fields")
    if suffix in (".json", ".parquet"):
        rows = _read_records(path, text_cols, label_col[0])
    elif suffix == ".csv":
        rows = _read_csv(path, _read_utf8(path), text_cols, label_col[0], bool(no_header))
    else:
        rows = _read_jsonl(path, _read_utf8(path), text_cols, label_col[0])
    for label, txt, n in rows:
        if not label.strip():
            raise ClassifyDataError(f"{path}: line {n}: empty label")
        if not txt.strip():
            raise ClassifyDataError(f"{path}: line {n}: empty text")
    if not rows:
        raise ClassifyDataError(f"{path}: no examples")
    return [(label.strip(), txt) for label, txt, _ in rows]


def read_split_file(data: dict[str, Any], key: str) -> list[tuple[str, str]]:
    """The examples of ``data[key]`` ("path" or "test_path") with the column options of ``data``."""
    opts = {**DEFAULTS, **{k: v for k, v in data.items() if k in DEFAULTS and v is not None}}
    if data.get("text_columns") is None and data.get("text_field"):  # the LM corpora's name for the text column
        opts["text_columns"] = data["text_field"]
    return read_examples(data[key], text_columns=opts["text_columns"], label_column=opts["label_column"],
                         no_header=opts["no_header"])


# ------------------------------------------------------------------------------------------------ labels
def _is_int(s: str) -> bool:
    try:
        int(s)
    except ValueError:
        return False
    return True


def label_set(labels: list[str]) -> list[str]:
    """Sorted distinct labels (numeric order when all are integers). Fewer than two classes is an error."""
    distinct = set(labels)
    if len(distinct) < 2:
        raise ClassifyDataError(f"classification needs at least 2 classes, the data has {sorted(distinct)}")
    if all(_is_int(s) for s in distinct):
        return sorted(distinct, key=int)
    return sorted(distinct)


# ------------------------------------------------------------------------------------------------ split
def stratified_split(y: Sequence[int], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Row indexes (train, val), each sorted. Class c (n_c rows) gives floor(n_c·f) or that + 1 rows to
    validation, by largest remainder so that the total is round(n·f), and always leaves one row to train on;
    which rows is drawn from a generator seeded with ``seed`` only."""
    if not 0.0 <= val_fraction < 1.0:
        raise ClassifyDataError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    by_class: dict[int, list[int]] = {}
    for i, c in enumerate(y):
        by_class.setdefault(int(c), []).append(i)
    classes = sorted(by_class)
    quota = {c: len(by_class[c]) * val_fraction for c in classes}
    take = {c: math.floor(quota[c]) for c in classes}
    extra = round(len(y) * val_fraction) - sum(take.values())
    for c in sorted(classes, key=lambda c: (-(quota[c] - take[c]), c))[:max(0, extra)]:
        take[c] += 1
    g = torch.Generator().manual_seed(int(seed))
    train, val = [], []
    for c in classes:
        rows = by_class[c]
        k = min(take[c], len(rows) - 1)
        perm = torch.randperm(len(rows), generator=g).tolist()
        val += [rows[j] for j in perm[:k]]
        train += [rows[j] for j in perm[k:]]
    if not train:
        raise ClassifyDataError(f"{len(y)} example(s) leave nothing to train on")
    return sorted(train), sorted(val)
