"""Run the command line on a list of bad inputs and write what each gets into docs/cli.md.

    python scripts/cli_fuzz_table.py            # print the markdown table
    python scripts/cli_fuzz_table.py --write    # replace the table between the fuzz markers of docs/cli.md

Every case runs in this process through ``vitblocks.cli.main`` against a tiny synthetic dataset
and a 2-step run made here (temporary folders, shown as DATA, OTHER, RUN, FILE in the table). The
script fails (exit 1) if any case prints a traceback, more than one line, or exits with code 0.
"""
import argparse
import contextlib
import io
import json
import shlex
import shutil
import sys
import tarfile
import tempfile
import traceback
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vitblocks.cli import main
from vitblocks.experiments import merge, train

DOC = Path(__file__).resolve().parents[1] / 'docs' / 'cli.md'
START, END = '<!-- fuzz-table:start (scripts/cli_fuzz_table.py --write) -->', '<!-- fuzz-table:end -->'
TINY = "'model_kwargs={img_size: 8, patch_size: 4, embed_dim: 16, depth: 1, num_heads: 2}'"
TRAIN = 'train --model vit_tiny_patch16_224 --data DATA --batch-size 8 --output RUNS ' + TINY

CASES = [  # (what, command line with placeholders, extra setup)
    ('unknown optimizer', f'{TRAIN} opt=adamx'),
    ('scheduler typo', f'{TRAIN} sched=cosin'),
    ('not a number', f'{TRAIN} seed=abc'),
    ('out of range', f'{TRAIN} smoothing=1.5'),
    ('probability > 1', f'{TRAIN} hflip=2.0'),
    ('misspelt choice', f'{TRAIN} interpolation=bicubik'),
    ('auto_augment timm would ignore', f'{TRAIN} auto_augment=rand-xyz'),
    ('not a boolean', f'{TRAIN} model_ema=maybe'),
    ('unknown device', f'{TRAIN} --device tpu'),
    ('unknown key', f'{TRAIN} epochz=3'),
    ('output under a file', f'{TRAIN} --output FILE/runs'),
    ('subset larger than the data', f'{TRAIN} --train-subset 1000'),
    ('fixed-size model, other input size', f'{TRAIN} input_size=[3,16,16]'),
    ('change the recipe on resume', 'train --resume RUN --lr 0.5'),
    ('resume with --name', 'train --resume RUN --name other'),
    ('resume on other data', 'train --resume RUN --data OTHER'),
    ('resume after config.yaml was cut short', 'train --resume TRUNCATED'),
    ('malformed run config.yaml', 'train --resume MALFORMED'),
    ('checkpoint with a flipped byte', 'eval --checkpoint FLIPPED --data DATA'),
    ('empty checkpoint', 'eval --checkpoint EMPTY --data DATA'),
    ('checkpoint of other classes', 'eval --checkpoint RUN/last.pth --data OTHER'),
    ('split the data lacks', 'eval --checkpoint RUN/last.pth --data DATA --split val'),
    ('unwritable --json (before evaluating)', 'eval --checkpoint RUN/last.pth --data DATA --json FILE/r.json'),
    ('a key only training reads', 'eval --checkpoint RUN/last.pth --data DATA lr=3 mixup=0.8'),
    ('training augmentation of a robustness set', 'eval --checkpoint RUN/last.pth --data DATA --robustness '
                                                  'imagenet-r --train-augment 3'),
    ('empty metrics.csv', 'plot EMPTYMETRICS --no-latency'),
    ('unwritable plot folder', 'plot RUN --output FILE/figs --no-latency'),
    ('IFFN num_functions=0', 'profile iffn_deit_tiny_patch16_224 --block-cfg num_functions=0'),
    ('IFFN kernel_size=true', 'profile iffn_deit_tiny_patch16_224 --block-cfg kernel_size=true'),
    ('NiNformer token_mlp_dim=0', 'profile ninformer_vit_patch4_28 --block-cfg token_mlp_dim=0'),
    ('fixed-size model, other input size', 'profile deit_tiny_patch16_224 --input-size 3 64 64'),
    ('three numbers for --img-size', 'profile deit_tiny_patch16_224 --img-size 1 2 3'),
    ('two sources of weights', 'export deit_tiny_patch16_224 --weights a.safetensors --checkpoint RUN/last.pth '
                               '--format onnx --out OUT.onnx'),
    ('contradictory flags', 'bench deit_tiny_patch16_224 --reparam --train'),
    ('compile mode without --compile', 'bench deit_tiny_patch16_224 --compile-mode max-autotune'),
    ('format and file name disagree', 'export deit_tiny_patch16_224 --format pt2 --out OUT.onnx'),
    ('unknown model', 'profile deit_tiny_patch16'),
    ('not a finite number', f'{TRAIN} --lr nan'),
    ('a flag and its KEY=VALUE disagree', f'{TRAIN} --epochs 1 epochs=5'),
    ('unknown model (before the data is read)', 'train --model nosuch --data DATA --output RUNS'),
    ('a paper table list with no table', 'compare --paper iffn --tables ,'),
    ('latency options with --no-latency', 'plot RUN --no-latency --repeats 3'),
    ('plot in a missing folder (before the analysis)', 'analyze entropy deit_tiny_patch16_224 --out NOSUCH/e.png'),
    ('data that breakdown would not use', 'analyze breakdown deit_tiny_patch16_224 --data DATA'),
    ('convert to a path under a file (before reading SRC)',
     'convert RUN/last.pth FILE/c.safetensors --model deit_tiny_patch16_224'),
]


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format='PNG')
    return buf.getvalue()


def tiny_shards(folder: Path, classes, n_train: int = 64, n_test: int = 16) -> Path:
    """8x8 RGB WebDataset shards with a MANIFEST.json naming ``classes``."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    manifest = {'classes': list(classes), 'splits': {}}
    for split, n in (('train', n_train), ('test', n_test)):
        name = f'tiny-{split}-0000.tar'
        with tarfile.open(folder / name, 'w') as tf:
            for i in range(n):
                for suffix, data in (('cls', str(i % len(classes)).encode()),
                                     ('png', _png(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)))):
                    info = tarfile.TarInfo(f'{split}_{i:04d}.{suffix}')
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        manifest['splits'][split] = {'num_samples': n, 'shards': [{'file': name, 'num_samples': n}]}
    (folder / 'MANIFEST.json').write_text(json.dumps(manifest))
    return folder


def fixtures(root: Path) -> dict:
    data = tiny_shards(root / 'data', ['a', 'b', 'c', 'd'])
    other = tiny_shards(root / 'other', ['cat', 'dog'], n_train=48)
    run = root / 'runs' / 'run'
    cfg = merge({'model': 'vit_tiny_patch16_224', 'data': str(data), 'batch_size': 8, 'max_steps': 2, 'epochs': 1,
                 'model_kwargs': {'img_size': 8, 'patch_size': 4, 'embed_dim': 16, 'depth': 1, 'num_heads': 2},
                 'progress': 'none', 'tensorboard': False, 'output': str(root / 'runs'), 'name': 'run'})
    train(cfg)
    places = {'DATA': data, 'OTHER': other, 'RUN': run, 'RUNS': root / 'new-runs', 'FILE': root / 'a-file'}
    places['FILE'].write_text('not a folder')
    for name, edit in (('TRUNCATED', lambda text: '\n'.join(text.splitlines()[:8]) + '\n'),
                       ('MALFORMED', lambda text: 'model: [unclosed\n'), ('EMPTYMETRICS', None)):
        places[name] = root / name.lower()
        shutil.copytree(run, places[name])
        if edit:
            cfg_file = places[name] / 'config.yaml'
            cfg_file.write_text(edit(cfg_file.read_text()))
        else:
            (places[name] / 'metrics.csv').write_text('')
    raw = bytearray((run / 'last.pth').read_bytes())
    head = torch.load(run / 'last.pth', weights_only=True)['model']['head.weight'].numpy().tobytes()
    raw[bytes(raw).find(head) + 3] ^= 0x40  # one bit inside a tensor: torch.load does not notice
    places['FLIPPED'] = root / 'flipped.pth'
    places['FLIPPED'].write_bytes(bytes(raw))
    places['EMPTY'] = root / 'empty.pth'
    places['EMPTY'].write_bytes(b'')
    places['OUT'] = root / 'out'
    return places


def substitute(text: str, places: dict) -> str:
    for name in sorted(places, key=len, reverse=True):
        text = text.replace(name, str(places[name]))
    return text


def unsubstitute(text: str, places: dict) -> str:
    for name, path in sorted(places.items(), key=lambda kv: len(str(kv[1])), reverse=True):
        text = text.replace(str(path), name)
    return text


def run_case(argv: str, places: dict):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(shlex.split(substitute(argv, places)))
        except BaseException:  # noqa: B902 - a traceback is exactly what this script looks for
            traceback.print_exc(file=err)
            code = 'traceback'
    return code, unsubstitute(err.getvalue().strip(), places)


def table(rows) -> str:
    def esc(s):
        return s.replace('|', '\\|')
    lines = ['| bad input | command | exit | what it prints (stderr) |', '| --- | --- | ---: | --- |']
    lines += [f'| {what} | `vitblocks {esc(argv.replace(TINY, "MODEL_KWARGS"))}` | {code} | {esc(err)} |'
              for what, argv, code, err in rows]
    return '\n'.join(lines)


def main_(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--write', action='store_true', help=f'replace the table in {DOC}')
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        places = fixtures(Path(tmp))
        rows = [(what, argv, *run_case(argv, places)) for what, argv in CASES]
    bad = [r for r in rows if r[2] != 2 or len(r[3].splitlines()) != 1]
    text = table(rows)
    if args.write:
        doc = DOC.read_text()
        if START not in doc or END not in doc:
            print(f'{DOC}: no fuzz-table markers ({START} ... {END})', file=sys.stderr)
            return 1
        DOC.write_text(doc[:doc.index(START) + len(START)] + '\n' + text + '\n' + doc[doc.index(END):])
        print(f'wrote {len(rows)} rows into {DOC}')
    else:
        print(text)
    for what, argv, code, err in bad:
        print(f'NOT ONE LINE / EXIT 2: {what}: exit {code}\n{err}', file=sys.stderr)
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main_())
