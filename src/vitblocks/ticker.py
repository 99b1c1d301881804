"""Progress of a long loop that is not a training epoch (decoding a dataset, an evaluation pass):
a tqdm bar on a terminal, else one log line on stderr at most every ``interval_s`` seconds, so a
job log shows the work is alive. Training epochs use ``vitblocks.experiments.runlog.Progress``."""
import sys
import time
from typing import Optional

__all__ = ['Ticker']


class Ticker:
    """``t = Ticker(total, 'img', 'eval'); t.update(n) ...; t.close()``.

    ``mode``: 'auto' (bar on a terminal, else log lines), 'bar', 'log' or 'none'.
    """

    def __init__(self, total: Optional[int], unit: str, desc: str, mode: str = 'auto', interval_s: float = 10.0):
        if mode == 'auto':
            mode = 'bar' if sys.stderr.isatty() else 'log'
        self.mode, self.total, self.unit, self.desc, self.interval_s = mode, total, unit, desc, interval_s
        self.done = 0
        self._t0 = self._last = time.perf_counter()
        self._bar = None
        if mode == 'bar':
            from tqdm import tqdm
            self._bar = tqdm(total=total, unit=unit, unit_scale=True, desc=desc, leave=False, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.mode == 'log':
            now = time.perf_counter()
            if now - self._last >= self.interval_s:
                self._last = now
                self._line(now)

    def _line(self, now: float) -> None:
        elapsed = now - self._t0
        of = f'/{self.total}' if self.total else ''
        eta = (f', about {elapsed * (self.total - self.done) / self.done:.0f} s left'
               if self.total and 0 < self.done < self.total else '')
        print(f'{self.desc}: {self.done}{of} {self.unit} in {elapsed:.0f} s{eta}', file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
