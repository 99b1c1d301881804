"""The figure set-up and saving every analysis plot shares (matplotlib, files only)."""
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Union

__all__ = ['png_figure', 'figure_format']


def _pyplot():
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError as e:  # a dependency of vitblocks; said plainly where an environment lacks it
        raise ImportError('plotting needs matplotlib: pip install matplotlib') from e
    return plt


def figure_format(path: Union[str, Path]) -> str:
    """The image format ``path``'s suffix names (``'png'`` for ``a.png``), or a ValueError that lists the
    ones matplotlib writes: a missing or unknown suffix is refused rather than guessed."""
    _pyplot()
    from matplotlib.backend_bases import FigureCanvasBase
    known = FigureCanvasBase.get_supported_filetypes()
    fmt = Path(path).suffix[1:].lower()
    if fmt not in known:
        raise ValueError(f'{path}: {"no file suffix" if not fmt else f"cannot write a .{fmt} figure"}; '
                         f'give a name ending in .png (or {", ".join("." + k for k in sorted(known) if k != "png")})')
    return fmt


@contextmanager
def png_figure(path: Union[str, Path], dpi: int = 100, **subplots):
    """``with png_figure(path, figsize=(6, 4)) as (fig, axes):`` draw, and on leaving the block the figure
    is saved to ``path`` (a PNG at ``dpi``; another format where the suffix names one) and closed (also
    when drawing fails). ``subplots`` go to ``plt.subplots`` (constrained layout). The Agg backend needs no
    display. The file is written beside ``path`` and renamed into place, so a failed or killed save
    never leaves a truncated figure there nor replaces a good one."""
    path = Path(path)
    fmt = figure_format(path)
    plt = _pyplot()
    fig, axes = plt.subplots(constrained_layout=True, **subplots)
    try:
        yield fig, axes
        tmp = path.with_name(f'.{path.name}.tmp')  # same folder: os.replace is a rename
        try:
            fig.savefig(tmp, format=fmt, dpi=dpi)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    finally:
        plt.close(fig)
