"""`vitblocks list`: the models vitblocks registers with timm."""
import difflib

import timm
import torch

from ..models import get_variant, list_models
from ..profile import count_params, fixed_threads
from .common import CliError, render_table
from .compare import COUNT_THREADS

NAME = 'list'

EPILOG = """\
examples:
  vitblocks list
  vitblocks list --method iffn --params
  vitblocks list --filter poolformer

Every listed name works with timm.create_model after `import vitblocks`.
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(NAME, help='registered vitblocks models', description='List the models vitblocks '
                              'registers with timm: name, method, timm base model, description.', epilog=EPILOG)
    p.add_argument('--method', help='only models of this method, e.g. iffn')
    p.add_argument('--filter', default='', metavar='SUBSTR', help='only names containing SUBSTR')
    p.add_argument('--params', action='store_true',
                   help='also count parameters (built on the meta device where the model allows: no weights allocated)')
    p.set_defaults(run=run)


def param_count(name: str) -> int:
    """Parameters of a model, built without allocating weights where the model allows it."""
    try:
        with torch.device('meta'):
            return count_params(timm.create_model(name))
    except Exception:  # a constructor that reads tensor values (.item()) cannot run on meta
        with fixed_threads(COUNT_THREADS):
            return count_params(timm.create_model(name))


def run(args) -> int:
    methods = sorted({get_variant(n).method for n in list_models()})
    if args.method and args.method not in methods:
        close = difflib.get_close_matches(args.method, methods, n=3, cutoff=0.5)
        hint = f' Did you mean: {", ".join(close)}?' if close else ''
        raise CliError(f'unknown method {args.method!r}.{hint} Registered methods: {", ".join(methods)}')
    names = list_models(args.filter, method=args.method)
    if not names:
        raise CliError(f'no registered model matches --filter {args.filter!r}'
                       + (f' and --method {args.method}' if args.method else ''))
    headers = ['name', 'method', 'timm base', 'description']
    rows = []
    for n in names:
        spec = get_variant(n)
        rows.append([n, spec.method, spec.base, spec.description])
        if args.params:
            rows[-1].insert(3, f'{param_count(n) / 1e6:.2f}')
    if args.params:
        headers.insert(3, 'params M')
    print('\n'.join(render_table(headers, rows, 'lllrl' if args.params else 'llll')))
    print(f'{len(names)} models')
    return 0
