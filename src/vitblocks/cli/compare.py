"""`vitblocks compare`: our params and GMACs next to every published paper table row."""
import csv
import dataclasses
import io
import sys
import textwrap
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..models import get_variant
from ..papers import Paper, PaperRow, PaperTable, list_papers, load_paper
from ..profile import count_macs, count_params, fixed_threads
from .common import CliError, build_model, end_progress, format_cfg, is_vitblocks_model, progress, render_table

NAME = 'compare'
TOLERANCE_PCT = 1.0  # a row matches when every published complexity number is within this
# Counting runs batch-1 forwards, which gain little from intra-op threads; on a busy machine extra
# OpenMP threads mostly spin (30x slower measured with 2 threads on 2 shared cores).
COUNT_THREADS = 1

EPILOG = """\
examples:
  vitblocks compare                              # every table of every paper (about 20 s on 2 cores)
  vitblocks compare --paper iffn --tables 1,2    # IFFN Tables 1 and 2 only
  vitblocks compare --models deit_tiny poolformer_s12
  vitblocks compare --tables 1 --format md > docs/iffn_table1.md

A row counts as reproduced when all of its published complexity numbers (params, GMACs) are
within 1% of ours. Rows that publish accuracy only, and rows timm cannot build, are listed
but not counted. The exit code is 0 whatever the match.
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
    def within(self) -> bool:
        return (self.counted and not self.measured.error and len(self.deltas) == len(self.row.published_complexity)
                and all(abs(d) <= TOLERANCE_PCT for d in self.deltas.values()))

    @property
    def status(self) -> str:
        if not self.row.buildable:
            return 'not built'
        if self.measured.error:
            return 'build error'
        if self.row.accuracy_only:
            return 'acc. only'
        return 'ok' if self.within else 'OFF >1%'

    def ours(self, key: str) -> Optional[float]:
        if self.measured is None or self.measured.error:
            return None
        return self.measured.params / 1e6 if key == 'params_m' else self.measured.macs / 1e9


class Counter:
    """Builds and counts each distinct (model, config, input size, convention) once."""

    def __init__(self):
        self.cache: Dict[Tuple, Measured] = {}
        self.seconds = 0.0

    def measure(self, row: PaperRow, table: PaperTable) -> Measured:
        key = (_effective_build_key(row), table.input_size, table.macs.include_norms)
        if key not in self.cache:
            t0 = time.perf_counter()
            progress(f'counting {row.model} {format_cfg(row.block_cfg)} ({len(self.cache) + 1} models so far)')
            self.cache[key] = self._count(row, table)
            self.seconds += time.perf_counter() - t0
        return self.cache[key]

    @staticmethod
    def _count(row: PaperRow, table: PaperTable) -> Measured:
        try:
            with torch.no_grad(), fixed_threads(COUNT_THREADS):
                model = build_model(row.model, row.block_cfg, row.base_kwargs, row.ffn)
                macs = count_macs(model, input_size=table.input_size, include_norms=table.macs.include_norms).total
                return Measured(params=count_params(model), macs=macs)
        except CliError as e:
            return Measured(error=str(e))
        except Exception as e:  # a forward that fails is reported on its row, the other rows still run
            return Measured(error=f'forward failed: {type(e).__name__}: {e}')


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
    match = lambda r: not subs or any(s in (r.model or '').lower() or s in r.label.lower() for s in subs)
    out = []
    for paper in papers:
        for table in paper.tables:
            if tables and table.number not in tables:
                continue
            rows = [r for r in table.rows if match(r)]
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
            papers.append(load_paper(key))
        except ValueError as e:
            raise CliError(str(e)) from None
    tables = [t.strip() for t in args.tables.split(',') if t.strip()] if args.tables else None
    selected = select(papers, tables, args.models)

    counter = Counter()
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
    end_progress()

    all_rows = [r for _, rs in results for r in rs]
    counted = [r for r in all_rows if r.counted]
    summary = f'{sum(r.within for r in counted)} of {len(counted)} published rows within {TOLERANCE_PCT:g}%'
    if args.format == 'csv':
        print(_csv(results), end='')
        print(summary, file=sys.stderr)
        return 0
    papers_shown = [p for p in papers if any(t.paper == p.key for t, _ in results)]
    print('\n'.join(_report(papers_shown, results, args.format)))
    print(_not_counted_line(all_rows))
    print(f'Built and counted {len(counter.cache)} distinct models in {counter.seconds:.0f} s '
          f'(random init, CPU, batch 1).')
    if args.format == 'md':
        print()
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


def _report(papers: Sequence[Paper], results, fmt: str) -> List[str]:
    md = fmt == 'md'
    lines: List[str] = []
    for paper in papers:
        head = f'{paper.key.upper()}: "{paper.title}" ({paper.venue})'
        lines += [f'## {head}' if md else head, '']
        conventions = {t.macs for t, _ in results if t.paper == paper.key}
        for conv in conventions:
            text = f'MAC convention: include_norms={conv.include_norms}. {conv.note}'
            lines += (textwrap.wrap(text, 100) if not md else [text]) + ['']
        for table, rows in results:
            if table.paper != paper.key:
                continue
            title = f'{table.title}: {table.caption}'
            lines += [f'### {title}'] if md else textwrap.wrap(title, 100, subsequent_indent='  ')
            c, h, w = table.input_size
            lines += ['', f'Counted at {c}x{h}x{w}, batch 1, include_norms={table.macs.include_norms}.', '']
            notes: List[str] = []
            body = []
            for r in rows:
                note = r.measured.error if r.measured is not None and r.measured.error else r.row.note
                mark = ''
                if note:
                    if note not in notes:
                        notes.append(note)
                    mark = f'[{notes.index(note) + 1}]'
                body.append([r.row.label, _model_cell(r.row),
                             _fmt(r.ours('params_m'), 3), _fmt(r.row.params_m, 2), _fmt_delta(r.deltas.get('params_m')),
                             _fmt(r.ours('gmacs'), 3), _fmt(r.row.gmacs, 2), _fmt_delta(r.deltas.get('gmacs')),
                             _fmt(r.row.top1, 1), r.status, mark])
            headers = ['row', 'model', 'params M', 'paper', 'delta', 'GMACs', 'paper', 'delta', 'top-1 %', 'status',
                       'note']
            lines += render_table(headers, body, 'llrrrrrrrll', fmt='md' if md else 'text', indent='' if md else '  ')
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
    w.writerow(['paper', 'table', 'row', 'model', 'ffn', 'block_cfg', 'base_kwargs', 'params_m_ours', 'params_m_paper',
                'params_delta_pct', 'gmacs_ours', 'gmacs_paper', 'gmacs_delta_pct', 'top1_paper', 'include_norms',
                'status', 'note'])
    num = lambda v, d: '' if v is None else f'{v:.{d}f}'
    for table, rows in results:
        for r in rows:
            note = r.measured.error if r.measured is not None and r.measured.error else r.row.note
            w.writerow([table.paper, table.number, r.row.label, r.row.model or '', r.row.ffn or '',
                        format_cfg(r.row.block_cfg), format_cfg(r.row.base_kwargs),
                        num(r.ours('params_m'), 4), num(r.row.params_m, 2), num(r.deltas.get('params_m'), 3),
                        num(r.ours('gmacs'), 4), num(r.row.gmacs, 2), num(r.deltas.get('gmacs'), 3),
                        num(r.row.top1, 1), table.macs.include_norms, r.status, note])
    return buf.getvalue()
