"""Fine-tuning Hugging Face ``transformers`` classifiers (vanilla, or with a vitblocks FFN swapped in) on a GLUE
task's own TSV files (CoLA, RTE, MNLI, QNLI), offline: ``vitblocks glue`` on the command line.

    >>> from vitblocks.glue import GlueConfig, fine_tune
    >>> cfg = GlueConfig(task='cola', data='glue_data/CoLA', model='path/to/bert-base-uncased')
    >>> result = fine_tune(cfg, 'runs/glue-cola')      # result.final['dev']['matthews']

``transformers`` and ``tokenizers`` (the ``hf`` extra) are imported when a run starts, not with this package.
"""
from .config import GlueConfig
from .finetune import GlueResult, GlueRun, fine_tune
from .metrics import accuracy, matthews_corrcoef
from .tasks import TASKS, GlueDataError, GlueSplit, GlueTask, get_task, read_split, read_task
from .text_models import PRESETS, GlueModelError, train_wordpiece

__all__ = ['GlueConfig', 'GlueRun', 'GlueResult', 'fine_tune', 'accuracy', 'matthews_corrcoef', 'TASKS',
           'GlueTask', 'GlueSplit', 'GlueDataError', 'GlueModelError', 'get_task', 'read_split', 'read_task',
           'PRESETS', 'train_wordpiece']
