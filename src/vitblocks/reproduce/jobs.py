"""Several training runs at once, each in its own process, optionally inside a wall-clock limit.

``run_jobs`` starts the runs (``parallel`` at once) and waits for them. With ``time_limit`` it also
keeps them inside that many seconds. It reads each run's pace from its own ``metrics.csv`` over the
last ``window`` seconds (once the run has gone two) and projects when the runs end if they share
the device equally (``shared_finish``). While that is after the limit, it pauses the run furthest
from its end, of those of the lowest ``Job.priority`` (SIGINT: the run saves ``last.pth`` at its next
step and exits 130), one run at a time, judging again only on a pace measured after the change (a
``window`` after any run started or ended), so the runs left finish sooner. When a run ends sooner
than projected, a paused run resumes from its checkpoint (once) if it is then projected to fit. At
the limit, the runs still going are paused.

Why: N runs sharing one GPU each get about 1/N of it, so a set of runs that needs more time than the
machine has would otherwise end with every run 90% done; where the checkpoints cannot outlive the
machine (a GPU job with a time limit, a preemptible node) that is nothing. Pausing the longest runs first
finishes as many runs as the time allows.
"""
import contextlib
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import yaml

from ..experiments.runlog import read_metrics

__all__ = ['Job', 'JobsReport', 'run_jobs', 'remaining_seconds', 'shared_finish', 'run_to_pause', 'time_limit_window']

PAUSED_EXIT = 130  # a run stopped by SIGINT after saving its checkpoint (`vitblocks train` / `reproduce`)
STOP_GRACE = 120  # seconds a run may take to save and stop once the time limit is reached


@dataclass
class Job:
    """One run: its display name, the command that trains (or resumes) it, where its output goes, and its
    run folder (whose ``metrics.csv`` and ``config.yaml`` give its pace and its last step)."""
    name: str
    argv: List[str]
    log: Path
    run_dir: Path
    priority: int = 0  # under a time limit, runs of higher priority are paused last


@dataclass
class JobsReport:
    failed: List[Job] = field(default_factory=list)       # exited with an error: see their logs
    paused: List[Job] = field(default_factory=list)       # stopped for the time limit, checkpoint kept
    not_started: List[Job] = field(default_factory=list)  # never started: the limit came first


def _progress_rows(run_dir: Path):
    """(step, epoch, elapsed_s) of each complete row of ``metrics.csv``; a row being written is skipped."""
    try:
        rows = read_metrics(run_dir / 'metrics.csv')
    except OSError:
        return []
    out = []
    for r in rows:
        try:
            out.append((int(r['step']), float(r['epoch']), float(r['elapsed_s'])))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def _total_steps(run_dir: Path, rows) -> Optional[int]:
    """The run's last step: ``epochs`` x steps per epoch (from its latest row's step / epoch), capped by
    ``max_steps``, from its ``config.yaml``."""
    try:
        cfg = yaml.safe_load((run_dir / 'config.yaml').read_text())
    except (OSError, yaml.YAMLError):
        return None
    step, epoch, _ = max(rows)
    if not isinstance(cfg, dict) or epoch <= 0:
        return None
    total = round(cfg.get('epochs', 0) * round(step / epoch))
    return min(total, cfg['max_steps']) if cfg.get('max_steps') else total


def remaining_seconds(run_dir: Path, after_step: int = 0, window: float = 60.0) -> Optional[float]:
    """Seconds the run in ``run_dir`` needs to reach its last step at the pace of its last ``window``
    seconds of ``metrics.csv`` rows after ``after_step`` (the step its current attempt started from);
    None until those rows span two windows (the first is the attempt's warm-up)."""
    rows = sorted(r for r in _progress_rows(run_dir) if r[0] > after_step)  # this attempt's rows
    if len(rows) < 2:
        return None
    step, _, elapsed = rows[-1]
    if elapsed - rows[0][2] < 2 * window:
        return None  # an attempt's first window is its warm-up (the evaluation's compilation, caches)
    start_step, _, start_elapsed = [r for r in rows if r[2] <= elapsed - window][-1]
    total = _total_steps(run_dir, rows)
    if step <= start_step or total is None:
        return None
    return max(0, total - step) * (elapsed - start_elapsed) / (step - start_step)


def shared_finish(projected: Dict[str, Optional[float]], sharing: int) -> float:
    """Seconds until the last of these runs ends if ``sharing`` runs keep sharing one device equally.
    Each projection (at the pace of ``sharing`` runs going) is ``sharing`` times the run's time alone,
    and with equal shares the last run ends when all their times alone have passed: their sum. Runs
    without a projection (None) count for nothing."""
    return sum(s for s in projected.values() if s is not None) / max(1, sharing)


def run_to_pause(projected: Dict[str, Optional[float]], seconds_left: float,
                 priority: Optional[Dict[str, int]] = None) -> Optional[str]:
    """The run to pause: None if the runs (sharing one device, ``shared_finish``) all end within
    ``seconds_left``; else, of the runs of lowest ``priority`` (default 0), the one furthest from its
    end (shortest-first finishes the most runs). Where the runs do not take turns but run side by side (CUDA
    MPS, several devices), the projection is optimistic (the last run ends at the largest projection, not at
    their mean), so it pauses less than it would under equal sharing, and only while some run would miss the
    limit."""
    known = {name: s for name, s in projected.items() if s is not None}
    if not known or shared_finish(projected, len(projected)) <= seconds_left:
        return None
    priority = priority or {}
    return max(known, key=lambda name: (-priority.get(name, 0), known[name]))


def time_limit_window(time_limit: float) -> float:
    """The pace window (and the pause between decisions) for a time limit: a twentieth of it, 1-60 s."""
    return min(60.0, max(1.0, time_limit / 20))


@dataclass
class _Running:
    job: Job
    proc: subprocess.Popen
    started: float        # clock() at launch
    after_step: int       # the run's last step before this attempt
    first_row: Optional[float] = None  # clock() when this attempt wrote its first row (startup done)
    pausing: bool = False


@dataclass
class _Paused:
    job: Job
    alone: float          # seconds it would need with the device to itself (projected when paused)
    startup: float        # seconds its attempt took to write its first row


def _last_step(run_dir: Path) -> int:
    rows = _progress_rows(run_dir)
    return max(r[0] for r in rows) if rows else 0


class _Pool:
    """The state of ``run_jobs``: runs waiting, going and paused, and the decisions of the time limit."""

    def __init__(self, jobs: List[Job], parallel: int, threads: int, time_limit: Optional[float],
                 window: float, echo: Callable[[str], None], clock: Callable[[], float]):
        self.pending, self.running, self.report = list(jobs), [], JobsReport()
        self.parallel, self.threads, self.time_limit, self.window = parallel, threads, time_limit, window
        self.echo, self.clock = echo, clock
        self.deadline = None if time_limit is None else clock() + time_limit
        self.next_decision = clock() + window
        self.resumable: List[_Paused] = []  # paused once, may resume once
        self.resumed = set()                # names of the runs resumed already

    def launch(self, job: Job, resumed: bool = False) -> None:
        job.log.parent.mkdir(parents=True, exist_ok=True)
        with open(job.log, 'a') as f:  # appended: a resumed run keeps the log of its first part
            proc = subprocess.Popen(job.argv + ['--threads', str(self.threads)], stdout=f, stderr=subprocess.STDOUT)
        self.running.append(_Running(job, proc, self.clock(), _last_step(job.run_dir)))
        self.next_decision = self.clock() + self.window
        self.echo(f'{"resumed" if resumed else "started"} {job.name} (log {job.log})')

    def pause(self, r: _Running, why: str) -> None:
        r.proc.send_signal(signal.SIGINT)
        r.pausing = True
        self.echo(f'pausing {r.job.name}: {why}; it saves its checkpoint, and re-running the command resumes it')

    def left(self) -> float:
        return self.deadline - self.clock()

    def step(self) -> None:
        """At the limit, pause the runs going and give up those waiting (and kill a run that has not
        stopped ``STOP_GRACE`` seconds later: its checkpoint file is written atomically); else start
        what may start."""
        if self.deadline is not None and self.left() <= 0:
            for r in self.running:
                if not r.pausing:
                    self.pause(r, f'the time limit ({self.time_limit:g} s) is reached')
                elif self.left() < -STOP_GRACE and r.proc.poll() is None:
                    r.proc.kill()
                    self.echo(f'killed {r.job.name}: still going {STOP_GRACE} s after the time limit')
            self.report.not_started += self.pending
            self.pending = []
        while self.pending and len(self.running) < self.parallel:
            self.launch(self.pending.pop(0))

    def collect(self) -> None:
        for r in list(self.running):
            if r.first_row is None and _last_step(r.job.run_dir) > r.after_step:
                r.first_row = self.clock()
            if r.proc.poll() is None:
                continue
            self.running.remove(r)
            self.next_decision = self.clock() + self.window  # judge the others on a pace without it
            code = r.proc.returncode
            if r.pausing and code in (PAUSED_EXIT, -signal.SIGINT):
                # -SIGINT: Python's own handler stopped it before the run set its handler (still importing or
                # decoding its data): it had not trained, and its last checkpoint, if any, is untouched
                self.report.paused.append(r.job)
                self.echo(f'paused {r.job.name}' + (' (stopped while starting, before its first step)'
                                                    if code != PAUSED_EXIT else ''))
                continue
            self.echo(f'finished {r.job.name}: exit {code}')
            if code != 0:
                self.report.failed.append(r.job)
            elif self.deadline is not None:
                self.resume_one()

    def resume_one(self) -> None:
        """A run finished: resume the paused run that needs least, if it and the runs going are projected
        to end within the limit (``shared_finish``, with its time alone when paused and its startup)."""
        waiting = [p for p in self.resumable if p.job in self.report.paused]
        if not waiting or len(self.running) >= self.parallel:
            return
        p = min(waiting, key=lambda p: p.alone)
        going, projected = self.projections()
        # the runs going were last measured beside the run that just ended
        if shared_finish(projected, len(going) + 1) + p.alone + p.startup < self.left():
            self.resumable.remove(p)
            self.resumed.add(p.job.name)
            self.report.paused.remove(p.job)
            self.launch(p.job, resumed=True)

    def projections(self):
        """The runs going (not being paused) and the seconds each is projected to need (``remaining_seconds``)."""
        going = [r for r in self.running if not r.pausing]
        return going, {r.job.name: remaining_seconds(r.job.run_dir, r.after_step, self.window) for r in going}

    def decide(self) -> None:
        """Pause the run furthest from its end while the runs are projected to end after the limit."""
        if self.deadline is None or self.clock() < self.next_decision or any(r.pausing for r in self.running):
            return  # (a run being paused still holds its share until it has saved and exited)
        self.next_decision = self.clock() + self.window
        going, projected = self.projections()
        name = run_to_pause(projected, self.left(), {r.job.name: r.job.priority for r in going})
        if name is None:
            return
        r = next(r for r in going if r.job.name == name)
        among = ' of the runs of its priority' if len({g.job.priority for g in going}) > 1 else ''
        runs = f'{len(going)} runs going are' if len(going) > 1 else 'run going is'
        self.pause(r, f'the {runs} projected to need {shared_finish(projected, len(going)):.0f} s '
                      f'more, {max(0.0, self.left()):.0f} s are left of the time limit, and it needs the most{among} '
                      f'({projected[name]:.0f} s at the current pace)')
        if r.job.name not in self.resumed:  # a run is resumed once at most: a second pause is final
            startup = (r.first_row or self.clock()) - r.started
            self.resumable.append(_Paused(r.job, projected[name] / len(going), startup))


@contextlib.contextmanager
def _sigint_reaches_the_runs():
    """While the pool runs, SIGINT is not ignored. A process started by a shell script's ``cmd &`` inherits
    SIGINT ignored (bash ignores it in background commands without job control; scripts/gpu_job.sh starts
    its rechecks so), and so would every run it starts. A run sets its own handler once it starts training,
    but before that (importing torch, decoding its data) a pause could not stop it: it trained on until
    killed ``STOP_GRACE`` seconds after the limit. A signal with a handler is reset to its default action in
    an exec'd child, so Python's own handler here gives each run the default, and this process itself stops
    its runs on SIGINT (``KeyboardInterrupt``, below) like a foreground pool. Only the main thread can set it."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if not ignored or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_jobs(jobs: List[Job], parallel: int, threads: int, time_limit: Optional[float] = None,
             window: Optional[float] = None, poll: float = 1.0, echo: Callable[[str], None] = print,
             clock: Callable[[], float] = time.monotonic) -> JobsReport:
    """Run ``jobs``, ``parallel`` at once, each with ``--threads threads`` appended to its command and its
    output appended to its log; with ``time_limit`` (seconds from now), pause runs as the module says.
    Returns what did not finish. Interrupted itself, it stops its runs (each keeps its checkpoint)."""
    window = window or (time_limit_window(time_limit) if time_limit else 60.0)
    pool = _Pool(jobs, parallel, threads, time_limit, window, echo, clock)
    with _sigint_reaches_the_runs():
        try:
            while pool.pending or pool.running:
                pool.step()
                time.sleep(poll)
                pool.collect()
                pool.decide()
        finally:  # interrupted (or done): stop the runs still going; each keeps its last checkpoint
            for r in pool.running:
                r.proc.send_signal(signal.SIGINT)
            for r in pool.running:
                try:
                    r.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
    return pool.report
