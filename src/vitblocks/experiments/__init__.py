"""Training and evaluation on real data: config and recipes, the training loop (exact resume,
DDP, AMP), evaluation, run folders (checkpoints, metrics.csv, TensorBoard) and plots. The papers'
own harnesses (a table's reproduction, the blocks benchmark, runs inside a time limit) are in
``vitblocks.reproduce``.

    >>> from vitblocks.experiments import merge, load_recipe, train
    >>> cfg = merge(load_recipe('ninformer'), {'model': 'vit_tiny_patch16_224', 'data': 'path/to/mnist'})
    >>> result = train(cfg)            # writes runs/<name>/{config.yaml,last.pth,best.pth,metrics.csv,...}
"""
from .checkpoint import CheckpointError, load_checkpoint, load_model_weights, save_checkpoint
from .config import (ConfigError, TrainConfig, list_recipes, load_config, load_recipe, merge, parse_overrides,
                     recipe_path)
from .engine import LostProcess, RunResult, Trainer, TrainingDiverged, default_run_name, train
from .evaluate import EvalResult, evaluate
from .interrupt import TrainingInterrupted

__all__ = ['TrainConfig', 'ConfigError', 'merge', 'load_recipe', 'list_recipes', 'recipe_path', 'parse_overrides',
           'load_config', 'train', 'Trainer', 'RunResult', 'TrainingDiverged', 'LostProcess', 'default_run_name',
           'evaluate', 'EvalResult', 'TrainingInterrupted', 'CheckpointError', 'save_checkpoint', 'load_checkpoint',
           'load_model_weights']
