"""Stop a run cleanly on SIGINT (Ctrl-C) or SIGTERM (``kill``, a cluster's time limit).

The handler only sets a flag; the training loop checks it after each optimizer step and after each
evaluation batch, saves ``last.pth`` there (a step boundary, so resuming is exact; a checkpoint saved
mid-evaluation records that evaluation as owed, and the resumed run runs it first) and raises
``TrainingInterrupted``, whose message is the command that resumes the run. A second SIGINT (Ctrl-C
twice) is not caught: it stops the process at once (the atomic checkpoint write keeps the previous
file). A repeated SIGTERM is ignored: a cluster delivers one preemption's SIGTERM more than once (SLURM
signals every process of the job step, torchrun forwards its own to its workers, ``scancel`` may be
repeated) and the escalation after the grace period is SIGKILL; dying at the second one would lose the
checkpoint the first one asked for.
"""
import signal
import threading
from pathlib import Path
from typing import Optional

__all__ = ['StopRequest', 'TrainingInterrupted']


class TrainingInterrupted(Exception):
    """The run was stopped by a signal after saving a checkpoint; the message says how to resume."""

    def __init__(self, signal_name: str, step: int, run_dir: Path, evaluation_owed: bool = False,
                 command: str = 'vitblocks train'):
        self.signal_name, self.step, self.run_dir = signal_name, step, run_dir
        self.evaluation_owed = evaluation_owed
        during, then = (' during its evaluation', ' (the resumed run evaluates first)') if evaluation_owed else ('', '')
        super().__init__(f'{signal_name} at step {step}{during}: saved {run_dir / "last.pth"}{then}; resume with: '
                         f'{command} --resume {run_dir}')


class StopRequest:
    """``with StopRequest() as stop:`` ... ``if stop.signal_name: <save and stop>``."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signal_name: Optional[str] = None
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
        if signal.SIGINT in self._previous:  # a second Ctrl-C acts as it would without us; SIGTERM stays ours
            signal.signal(signal.SIGINT, self._previous[signal.SIGINT])

    def __enter__(self) -> 'StopRequest':
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
