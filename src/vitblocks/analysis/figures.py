"""The figure set-up and saving every analysis plot shares (matplotlib, files only)."""
from contextlib import contextmanager
from pathlib import Path
from typing import Union

__all__ = ['png_figure']


@contextmanager
def png_figure(path: Union[str, Path], dpi: int = 100, **subplots):
    """``with png_figure(path, figsize=(6, 4)) as (fig, axes):`` draw, and on leaving the block the figure
    is saved to ``path`` as a PNG at ``dpi`` and closed (also when drawing fails). ``subplots`` go to
    ``plt.subplots`` (constrained layout). The Agg backend needs no display."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError as e:  # a dependency of vitblocks; said plainly where an environment lacks it
        raise ImportError('plotting needs matplotlib: pip install matplotlib') from e
    fig, axes = plt.subplots(constrained_layout=True, **subplots)
    try:
        yield fig, axes
        fig.savefig(Path(path), dpi=dpi)
    finally:
        plt.close(fig)
