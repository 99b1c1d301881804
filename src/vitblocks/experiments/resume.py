"""Resuming a run on a cluster: ``resume=auto``, a checkpoint every rank can read (or one error on
every rank), the saved config checked against the resumed one."""
from pathlib import Path
from typing import Any, Dict, Optional

from .checkpoint import CheckpointError, load_checkpoint, newest_good_in_history
from .config import RESUME_CHANGEABLE, ConfigError, TrainConfig
from .distributed import gather_object, raise_on_every_rank

__all__ = ['auto_resume_checkpoint', 'load_on_every_rank']


def auto_resume_checkpoint(run_dir: Path) -> Optional[Path]:
    """``resume=auto``: the run's last.pth if every process sees it, None if none does (a new run),
    and the same error on every rank if only some do (no shared file system)."""
    last = Path(run_dir) / 'last.pth'
    seen = gather_object(last.is_file())
    if all(seen):
        return last
    have = [rank for rank, found in enumerate(seen) if found]
    error = None if last.is_file() or not have else (
        f'resume=auto: {last} exists for rank(s) {have} but not here; put the run folder on a file system '
        f'every node shares, or copy it to each node')
    raise_on_every_rank(error, CheckpointError)
    return None


def load_on_every_rank(resume: Optional[Path], cfg: TrainConfig) -> Optional[Dict[str, Any]]:
    """The checkpoint at ``resume`` (None: a new run), or the same CheckpointError on every rank if
    any rank cannot read its copy. Under ``resume=auto`` the command's config must match the saved
    one except in the keys a resume may change."""
    ckpt, error = None, None
    if resume is not None:
        try:
            ckpt = load_checkpoint(resume)
        except CheckpointError as e:
            error = str(e)
            fallback = newest_good_in_history(Path(resume).parent) if Path(resume).name == 'last.pth' else None
            if fallback is not None:  # checkpoint_hist: the newest copy that is whole (every rank finds the same)
                print(f'{error}\nresuming from {fallback[0]} instead (the newest good copy in its history)',
                      flush=True)
                ckpt, error = fallback[1], None
    raise_on_every_rank(error, CheckpointError)
    if ckpt is not None and cfg.resume == 'auto':
        old, new = ckpt.get('config', {}), cfg.to_dict()
        changed = sorted(k for k in old if k in new and k not in RESUME_CHANGEABLE and old[k] != new[k])
        if changed:
            raise ConfigError(f'resume=auto: {resume} was trained with other settings of '
                              f'{", ".join(f"{k} ({old[k]!r} -> {new[k]!r})" for k in changed)}; only '
                              f'{", ".join(sorted(RESUME_CHANGEABLE))} may change on resume. Use another '
                              f'--name, or restore those values')
    return ckpt
