"""Aligned text tables, as plain text or Markdown: what the command line prints and the reproduction harnesses
save next to their runs."""
from typing import Any, List, Sequence

__all__ = ['render_table']


def render_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str, fmt: str = 'text',
                 indent: str = '') -> List[str]:
    """Lines of an aligned table. ``align``: one 'l' or 'r' per column; ``fmt``: 'text' or 'md'."""
    cells = [[str(h) for h in headers]] + [['' if c is None else str(c) for c in r] for r in rows]
    if fmt == 'md':
        def escape_pipes(s):
            return s.replace('|', '\\|')

        lines = ['| ' + ' | '.join(escape_pipes(c) for c in cells[0]) + ' |',
                 '|' + '|'.join(' ---: ' if a == 'r' else ' --- ' for a in align) + '|']
        return lines + ['| ' + ' | '.join(escape_pipes(c) for c in r) + ' |' for r in cells[1:]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for r in cells:
        parts = [c.rjust(w) if a == 'r' else c.ljust(w) for c, w, a in zip(r, widths, align)]
        out.append((indent + '  '.join(parts)).rstrip())
    return out
