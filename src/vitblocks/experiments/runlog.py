"""What a run writes besides checkpoints: metrics.csv, TensorBoard events, progress on the terminal."""
import csv
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

__all__ = ['MetricsLog', 'Progress', 'read_metrics', 'remove_stale_temporaries', 'METRIC_COLUMNS', 'write_stop_record',
           'read_stop_record', 'read_json', 'write_json', 'STOP_RECORD']

# one row per log interval (split=train) and per evaluation (split=val / val_ema)
METRIC_COLUMNS = ['step', 'epoch', 'split', 'loss', 'top1', 'top5', 'lr', 'images_per_s', 'elapsed_s']


class MetricsLog:
    """Appends rows to ``metrics.csv`` (and TensorBoard scalars when the package is installed).

    ``truncate_after(step)`` drops rows written after a checkpoint, so a resumed run's file has
    each step once, as an uninterrupted run's would; ``fresh=True`` (a run starting from step 0)
    drops every row a killed earlier attempt left. An evaluation row for a (step, split) that is
    already in the file replaces it (a finished run resumed re-evaluates its last step). ``columns``: the file's
    columns, starting with step, epoch, split (another trainer's metrics, e.g. GLUE's accuracy and Matthews
    correlation).
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, fresh: bool = False,
                 columns: Sequence[str] = tuple(METRIC_COLUMNS)):
        self.path = run_dir / 'metrics.csv'
        self.columns = list(columns)
        if fresh or not self.path.exists():
            with open(self.path, 'w', newline='') as f:
                csv.writer(f).writerow(self.columns)
        self.tb = None
        self.tb_note = ''
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(log_dir=str(run_dir / 'tensorboard'))
            except ImportError:  # torch's writer needs the optional `tensorboard` package
                self.tb_note = 'TensorBoard logging off: `pip install tensorboard` to enable it'

    def truncate_after(self, step: int) -> None:
        self._rewrite([r for r in read_metrics(self.path) if int(r['step']) <= step])

    def _rewrite(self, rows: List[Dict[str, str]]) -> None:
        tmp = self.path.with_suffix('.csv.tmp')
        with open(tmp, 'w', newline='') as f:
            w = csv.DictWriter(f, self.columns)
            w.writeheader()
            w.writerows(rows)
        os.replace(tmp, self.path)

    def write(self, step: int, epoch: float, split: str, **values: Optional[float]) -> None:
        row = {'step': step, 'epoch': f'{epoch:.4f}', 'split': split}
        for k in self.columns[3:]:
            v = values.get(k)
            row[k] = '' if v is None else f'{v:.6g}'
        rows = read_metrics(self.path) if split != 'train' else []
        same = [i for i, r in enumerate(rows) if r['split'] == split and int(r['step']) == step]
        if same:  # re-evaluated at the same step (a finished run resumed): one row per evaluation
            rows[same[0]] = {k: str(v) for k, v in row.items()}
            self._rewrite(rows)
        else:
            with open(self.path, 'a', newline='') as f:
                csv.DictWriter(f, self.columns).writerow(row)
        if self.tb is not None:
            for k, v in values.items():
                if v is not None and k != 'elapsed_s':
                    self.tb.add_scalar(f'{split}/{k}', v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def remove_stale_temporaries(run_dir: Path) -> List[Path]:
    """Delete the temporary files of writes a killed process left (``.last.pth.*.tmp`` from
    ``save_checkpoint``, ``metrics.csv.tmp``, ``results.json.tmp``, ``config.yaml.tmp``, ``.curves.png.tmp``
    from ``png_figure``); returns what was removed.
    Call it only while no other process writes into ``run_dir``."""
    patterns = ('.*.pth.*.tmp', '*.csv.tmp', '*.json.tmp', '*.yaml.tmp', '.*.png.tmp')
    stale = [p for pattern in patterns for p in run_dir.glob(pattern)]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


STOP_RECORD = 'stopped.json'


def write_stop_record(run_dir: Path, reason: str, message: str, **fields) -> None:
    """Record in ``run_dir/stopped.json`` why a run stopped before its end: ``reason`` is 'diverged'
    (non-finite loss), 'interrupted' (SIGINT/SIGTERM, ``last.pth`` saved at that step) or 'error' (any
    other exception). Written atomically; a run that starts or resumes in the folder removes it, so it
    describes the last attempt only, and a finished run (``results.json``) has none."""
    record = {'reason': reason, 'message': message, 'time': time.strftime('%Y-%m-%dT%H:%M:%S%z'), **fields}
    write_json(run_dir / STOP_RECORD, record)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` through ``<path>.tmp`` and a rename, so a reader never sees half a file (a killed
    write leaves only the ``.tmp`` that ``remove_stale_temporaries`` deletes)."""
    tmp = path.with_name(path.name + '.tmp')
    try:
        tmp.write_text(text, encoding='utf-8')
        os.replace(tmp, path)
    except BaseException:  # a full disk, a kill: no half-written .tmp left beside the file, which stays as it was
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, obj) -> None:
    """Write ``obj`` as JSON, atomically (``write_text_atomic``)."""
    write_text_atomic(path, json.dumps(obj, indent=1))


def read_json(path: Path):
    """The JSON object in ``path``, or None if there is no such file or it is unreadable (cut short by a kill
    before writes went through ``write_json``, or damaged)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_stop_record(run_dir: Path) -> Optional[Dict]:
    """The stop record of ``run_dir`` (see ``write_stop_record``), or None if it has none or it is unreadable."""
    record = read_json(Path(run_dir) / STOP_RECORD)
    return record if isinstance(record, dict) and 'reason' in record else None


def read_metrics(path: Path) -> List[Dict[str, str]]:
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux: from /proc), or None where that cannot be read. A run's log
    says how long it took to start and to finish its first step (decoding data, building and compiling)."""
    try:
        with open('/proc/self/stat') as f:
            start_ticks = int(f.read().rsplit(')', 1)[1].split()[19])  # field 22, starttime (fields from 3 on)
        with open('/proc/uptime') as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf('SC_CLK_TCK'))
    except (OSError, ValueError, IndexError):
        return None


class Progress:
    """A tqdm bar per epoch (images/s and ETA), or a log line every ``log_interval`` steps when
    stderr is not a terminal (``mode='auto'``), or nothing. ``unit``: what a batch counts (images, or a text
    task's examples)."""

    def __init__(self, mode: str, enabled: bool, total_steps: int, batch_images: int, unit: str = 'img'):
        if mode == 'auto':
            mode = 'bar' if sys.stderr.isatty() else 'log'
        self.mode = mode if enabled else 'none'
        self.total_steps, self.batch_images = total_steps, batch_images
        self.unit = unit
        self.bar = None
        self._t0 = self._steps0 = None

    def start_epoch(self, epoch: int, epochs: int, start: int, steps: int) -> None:
        if self.mode == 'bar':
            from tqdm import tqdm
            self.bar = tqdm(total=steps * self.batch_images, initial=start * self.batch_images, unit=self.unit,
                            unit_scale=True, desc=f'epoch {epoch + 1}/{epochs}', dynamic_ncols=True, leave=True)

    def update(self, step: int, epoch_step: int, loss: Callable[[], float], lr: float) -> None:
        """``loss``: called every 10th step in bar mode only (it may sync the device)."""
        if self.bar is not None:
            self.bar.update(self.batch_images)
            if epoch_step % 10 == 0:
                self.bar.set_postfix(loss=f'{loss():.4f}', lr=f'{lr:.2e}', refresh=False)
        if self._t0 is None:  # throughput and ETA from the first step of this process on
            self._t0, self._steps0 = time.perf_counter(), step

    def log_line(self, step: int, epoch: float, loss: float, lr: float) -> Optional[float]:
        """Images/s since the start of this process; prints a line in 'log' mode."""
        if self._t0 is None or step <= self._steps0:
            return None
        elapsed = time.perf_counter() - self._t0
        rate = (step - self._steps0) * self.batch_images / elapsed
        if self.mode == 'log':
            eta = (self.total_steps - step) * self.batch_images / rate
            print(f'step {step}/{self.total_steps} epoch {epoch:.2f} loss {loss:.4f} lr {lr:.3g} '
                  f'{rate:.1f} {self.unit}/s ETA {_fmt_time(eta)}', file=sys.stderr, flush=True)
        return rate

    def end_epoch(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def message(self, text: str) -> None:
        if self.mode == 'none':
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return '?'
    s = int(seconds)
    return f'{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}'
