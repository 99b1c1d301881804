"""The papers' published tables as data, so any command can print "ours vs paper".

One YAML file per paper (``papers/<key>.yaml``, e.g. ``iffn.yaml``) holds its tables. Each
row keeps what the paper published (parameters in M, "FLOPs" in G that are GMACs, top-1 %,
throughput) next to how vitblocks builds it (a timm or vitblocks model name, plus optional FFN
swap, block config and timm kwargs, and ``reparam: true`` for numbers published after
re-parameterization). This module is pure data: it never imports torch or timm, and building
a row is left to the callers (``vitblocks compare``, the tests).

How the paper counted its MACs is declared per paper or table (``macs:``, a
:class:`MacConvention`), and per row where a paper mixes counters within one table.

    >>> from vitblocks.papers import load_paper
    >>> t1 = load_paper('iffn').table('1')
    >>> t1.rows[1].model, t1.rows[1].params_m, t1.rows[1].gmacs
    ('iffn_deit_tiny_patch16_224', 5.0, 1.1)
"""
import difflib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import yaml

__all__ = ['Paper', 'PaperTable', 'PaperRow', 'MacConvention', 'PaperDataError', 'list_papers', 'load_paper',
           'COMPLEXITY_FIELDS']

_DATA_DIR = Path(__file__).parent

# the published complexity numbers a row can carry (row attribute -> display name)
COMPLEXITY_FIELDS = {'params_m': 'params (M)', 'gmacs': 'GMACs'}

_PAPER_KEYS = {'key', 'title', 'authors', 'venue', 'method', 'macs', 'tables'}
_TABLE_KEYS = {'number', 'caption', 'macs', 'input_size', 'rows'}
_ROW_KEYS = {'label', 'group', 'model', 'ffn', 'block_cfg', 'base_kwargs', 'reparam', 'macs', 'params_m', 'gmacs',
             'top1', 'throughput', 'note', 'ours_params_m', 'ours_gmacs'}
# optional: our own count where a row's note explains a gap to the published one (row attribute -> published one)
_OURS_FIELDS = {'ours_params_m': 'params_m', 'ours_gmacs': 'gmacs'}
_MACS_KEYS = {'include_norms', 'norm_macs_per_element', 'include_attention', 'note'}


class PaperDataError(ValueError):
    """A paper YAML file is malformed (the message says which file, table and row)."""


@dataclass(frozen=True)
class MacConvention:
    """How a paper counted its "FLOPs" (we report them as GMACs): the arguments of
    ``vitblocks.profile.count_macs`` (see there); ``note`` says why.

    * ``include_norms``: count normalization layers (2 MACs per element with affine, 1 without).
    * ``norm_macs_per_element``: with ``include_norms``, a flat cost per element instead (5: fvcore).
    * ``include_attention``: count the attention matmuls ``q k^T`` and ``attn v`` (default).
    """
    include_norms: bool = False
    note: str = ''
    norm_macs_per_element: Optional[int] = None
    include_attention: bool = True

    def count_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for ``vitblocks.profile.count_macs``."""
        return dict(include_norms=self.include_norms, norm_macs_per_element=self.norm_macs_per_element,
                    include_attention=self.include_attention)

    @property
    def short(self) -> str:
        """A compact tag for tables, e.g. ``attn+norms`` or ``no-attn+norms*5``."""
        norms = '' if not self.include_norms else (
            '+norms' if self.norm_macs_per_element is None else f'+norms*{self.norm_macs_per_element}')
        return ('attn' if self.include_attention else 'no-attn') + norms

    def describe(self) -> str:
        attention = 'attention matmuls counted' if self.include_attention else 'attention matmuls left out'
        if not self.include_norms:
            norms = 'norms not counted'
        elif self.norm_macs_per_element is None:
            norms = 'norms counted (2 MACs per element with affine, 1 without)'
        else:
            norms = f'norms counted ({self.norm_macs_per_element} MACs per element)'
        return f'{attention}, {norms}'


@dataclass(frozen=True)
class PaperRow:
    """One published row and the recipe for building our model of it."""
    label: str
    model: Optional[str]  # timm or vitblocks model name; None if timm cannot build it
    ffn: Optional[str] = None  # registered FFN swapped into ``model`` with ``block_cfg``
    block_cfg: Dict[str, Any] = field(default_factory=dict)
    base_kwargs: Dict[str, Any] = field(default_factory=dict)
    params_m: Optional[float] = None  # published parameters, millions
    gmacs: Optional[float] = None  # published "FLOPs (G)", i.e. GMACs
    top1: Optional[float] = None  # published top-1 accuracy, %
    group: str = ''
    note: str = ''
    reparam: bool = False  # the numbers are of the model after vitblocks.deploy.reparameterize
    macs: Optional[MacConvention] = None  # this row's counting convention, where it differs from its table's
    throughput: Optional[float] = None  # published images/s (display only: other hardware)
    decimals: Dict[str, int] = field(default_factory=dict)  # complexity field -> decimals the paper printed
    # our own count (M, G) for a row whose note explains why it differs from the published one: the
    # note says why, this pins what (the tests hold the model to it)
    ours_params_m: Optional[float] = None
    ours_gmacs: Optional[float] = None

    def agrees_when_rounded(self, key: str, ours: float) -> bool:
        """Whether ``ours`` rounds to the published ``key`` at the precision the paper printed it
        (0.64 for a printed 0.6), which is all a one-decimal number can be checked to."""
        half_unit = 0.5 * 10.0 ** -self.decimals.get(key, 0)
        return abs(ours - getattr(self, key)) <= half_unit * (1 + 1e-9)

    @property
    def buildable(self) -> bool:
        return self.model is not None

    @property
    def published_complexity(self) -> Dict[str, float]:
        """The complexity numbers this row publishes, e.g. ``{'params_m': 5.0, 'gmacs': 1.1}``."""
        return {k: getattr(self, k) for k in COMPLEXITY_FIELDS if getattr(self, k) is not None}

    @property
    def accuracy_only(self) -> bool:
        return not self.published_complexity

    def build_key(self) -> Tuple:
        """Hashable identity of the model this row builds (rows with equal keys build equal models)."""

        def freeze(d):
            return tuple(sorted((k, repr(v)) for k, v in d.items()))

        return self.model, self.ffn, freeze(self.block_cfg), freeze(self.base_kwargs)


@dataclass(frozen=True)
class PaperTable:
    paper: str  # paper key, e.g. 'iffn'
    number: str  # table number as printed, e.g. '1'
    caption: str  # a summary of the caption
    macs: MacConvention
    input_size: Tuple[int, int, int]
    rows: Tuple[PaperRow, ...]

    @property
    def title(self) -> str:
        return f'{self.paper.upper()} Table {self.number}'

    def convention(self, row: PaperRow) -> MacConvention:
        """How ``row``'s MACs were counted: its own convention, else the table's."""
        return row.macs if row.macs is not None else self.macs


@dataclass(frozen=True)
class Paper:
    key: str
    title: str
    authors: str
    venue: str
    method: str
    tables: Tuple[PaperTable, ...]
    source: str = ''  # the YAML file it was read from

    def table(self, number: Union[str, int]) -> PaperTable:
        for t in self.tables:
            if t.number == str(number):
                return t
        raise KeyError(f'{self.key} has no table {number!r}; available: {", ".join(t.number for t in self.tables)}')


def list_papers() -> List[str]:
    """Keys of the papers shipped with vitblocks (``papers/*.yaml``)."""
    return sorted(p.stem for p in _DATA_DIR.glob('*.yaml'))


def load_paper(key_or_path: Union[str, Path]) -> Paper:
    """Load a shipped paper by key (``'iffn'``) or any paper YAML file by path."""
    path = Path(key_or_path)
    if path.suffix not in ('.yaml', '.yml'):
        if str(key_or_path) not in list_papers():
            close = difflib.get_close_matches(str(key_or_path), list_papers(), n=3, cutoff=0.5)
            hint = f' Did you mean: {", ".join(close)}?' if close else ''
            raise ValueError(f'unknown paper {str(key_or_path)!r}.{hint} Available: {", ".join(list_papers())}')
        path = _DATA_DIR / f'{key_or_path}.yaml'
    return _load(path.resolve())


class _PrintedFloat(float):
    """A float from the YAML file that remembers how many decimals it was printed with."""
    decimals = 0


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose floats keep their printed precision (1.10 has 2 decimals)."""


def _construct_float(loader: _Loader, node) -> float:
    value = _PrintedFloat(loader.construct_yaml_float(node))
    text = str(node.value).lower().replace('_', '')
    if '.' in text and 'e' not in text:
        value.decimals = len(text.split('.', 1)[1])
    return value


_Loader.add_constructor('tag:yaml.org,2002:float', _construct_float)


@lru_cache(maxsize=None)
def _load(path: Path) -> Paper:
    with open(path, encoding='utf-8') as f:
        data = yaml.load(f, Loader=_Loader)
    where = path.name
    _check_keys(data, _PAPER_KEYS, {'key', 'title', 'tables'}, where)
    default_macs = data.get('macs') or {}
    tables = []
    for t in data['tables']:
        t_where = f'{where}, table {t.get("number")!r}'
        _check_keys(t, _TABLE_KEYS, {'number', 'caption', 'rows'}, t_where)
        macs = _convention(t.get('macs', default_macs), f'{t_where}, macs')
        size = tuple(t.get('input_size', (3, 224, 224)))
        if len(size) != 3 or not all(isinstance(s, int) for s in size):
            raise PaperDataError(f'{t_where}: input_size must be [C, H, W], got {list(size)}')
        rows = tuple(_row(r, f'{t_where}, row {i}') for i, r in enumerate(t['rows']))
        tables.append(PaperTable(paper=data['key'], number=str(t['number']), caption=str(t['caption']).strip(),
                                 macs=macs, input_size=size, rows=rows))
    return Paper(key=data['key'], title=data['title'], authors=data.get('authors', ''), venue=data.get('venue', ''),
                 method=data.get('method', data['key']), tables=tuple(tables), source=str(path))


def _convention(macs: Any, where: str) -> MacConvention:
    _check_keys(macs, _MACS_KEYS, set(), where)
    for k in ('include_norms', 'include_attention'):
        if k in macs and not isinstance(macs[k], bool):
            raise PaperDataError(f'{where}: {k} must be true or false, got {macs[k]!r}')
    per_element = macs.get('norm_macs_per_element')
    if per_element is not None:
        if isinstance(per_element, bool) or not isinstance(per_element, int) or per_element < 0:
            raise PaperDataError(f'{where}: norm_macs_per_element must be a non-negative integer, got {per_element!r}')
        if not macs.get('include_norms', False):
            raise PaperDataError(f'{where}: norm_macs_per_element needs include_norms: true')
    return MacConvention(include_norms=macs.get('include_norms', False), note=str(macs.get('note', '')).strip(),
                         norm_macs_per_element=per_element, include_attention=macs.get('include_attention', True))


def _row(r: Dict[str, Any], where: str) -> PaperRow:
    _check_keys(r, _ROW_KEYS, {'label', 'model'}, where)
    where = f'{where} ({r["label"]!r})'
    for k in ('params_m', 'gmacs', 'top1', 'throughput', *_OURS_FIELDS):
        if r.get(k) is not None and (isinstance(r[k], bool) or not isinstance(r[k], (int, float))):
            raise PaperDataError(f'{where}: {k} must be a number, got {r[k]!r}')
    for k, published in _OURS_FIELDS.items():
        if r.get(k) is not None and r.get(published) is None:
            raise PaperDataError(f'{where}: {k} needs the published {published} it stands beside')
    if not isinstance(r.get('reparam', False), bool):
        raise PaperDataError(f'{where}: reparam must be true or false, got {r["reparam"]!r}')
    for k in ('block_cfg', 'base_kwargs'):
        if not isinstance(r.get(k) or {}, dict):
            raise PaperDataError(f'{where}: {k} must be a mapping, got {r[k]!r}')
    if r['model'] is None:
        if not r.get('note'):
            raise PaperDataError(f'{where}: a row with model: null needs a note saying why it cannot be built')
        if r.get('ffn') or r.get('block_cfg') or r.get('base_kwargs') or r.get('reparam'):
            raise PaperDataError(f'{where}: ffn/block_cfg/base_kwargs/reparam need a model')
    if r.get('params_m') is None and r.get('gmacs') is None and r.get('top1') is None:
        raise PaperDataError(f'{where}: a row publishes at least one of params_m, gmacs, top1')
    macs = _convention(r['macs'], f'{where}, macs') if r.get('macs') is not None else None
    decimals = {k: getattr(r[k], 'decimals', 0) for k in COMPLEXITY_FIELDS if r.get(k) is not None}
    return PaperRow(label=str(r['label']), model=r['model'], ffn=r.get('ffn'), block_cfg=dict(r.get('block_cfg') or {}),
                    base_kwargs=dict(r.get('base_kwargs') or {}), params_m=_float(r.get('params_m')),
                    gmacs=_float(r.get('gmacs')), top1=_float(r.get('top1')), group=str(r.get('group', '')),
                    note=str(r.get('note', '')).strip(), reparam=bool(r.get('reparam', False)), macs=macs,
                    throughput=_float(r.get('throughput')), decimals=decimals,
                    ours_params_m=_float(r.get('ours_params_m')), ours_gmacs=_float(r.get('ours_gmacs')))


def _float(v) -> Optional[float]:
    return None if v is None else float(v)


def _check_keys(d: Any, allowed: set, required: set, where: str) -> None:
    if not isinstance(d, dict):
        raise PaperDataError(f'{where}: expected a mapping, got {type(d).__name__}')
    unknown = set(d) - allowed
    if unknown:
        raise PaperDataError(f'{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}')
    missing = required - set(d)
    if missing:
        raise PaperDataError(f'{where}: missing field(s) {sorted(missing)}')
