"""``python -m vitblocks.experiments CONFIG.yaml [--resume]``: run (or resume) a training run from
one resolved config file, e.g. a run folder's ``config.yaml``. Meant for launchers such as
``torchrun --nproc_per_node 2 -m vitblocks.experiments run.yaml`` and cluster job scripts;
``vitblocks train`` is the interactive front end."""
import argparse
import sys
from pathlib import Path

from ..data import DataError
from .checkpoint import CheckpointError
from .config import ConfigError, load_config
from .distributed import launched_rank, shutdown
from .engine import LostProcess, TrainingDiverged, default_run_name, train
from .interrupt import TrainingInterrupted


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog='python -m vitblocks.experiments', description=__doc__)
    p.add_argument('config', help='a full config YAML (e.g. runs/NAME/config.yaml)')
    p.add_argument('--resume', action='store_true', help='continue the run (its folder: --run-dir, else output/name '
                   'from CONFIG) from its last.pth')
    p.add_argument('--run-dir', help='run folder (default: output/name from the config)')
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
        run_dir = Path(args.run_dir) if args.run_dir else None
        resume = None
        if args.resume:
            resume = (run_dir or Path(cfg.output) / (cfg.name or default_run_name(cfg))) / 'last.pth'
        result = train(cfg, run_dir=run_dir, resume=resume)
    except (ConfigError, DataError, CheckpointError, TrainingDiverged, LostProcess) as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
    except TrainingInterrupted as e:
        print(f'stopped by {e}', file=sys.stderr)
        return 130
    finally:
        shutdown()  # the process group, before the interpreter tears down gloo's threads (distributed.py)
    if result.final is not None and launched_rank() == 0:  # one summary per run, not one per process
        print(f'{result.run_dir}: top-1 {result.final.top1:.2f}% after {result.global_step} steps')
    return 0


if __name__ == '__main__':
    sys.exit(main())
