"""`vitblocks compare`: our params and GMACs next to every published paper table row.

Each distinct model is built once (on the meta device where its code allows: shapes only, no
memory, no init, so ViT-H costs nothing; on the CPU otherwise) and counted in every way its rows
need: as built and after ``vitblocks.deploy.reparameterize`` (rows with ``reparam: true``), with
each table's or row's MAC convention.
"""
import csv
import dataclasses
import io
import sys
import textwrap
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..deploy import reparameterize
from ..models import get_variant
from ..papers import MacConvention, Paper, PaperRow, PaperTable, list_papers, load_paper
from ..profile import count_macs, count_params, fixed_threads
from ..ticker import Ticker
from .common import CliError, build_model, format_cfg, is_vitblocks_model, render_table

NAME = 'compare'
TOLERANCE_PCT = 1.0  # a row matches when every published complexity number is within this
# Counting runs batch-1 forwards, which gain little from intra-op threads; on a busy machine extra
# OpenMP threads mostly spin (30x slower measured with 2 threads on 2 shared cores).
COUNT_THREADS = 1

EPILOG = """\
examples:
  vitblocks compare                              # every table of every paper
  vitblocks compare --paper iffn --tables 1,2    # IFFN Tables 1 and 2 only
  vitblocks compare --paper repa --models deit   # RePa rows before and after re-parameterization
  vitblocks compare --paper iffn --tables 1 --format md > iffn_table1.md

A row counts as reproduced when all of its published complexity numbers (params, GMACs) are
within 1% of ours. Rows outside 1% whose numbers still round to the published ones at the
precision the paper printed (ours 0.64 for a printed 0.6) are marked "rounding" and listed
separately. Rows that publish accuracy only, and rows timm cannot build, are listed but not
counted. "rep." rows are counted after re-parameterization. The exit code is 0 whatever the
match.
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(NAME, help='our params/GMACs vs the papers\' published tables',
                              description='Build every model of the papers\' tables (random init, CPU), count its '
                                          'parameters and MACs with the paper\'s convention, and print ours vs '
                                          'published.', epilog=EPILOG)
    p.add_argument('--paper', action='append', metavar='KEY',
                   help=f'paper to compare (repeatable; default: all of {", ".join(list_papers())})')
    p.add_argument('--tables', metavar='N,N', help='comma-separated table numbers, e.g. 1,2 (default: all)')
    p.add_argument('--models', nargs='+', metavar='SUBSTR',
                   help='only rows whose model name or label contains one of these substrings')
    p.add_argument('--format', choices=('text', 'md', 'csv'), default='text',
                   help='text (aligned, default), md (markdown tables for docs), csv (one table; the summary '
                        'line goes to stderr)')
    p.set_defaults(run=run)


@dataclass
class Measured:
    params: Optional[int] = None
    macs: Optional[int] = None
    error: str = ''


@dataclass
class RowResult:
    row: PaperRow
    measured: Optional[Measured]  # None: not buildable
    deltas: Dict[str, float] = field(default_factory=dict)  # field -> delta % (ours vs paper)

    @property
    def counted(self) -> bool:
        return self.row.buildable and not self.row.accuracy_only

    @property
    def complete(self) -> bool:
        return self.counted and not self.measured.error and len(self.deltas) == len(self.row.published_complexity)

    @property
    def within(self) -> bool:
        return self.complete and all(abs(d) <= TOLERANCE_PCT for d in self.deltas.values())

    @property
    def rounding(self) -> bool:
        """Outside 1%, but every published number is ours rounded to the decimals the paper printed."""
        return (self.complete and not self.within
                and all(abs(d) <= TOLERANCE_PCT or self.row.agrees_when_rounded(k, self.ours(k))
                        for k, d in self.deltas.items()))

    @property
    def status(self) -> str:
        if not self.row.buildable:
            return 'not built'
        if self.measured.error:
            return 'build error'
        if self.row.accuracy_only:
            return 'acc. only'
        return 'ok' if self.within else 'rounding' if self.rounding else 'OFF >1%'

    def ours(self, key: str) -> Optional[float]:
        if self.measured is None or self.measured.error:
            return None
        return self.measured.params / 1e6 if key == 'params_m' else self.measured.macs / 1e9


# how one row is counted once its model is built: (reparameterized, input size, convention)
Count = Tuple[bool, Tuple[int, int, int], MacConvention]


class Counter:
    """Builds each distinct model once and counts it in every way its rows need.

    A model is built on the meta device when its code allows (shapes only: parameters and MACs
    are exact, nothing is allocated or initialized) and on the CPU otherwise (e.g. surgery that
    reads a parameter's value), counted with one thread.
    """

    DEVICES = ('meta', 'cpu')

    def __init__(self, devices: Sequence[str] = DEVICES):
        self.devices = tuple(devices)
        self.cache: Dict[Tuple, Measured] = {}  # (build key, Count) -> Measured
        self.built: Dict[str, int] = defaultdict(int)  # device -> distinct models built there
        self.seconds = 0.0

    @staticmethod
    def count_of(row: PaperRow, table: PaperTable) -> Count:
        return row.reparam, table.input_size, dataclasses.replace(table.convention(row), note='')

    def measure_all(self, jobs: Sequence[Tuple[PaperRow, PaperTable]]) -> None:
        """Count every (row, table) of ``jobs``, building each distinct model once."""
        todo: Dict[Tuple, Tuple[PaperRow, List[Count]]] = {}
        for row, table in jobs:
            key = _effective_build_key(row)
            counts = todo.setdefault(key, (row, []))[1]
            count = self.count_of(row, table)
            if count not in counts and (key, count) not in self.cache:
                counts.append(count)
        t0 = time.perf_counter()
        # a bar on a terminal; redirected (a job log), a line on stderr at most every 10 s
        ticker = Ticker(sum(1 for _, counts in todo.values() if counts), 'models', 'compare: counting')
        try:
            for key, (row, counts) in todo.items():
                if counts:
                    self.cache.update({(key, c): m for c, m in zip(counts, self._count(row, counts))})
                    ticker.update(1)
        finally:
            ticker.close()
        self.seconds += time.perf_counter() - t0

    def measure(self, row: PaperRow, table: PaperTable) -> Measured:
        key = (_effective_build_key(row), self.count_of(row, table))
        if key not in self.cache:
            self.measure_all([(row, table)])
        return self.cache[key]

    def _count(self, row: PaperRow, counts: Sequence[Count]) -> List[Measured]:
        error = None
        for device in self.devices:  # the first device whose build and forwards all work
            try:
                with torch.no_grad(), fixed_threads(COUNT_THREADS), torch.device(device):
                    model = build_model(row.model, row.block_cfg, row.base_kwargs, row.ffn)
                    out = [_count_one(model, *c) for c in counts]
                self.built[device] += 1
                return out
            except CliError as e:
                error = str(e)
            except Exception as e:  # a forward that fails is reported on its row, the other rows still run
                error = f'forward failed: {type(e).__name__}: {e}'
        return [Measured(error=error)] * len(counts)


def _count_one(model: torch.nn.Module, reparam: bool, input_size, convention: MacConvention) -> Measured:
    if reparam:
        model = reparameterize(model)  # a copy, in eval mode
    macs = count_macs(model, input_size=input_size, **convention.count_kwargs()).total
    return Measured(params=count_params(model), macs=macs)


def _effective_build_key(row: PaperRow) -> Tuple:
    """``row.build_key()`` with a vitblocks model's registered block config filled in, so a row that
    spells out a default (``kernel_size: 3``) shares its build with a row that leaves it out."""
    if row.ffn or not is_vitblocks_model(row.model):
        return row.build_key()
    return dataclasses.replace(row, block_cfg={**get_variant(row.model).cfg, **row.block_cfg}).build_key()


def select(papers: Sequence[Paper], tables: Optional[Sequence[str]], models: Optional[Sequence[str]]):
    """[(table, [rows])] after the --tables and --models filters (tables left empty are dropped)."""
    if tables:
        known = {t.number for p in papers for t in p.tables}
        unknown = [t for t in tables if t not in known]
        if unknown:
            raise CliError(f'no table {", ".join(unknown)} in {", ".join(p.key for p in papers)}; '
                           f'available: {", ".join(sorted(known, key=_table_sort_key))}')
    subs = [m.lower() for m in models or ()]

    def row_matches(r):
        return not subs or any(s in (r.model or '').lower() or s in r.label.lower() for s in subs)

    out = []
    for paper in papers:
        for table in paper.tables:
            if tables and table.number not in tables:
                continue
            rows = [r for r in table.rows if row_matches(r)]
            if rows:
                out.append((table, rows))
    if not out:
        raise CliError(f'no table row matches --models {" ".join(models or ())}; try a substring of a timm base '
                       f'name such as deit_tiny, swin_tiny or poolformer_s12')
    return out


def _table_sort_key(number: str):
    return (0, int(number), '') if number.isdigit() else (1, 0, number)


def run(args) -> int:
    keys = args.paper or list_papers()
    papers = []
    for key in keys:
        try:
            paper = load_paper(key)
        except ValueError as e:
            raise CliError(str(e)) from None
        if all(p.key != paper.key for p in papers):  # `--paper iffn --paper iffn` compares it once
            papers.append(paper)
    tables = [t.strip() for t in args.tables.split(',') if t.strip()] if args.tables is not None else None
    if tables == []:
        raise CliError(f'--tables {args.tables!r} names no table; give numbers such as 1,2 or drop --tables')
    selected = select(papers, tables, args.models)

    counter = Counter()
    counter.measure_all([(row, table) for table, rows in selected for row in rows if row.buildable])
    results: List[Tuple[PaperTable, List[RowResult]]] = []
    for table, rows in selected:
        table_results = []
        for row in rows:
            measured = counter.measure(row, table) if row.buildable else None
            res = RowResult(row, measured)
            for key, paper_value in row.published_complexity.items():
                ours = res.ours(key)
                if ours is not None:
                    res.deltas[key] = 100.0 * (ours - paper_value) / paper_value
            table_results.append(res)
        results.append((table, table_results))

    all_rows = [r for _, rs in results for r in rs]
    counted = [r for r in all_rows if r.counted]
    summary = f'{sum(r.within for r in counted)} of {len(counted)} published rows within {TOLERANCE_PCT:g}%'
    rounding = sum(r.rounding for r in counted)
    rounding_line = (f'{rounding} of the others are off by more than {TOLERANCE_PCT:g}% but round to the published '
                     f'numbers at the precision the paper printed (status "rounding").') if rounding else ''
    if args.format == 'csv':
        print(_csv(results), end='')
        if rounding_line:
            print(rounding_line, file=sys.stderr)
        print(summary, file=sys.stderr)
        return 0
    papers_shown = [p for p in papers if any(t.paper == p.key for t, _ in results)]
    print('\n'.join(_report(papers_shown, results, args.format)))
    print(_not_counted_line(all_rows))
    built = ', '.join(f'{n} on {d}' for d, n in counter.built.items() if n) or 'none'
    print(f'Built {sum(counter.built.values())} distinct models ({built}; meta = shapes only) and counted '
          f'{len(counter.cache)} configurations in {counter.seconds:.0f} s (random init, batch 1).')
    if args.format == 'md':
        print()
    if rounding_line:
        print(rounding_line)
    print(summary)
    return 0


def _fmt(value: Optional[float], digits: int) -> str:
    return '-' if value is None else f'{value:.{digits}f}'


def _fmt_delta(value: Optional[float]) -> str:
    return '-' if value is None else f'{value:+.2f}%'


def _model_cell(row: PaperRow) -> str:
    if not row.buildable:
        return '-'
    parts = [row.model, f'ffn={row.ffn}' if row.ffn else '', format_cfg(row.block_cfg), format_cfg(row.base_kwargs)]
    return ' '.join(p for p in parts if p)


def _columns(table: PaperTable, rows: Sequence[RowResult]):
    """(header, align, cell) of the report's columns; rep., counted and img/s only where a row needs them."""
    cols = [('row', 'l', lambda r: r.row.label), ('model', 'l', lambda r: _model_cell(r.row))]
    if any(r.row.reparam for r in rows):
        cols.append(('rep.', 'l', lambda r: 'yes' if r.row.reparam else ''))
    cols += [('params M', 'r', lambda r: _fmt(r.ours('params_m'), 3)),
             ('paper', 'r', lambda r: _fmt(r.row.params_m, 2)),
             ('delta', 'r', lambda r: _fmt_delta(r.deltas.get('params_m'))),
             ('GMACs', 'r', lambda r: _fmt(r.ours('gmacs'), 3)),
             ('paper', 'r', lambda r: _fmt(r.row.gmacs, 2)),
             ('delta', 'r', lambda r: _fmt_delta(r.deltas.get('gmacs')))]
    if any(r.row.macs is not None for r in rows):  # a row counted unlike its table
        cols.append(('counted', 'l', lambda r: table.convention(r.row).short))
    if any(r.row.throughput is not None for r in rows):
        cols.append(('img/s paper', 'r', lambda r: _fmt(r.row.throughput, 1)))
    cols += [('top-1 %', 'r', lambda r: _fmt(r.row.top1, 1)), ('status', 'l', lambda r: r.status)]
    return cols


def _report(papers: Sequence[Paper], results, fmt: str) -> List[str]:
    md = fmt == 'md'
    lines: List[str] = []
    for paper in papers:
        head = f'{paper.key.upper()}: "{paper.title}" ({paper.venue})'
        lines += [f'## {head}' if md else head, '']
        conventions = list(dict.fromkeys(t.convention(r.row) for t, rs in results if t.paper == paper.key
                                         for r in rs))
        for conv in conventions:
            text = f'MAC convention {conv.short}: {conv.describe()}. {conv.note}'.strip()
            lines += (textwrap.wrap(text, 100) if not md else [text]) + ['']
        for table, rows in results:
            if table.paper != paper.key:
                continue
            title = f'{table.title}: {table.caption}'
            lines += [f'### {title}'] if md else textwrap.wrap(title, 100, subsequent_indent='  ')
            c, h, w = table.input_size
            lines += ['', f'Counted at {c}x{h}x{w}, batch 1, {table.macs.short}: {table.macs.describe()}'
                          f'{" (rows counted otherwise: see column counted)" if any(r.row.macs for r in rows) else ""}'
                          f'.', '']
            notes: List[str] = []
            body = []
            cols = _columns(table, rows)
            for r in rows:
                note = r.measured.error if r.measured is not None and r.measured.error else r.row.note
                mark = ''
                if note:
                    if note not in notes:
                        notes.append(note)
                    mark = f'[{notes.index(note) + 1}]'
                body.append([cell(r) for _, _, cell in cols] + [mark])
            headers = [h for h, _, _ in cols] + ['note']
            align = ''.join(a for _, a, _ in cols) + 'l'
            lines += render_table(headers, body, align, fmt='md' if md else 'text', indent='' if md else '  ')
            if notes:
                lines.append('')
                lines += [f'{"" if md else "  "}[{i + 1}] {n}' + ('  ' if md else '') for i, n in enumerate(notes)]
            lines.append('')
    return lines


def _not_counted_line(rows: Sequence[RowResult]) -> str:
    unbuilt = [r for r in rows if not r.row.buildable]
    acc = [r for r in rows if r.row.buildable and r.row.accuracy_only]
    reasons = sorted({r.row.note for r in unbuilt})
    parts = []
    if unbuilt:
        parts.append(f'{len(unbuilt)} rows that timm cannot build ({"; ".join(reasons)})')
    if acc:
        parts.append(f'{len(acc)} accuracy-only rows')
    return 'Not counted: ' + (', '.join(parts) if parts else 'none') + '.'


def _csv(results) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(['paper', 'table', 'row', 'model', 'ffn', 'block_cfg', 'base_kwargs', 'reparam', 'params_m_ours',
                'params_m_paper', 'params_delta_pct', 'gmacs_ours', 'gmacs_paper', 'gmacs_delta_pct', 'top1_paper',
                'throughput_paper', 'include_norms', 'norm_macs_per_element', 'include_attention', 'status', 'note'])

    def fixed(v, d):
        return '' if v is None else f'{v:.{d}f}'

    for table, rows in results:
        for r in rows:
            note = r.measured.error if r.measured is not None and r.measured.error else r.row.note
            conv = table.convention(r.row)
            w.writerow([table.paper, table.number, r.row.label, r.row.model or '', r.row.ffn or '',
                        format_cfg(r.row.block_cfg), format_cfg(r.row.base_kwargs), r.row.reparam,
                        fixed(r.ours('params_m'), 4), fixed(r.row.params_m, 2), fixed(r.deltas.get('params_m'), 3),
                        fixed(r.ours('gmacs'), 4), fixed(r.row.gmacs, 2), fixed(r.deltas.get('gmacs'), 3),
                        fixed(r.row.top1, 1), fixed(r.row.throughput, 1), conv.include_norms,
                        '' if conv.norm_macs_per_element is None else conv.norm_macs_per_element,
                        conv.include_attention, r.status, note])
    return buf.getvalue()
