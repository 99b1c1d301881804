"""Every command example of README.md and docs/cli.md runs as written, and so does the README's
Python snippet: no traceback, exit code 0 (2 with exactly the documented line for the documented
error examples, which run by default; the others are marked slow). Budgets are cut (``BUDGET`` flags are
appended; the last value of a flag wins)
and dataset NAMES resolve to tiny stand-ins (``$VITBLOCKS_DATA``); the commands run in order in
one scratch folder, so a later example can use the run an earlier one made."""
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import timm
import torch

import vitblocks.cli as cli
from vitblocks.deploy.io import save_deployed
from vitblocks.profile import fixed_threads

from _train_helpers import tiny_dataset
from test_authors_checkpoints import _save_like_the_authors, repavit_state_dict

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / 'README.md', ROOT / 'docs' / 'cli.md')

# appended to each example of that command: a tiny budget, nothing else
BUDGET = {'bench': ['--repeats', '1', '--warmup', '0'],
          'train': ['--batch-size', '8', '--max-steps', '2', 'val_subset=8', '--threads', '1'],
          'train --resume': ['--threads', '1'],  # a resumed run keeps its batch size and budget
          'eval': ['val_subset=8', '--threads', '1'],
          'reproduce': ['--max-steps', '1', '--test-subset', '8', '--jobs', '1']}


def examples(path: Path):
    """(command, documented error line or None, shell steps before it) for each `$ vitblocks ...` /
    `vitblocks ...` line of a
    fenced block (with its backslash continuations) and the first `vitblocks ...` inline span of each
    paragraph ending in ':' (the docs' "command: output" convention)."""
    text = path.read_text(encoding='utf-8')
    found = []
    for block in re.findall(r'```[a-z]*\n(.*?)```', text, re.S):
        lines = block.splitlines()
        prompt = '$ ' if any(line.startswith('$ ') for line in lines) else ''  # else output lines are not commands
        shell = ''
        for i, line in enumerate(lines):
            if prompt and re.match(r'\$ (mv|cd|mkdir) ', line):  # e.g. `$ mv data/a data/b; cd elsewhere`
                shell = line[2:]
            if not re.match(re.escape(prompt) + r'vitblocks [a-z-]+( |$)', line):
                continue
            cmd, j = line.removeprefix('$ '), i
            while cmd.endswith('\\'):
                j += 1
                cmd = cmd[:-1] + ' ' + lines[j].strip()
            following = lines[j + 1] if j + 1 < len(lines) else ''
            found.append((cmd, following if re.match(r'vitblocks [a-z]+: error:', following) else None, shell))
            shell = ''
    for para in re.split(r'\n\s*\n', re.sub(r'```.*?```', '', text, flags=re.S)):  # "`vitblocks ...` (note):"
        span = re.search(r'`(vitblocks [a-z][^`]*)`', para)
        if span and para.rstrip().endswith(':'):
            found.append((span.group(1), None, ''))
    return [(c, e, sh) for c, e, sh in found if '...' not in c and not re.search(r'\b[A-Z]{3,}\b', c)]


def run_shell(steps: str) -> None:
    """The few shell steps the docs show between commands: mv, mkdir, cd (into a new folder too)."""
    for step in filter(None, (s.strip() for s in steps.split(';'))):
        word, *args = shlex.split(step)
        if word == 'mv':
            shutil.move(args[0], args[1])
        elif word in ('cd', 'mkdir'):
            os.makedirs(args[-1], exist_ok=True)
            if word == 'cd':
                os.chdir(args[0])


# the documented error examples are instant and run by default; the others build and run models
# (all of them together take minutes on a busy 2-core CPU): `make test-all`
CASES = [pytest.param(cmd, err, shell, id=f'{path.name}:{cmd[:60]}', marks=[] if err else [pytest.mark.slow])
         for path in DOCS for cmd, err, shell in examples(path)]


@pytest.fixture(scope='module')
def scratch(tmp_path_factory):
    """A working folder (with data/mnist-small), and tiny MNIST/CIFAR-10 stand-ins under $VITBLOCKS_DATA."""
    root, work = tmp_path_factory.mktemp('data'), tmp_path_factory.mktemp('work')
    mnist = dict(size=28, channels=1, num_classes=10, classes=[str(i) for i in range(10)])
    tiny_dataset(root / 'mnist', **mnist)
    tiny_dataset(work / 'data' / 'mnist-small', **mnist)
    tiny_dataset(root / 'cifar10', size=32, num_classes=10)
    # the `vitblocks convert` examples read a file in the layout and size of the authors' RePaViT-Tiny
    _save_like_the_authors(work, repavit_state_dict(dim=192, depth=12, patch=16, img=224, classes=1000),
                           'RePaViT_Tiny.pth')
    # the `vitblocks bench --weights` example reads a deployed 32 px, 10-class RePa-DeiT-Ti (docs/cli.md)
    save_deployed(timm.create_model('repa_deit_tiny_patch16_224', img_size=32, num_classes=10),
                  work / 'repa_t32.safetensors')
    return work, root, {'cwd': work}


def test_the_docs_have_examples():
    assert len(CASES) >= 12


@pytest.mark.parametrize('command, documented_error, shell', CASES)
def test_documented_command_runs(command, documented_error, shell, scratch, monkeypatch, capsys):
    work, data_root, state = scratch
    monkeypatch.chdir(state['cwd'])  # where the previous example left off (`cd` in the docs)
    monkeypatch.setenv('VITBLOCKS_DATA', str(data_root))
    run_shell(shell)
    state['cwd'] = Path.cwd()
    argv = shlex.split(command.replace('/path/to/data', str(data_root)))[1:]
    argv += BUDGET.get(' '.join(argv[:2]), BUDGET.get(argv[0], []))
    # mallopt would change this test process for good; tests/test_allocator.py runs it in a child process
    monkeypatch.setattr('vitblocks.cli.bench.steady_malloc', lambda: 'as in the docs')
    with fixed_threads(1):
        code = cli.main(argv)  # an uncaught exception fails the test with its traceback
    out, err = capsys.readouterr()
    if documented_error is not None:
        assert code == 2 and err.strip() == documented_error, err
    elif '--device cuda' in command and not torch.cuda.is_available():
        assert code == 2 and len(err.strip().splitlines()) == 1 and 'CUDA' in err, err
    else:
        assert code == 0, err
    assert 'Traceback' not in err


def test_readme_python_snippet_runs():
    text = DOCS[0].read_text(encoding='utf-8')
    (snippet,) = re.findall(r'```python\n(.*?)```', text, re.S)
    scope = {}
    with fixed_threads(1):
        exec(compile(snippet, 'README.md', 'exec'), scope)
    model = scope['model']
    assert scope['n'] == 12
    # the last line counts at the size the model was built for (256x192), not the pretrained 224x224
    assert scope['count_macs'](model).total == scope['count_macs'](model, input_size=(3, 256, 192)).total
