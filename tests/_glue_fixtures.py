"""GLUE-format fixture files written in a test's folder, in each task's real column layout (no download)."""
import random
from pathlib import Path
from typing import Dict, List

WORDS = ('the cat dog bird sat ran flew on under near a mat tree park quickly slowly red green small big "quoted '
         'it\'s every some').split()
MNLI_TRAIN_HEADER = ['index', 'promptID', 'pairID', 'genre', 'sentence1_binary_parse', 'sentence2_binary_parse',
                     'sentence1_parse', 'sentence2_parse', 'sentence1', 'sentence2', 'label1', 'gold_label']
MNLI_DEV_HEADER = MNLI_TRAIN_HEADER[:-1] + ['label2', 'label3', 'label4', 'label5', 'gold_label']
LABELS = {'cola': ['0', '1'], 'rte': ['entailment', 'not_entailment'], 'qnli': ['entailment', 'not_entailment'],
          'mnli': ['entailment', 'neutral', 'contradiction']}


def sentence(rng: random.Random, label: int) -> str:
    """Random words; the label shows as a marker word, so a model can learn it in a few steps."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 9))]
    words.insert(rng.randrange(len(words)), ('red', 'green', 'small')[label])
    return ' '.join(words)


def rows(task: str, n: int, seed: int, dev: bool = False) -> List[List[str]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        label = rng.randrange(len(LABELS[task]))
        name = LABELS[task][label]
        if task == 'cola':
            out.append(['gj04', name, '' if label else '*', sentence(rng, label)])
        elif task in ('rte', 'qnli'):
            out.append([str(i), sentence(rng, 0) + '?' * (task == 'qnli'), sentence(rng, label), name])
        else:
            a, b = sentence(rng, 0), sentence(rng, label)
            labels = [name] * (5 if dev else 1)
            out.append([str(i), str(1000 + i), f'{1000 + i}e', 'fiction', f'( {a} )', f'( {b} )', f'(ROOT {a})',
                        f'(ROOT {b})', a, b, *labels, name])
    return out


def header(task: str, dev: bool = False):
    return {'cola': None, 'rte': ['index', 'sentence1', 'sentence2', 'label'],
            'qnli': ['index', 'question', 'sentence', 'label'],
            'mnli': MNLI_DEV_HEADER if dev else MNLI_TRAIN_HEADER}[task]


def write_tsv(path: Path, head, body: List[List[str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ([head] if head else []) + body
    path.write_text(''.join('\t'.join(r) + '\n' for r in lines), encoding='utf-8')
    return path


def write_task(root: Path, task: str, n_train: int = 48, n_dev: int = 24) -> Path:
    """The task's folder as GLUE lays it out; returns it."""
    folder = root / {'cola': 'CoLA', 'rte': 'RTE', 'qnli': 'QNLI', 'mnli': 'MNLI'}[task]
    write_tsv(folder / 'train.tsv', header(task), rows(task, n_train, seed=1))
    devs: Dict[str, int] = {'dev_matched.tsv': 2, 'dev_mismatched.tsv': 3} if task == 'mnli' else {'dev.tsv': 2}
    for name, seed in devs.items():
        write_tsv(folder / name, header(task, dev=True), rows(task, n_dev, seed=seed, dev=True))
    return folder
