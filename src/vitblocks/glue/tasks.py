"""GLUE tasks as their own TSV files lay them out: which files, which columns, which labels.

The files are those of the GLUE distribution (``glue_data/<Task>/``), read as plain tab-separated lines
(no quoting: GLUE's sentences hold unmatched quote characters, which a CSV reader would join across lines):

- CoLA ``train.tsv`` / ``dev.tsv``: no header; columns source, label (0/1), original judgement, sentence.
- RTE ``train.tsv`` / ``dev.tsv``: header ``index sentence1 sentence2 label``; label entailment / not_entailment.
- QNLI ``train.tsv`` / ``dev.tsv``: header ``index question sentence label``; label entailment / not_entailment.
- MNLI ``train.tsv``, ``dev_matched.tsv``, ``dev_mismatched.tsv``: a header of 12 (train) or 15 (dev) columns;
  the pair is ``sentence1`` / ``sentence2``, the label ``gold_label`` (entailment / neutral / contradiction).

Columns are found by their header names, so extra columns anywhere do no harm; a missing file, a missing column,
a short line or an unknown label is a ``GlueDataError`` naming the file, the line and what was expected.
"""
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

__all__ = ['GlueDataError', 'GlueTask', 'GlueSplit', 'TASKS', 'get_task', 'read_split', 'read_task', 'file_digest']


class GlueDataError(ValueError):
    """A missing or malformed GLUE file; the message names the file, the line and the expected layout."""


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task's layout. ``text_columns``: the one or two columns fed to the tokenizer (header names, or
    0-based indices for a file without a header); ``label_column`` likewise; ``labels``: the label values, in the
    order of the classifier's outputs; ``dev``: the evaluation files (the first one picks the best checkpoint)."""
    name: str
    text_columns: Tuple
    label_column: object
    labels: Tuple[str, ...]
    metric: str  # 'matthews' or 'accuracy'
    dev: Tuple[str, ...] = ('dev.tsv',)
    header: bool = True
    layout: str = ''  # the expected columns, for error messages

    @property
    def num_labels(self) -> int:
        return len(self.labels)


TASKS: Dict[str, GlueTask] = {t.name: t for t in (
    GlueTask('cola', (3,), 1, ('0', '1'), 'matthews', header=False,
             layout='no header; 4 tab-separated columns: source, label (0 or 1), original judgement, sentence'),
    GlueTask('rte', ('sentence1', 'sentence2'), 'label', ('entailment', 'not_entailment'), 'accuracy',
             layout='a header with index, sentence1, sentence2, label'),
    GlueTask('qnli', ('question', 'sentence'), 'label', ('entailment', 'not_entailment'), 'accuracy',
             layout='a header with index, question, sentence, label'),
    GlueTask('mnli', ('sentence1', 'sentence2'), 'gold_label', ('entailment', 'neutral', 'contradiction'),
             'accuracy', dev=('dev_matched.tsv', 'dev_mismatched.tsv'),
             layout='a header with (among others) sentence1, sentence2, gold_label'),
)}


def get_task(name: str) -> GlueTask:
    try:
        return TASKS[name.lower()]
    except KeyError:
        raise GlueDataError(f'unknown GLUE task {name!r}; supported: {", ".join(t for t in TASKS)}') from None


@dataclass
class GlueSplit:
    """The examples of one file: ``texts`` holds one tuple of 1 or 2 strings per example, ``labels`` their class
    indices (positions in ``GlueTask.labels``)."""
    path: Path
    texts: List[Tuple[str, ...]]
    labels: List[int]

    def __len__(self) -> int:
        return len(self.labels)


def _lines(path: Path):
    """(line number, fields) of each non-empty line of a UTF-8 TSV file."""
    with open(path, 'rb') as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode('utf-8').rstrip('\r\n')
            except UnicodeDecodeError as e:
                raise GlueDataError(f'{path} line {number}: not UTF-8 text ({e.reason} at byte {e.start}); GLUE '
                                    f'files are UTF-8') from None
            if line:
                yield number, line.split('\t')


def _column_positions(task: GlueTask, path: Path, header: List[str]) -> Tuple[List[int], int]:
    wanted = [*task.text_columns, task.label_column]
    missing = [c for c in wanted if c not in header]
    if missing:
        raise GlueDataError(f'{path} line 1: the header has no {", ".join(missing)} column '
                            f'(it has {", ".join(header[:16])}); {task.name.upper()} files have {task.layout}')
    positions = [header.index(c) for c in wanted]
    return positions[:-1], positions[-1]


def read_split(task: GlueTask, path: Path, limit: Optional[int] = None) -> GlueSplit:
    """The labelled examples of ``path`` (the first ``limit`` ones if given) in ``task``'s layout."""
    path = Path(path)
    if not path.is_file():
        raise GlueDataError(f'{path}: no such file; {task.name.upper()} needs {", ".join(("train.tsv",) + task.dev)} '
                            f'in the folder given to --data (the GLUE layout, e.g. glue_data/{_folder(task)})')
    lines = _lines(path)
    width = None
    if task.header:
        first = next(lines, None)
        if first is None:
            raise GlueDataError(f'{path}: empty file; {task.name.upper()} files have {task.layout}')
        header = [h.strip() for h in first[1]]
        text_at, label_at = _column_positions(task, path, header)
        width = len(header)
    else:
        text_at, label_at = list(task.text_columns), task.label_column
    needed = max([*text_at, label_at]) + 1
    index = {label: i for i, label in enumerate(task.labels)}
    texts, labels = [], []
    for number, fields in lines:
        if len(fields) < needed or (width is not None and len(fields) != width):
            expected = f'{width} (as the header)' if width is not None else f'at least {needed}'
            raise GlueDataError(f'{path} line {number}: {len(fields)} tab-separated fields, expected {expected}; '
                                f'{task.name.upper()} files have {task.layout}')
        label = fields[label_at].strip()
        if label not in index:
            hint = ' (CoLA files have no header line)' if not task.header and number == 1 else ''
            raise GlueDataError(f'{path} line {number}: label {label!r} is not one of '
                                f'{", ".join(task.labels)}{hint}; {task.name.upper()} files have {task.layout}')
        texts.append(tuple(fields[i] for i in text_at))
        labels.append(index[label])
        if limit is not None and len(labels) >= limit:
            break
    if not labels:
        raise GlueDataError(f'{path}: no examples; {task.name.upper()} files have {task.layout}')
    return GlueSplit(path, texts, labels)


def _folder(task: GlueTask) -> str:
    return {'cola': 'CoLA', 'rte': 'RTE', 'qnli': 'QNLI', 'mnli': 'MNLI'}[task.name]


def read_task(task: GlueTask, folder: Path, limit: Optional[int] = None) -> Tuple[GlueSplit, Dict[str, GlueSplit]]:
    """(train split, {dev file stem: dev split}) of the task's files in ``folder``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise GlueDataError(f'--data {folder}: no such folder; give the folder holding the task\'s '
                            f'{", ".join(("train.tsv",) + task.dev)} (e.g. glue_data/{_folder(task)})')
    train = read_split(task, folder / 'train.tsv', limit)
    dev = {Path(name).stem: read_split(task, folder / name, limit) for name in task.dev}
    return train, dev


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes: a resumed run checks it reads the files it started with."""
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
            h.update(chunk)
    return 'sha256:' + h.hexdigest()
