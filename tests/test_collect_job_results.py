"""scripts/collect_job_results.py: the Table 1 runs of a GPU job's state file into docs/results, checked on the runs of
a real GPU job."""
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
H100 = ROOT / 'docs/results/ninformer_table1_h100'
H100_UNFINISHED = ROOT / 'docs/results/ninformer_table1_h100_unfinished'
VIT = 'cifar10/ninformer_baseline_vit_patch4_32'
NIN_CIFAR, NIN_MNIST = 'cifar10/ninformer_vit_patch4_32', 'mnist/ninformer_vit_patch4_28'


def _copy_run(src: Path, dst: Path, up_to_epoch=None, seed=None):
    dst.mkdir(parents=True)
    for name in ('config.yaml', 'metrics.csv', 'results.json'):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    if up_to_epoch is not None:  # the same run, stopped earlier
        lines = (src / 'metrics.csv').read_text().splitlines()
        (dst / 'metrics.csv').write_text('\n'.join(lines[:1] + [r for r in lines[1:]
                                                                  if float(r.split(',')[1]) <= up_to_epoch]) + '\n')
    if seed is not None:
        cfg = yaml.safe_load((dst / 'config.yaml').read_text())
        (dst / 'config.yaml').write_text(yaml.safe_dump(dict(cfg, seed=seed), sort_keys=False))


def _collect(cwd: Path, *args):
    return subprocess.run([sys.executable, str(ROOT / 'scripts/collect_job_results.py'), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_a_job_state_file_lands_where_the_next_job_seeds_from(tmp_path):
    """Finished runs replace committed copies (an identical one is left alone); an unfinished run replaces a committed
    unfinished copy only if it got further; a seed group lands in its own folder; each folder gets its table; the
    state file's other members (the speed sweep) are not Table 1 runs and are left alone."""
    job = tmp_path / 'job'
    _copy_run(H100 / VIT, job / 'runs/gpu-t1' / VIT)  # reused in the job: as committed
    _copy_run(H100_UNFINISHED / NIN_CIFAR, job / 'runs/gpu-t1' / NIN_CIFAR)  # further than the committed copy
    _copy_run(H100_UNFINISHED / NIN_MNIST, job / 'runs/gpu-t1' / NIN_MNIST, up_to_epoch=40)  # less far
    _copy_run(H100 / VIT, job / 'runs/gpu-t1-seed1' / VIT, seed=1)  # a new finished group
    # evaluated in the job through its training augmentation (vitblocks eval --train-augment 3 --json)
    passes = [{'top1': v, 'top5': 99.0, 'loss': 1.0, 'num_images': 10000} for v in (61.5, 62.0, 62.5)]
    (job / 'runs/gpu-t1-seed1' / VIT / 'eval_train_augment.json').write_text(json.dumps(
        {'results': {'cifar10 [test]': {'top1': 64.07}}, 'train_augment': {'passes': passes, 'top1_mean': 62.0,
                                                                              'top1_std': 0.5}}))
    (job / 'runs/gpu-t1-env.txt').write_text('NVIDIA H100 80GB HBM3, 580.159.04\ntorch 2.11.0 timm 1.0.29\n')
    (job / 'runs/gpu-t1-cudatests.txt').write_text('..s.\n===== 31 passed, 1 skipped, 59 deselected in 95.1s =====\n')
    (job / 'runs/gpu_speed/fp32-eager-b1').mkdir(parents=True)
    (job / 'runs/gpu_speed/fp32-eager-b1/deit_tiny.json').write_text('[]')
    with tarfile.open(tmp_path / 'gpu_job_state.tgz', 'w:gz') as tar:
        tar.add(job / 'runs', arcname='runs')

    repo = tmp_path / 'repo'
    docs = repo / 'docs/results'
    _copy_run(H100 / VIT, docs / 'ninformer_table1_h100' / VIT)
    _copy_run(H100_UNFINISHED / NIN_CIFAR, docs / 'ninformer_table1_h100_unfinished' / NIN_CIFAR, up_to_epoch=30)
    _copy_run(H100_UNFINISHED / NIN_MNIST, docs / 'ninformer_table1_h100_unfinished' / NIN_MNIST)
    assert 'not found' in _collect(repo, str(tmp_path / 'gpu_job_state.tgz')).stderr  # no .gpu_data yet
    for ds in ('mnist', 'cifar10'):
        (repo / '.gpu_data' / ds).mkdir(parents=True)  # the configs name .gpu_data/<ds>; nothing is read from it

    out = _collect(repo, str(tmp_path / 'gpu_job_state.tgz'))
    assert out.returncode == 0, out.stderr
    assert 'CUDA tests: 31 passed, 1 skipped, 59 deselected in 95.1s (runs/gpu-t1-cudatests.txt)' in out.stdout
    assert f'{VIT}: finished, committed already' in out.stdout
    assert f'{NIN_CIFAR}: unfinished at epoch 77 -> docs/results/ninformer_table1_h100_unfinished/{NIN_CIFAR}' \
        in out.stdout
    assert f'{NIN_MNIST}: unfinished at epoch 40, committed copy at 68: kept that' in out.stdout
    unfinished = docs / 'ninformer_table1_h100_unfinished'
    assert (unfinished / NIN_CIFAR / 'metrics.csv').read_text() == (H100_UNFINISHED / NIN_CIFAR / 'metrics.csv') \
        .read_text()
    assert (unfinished / NIN_MNIST / 'metrics.csv').read_text() == (H100_UNFINISHED / NIN_MNIST / 'metrics.csv') \
        .read_text()
    seed1 = docs / 'ninformer_table1_h100_seed1'
    assert yaml.safe_load((seed1 / VIT / 'config.yaml').read_text())['seed'] == 1
    assert json.loads((seed1 / VIT / 'results.json').read_text())['final']['top1'] == 64.07
    table = (docs / 'ninformer_table1_h100/table.md').read_text()
    assert 'NVIDIA H100 80GB HBM3, 580.159.04; torch 2.11.0 timm 1.0.29' in table
    assert '--datasets mnist,cifar10' in table and '--set deterministic=false matmul_precision=high' in table
    assert '| ViT | - | - | 97.12 |' in table  # no MNIST ViT in this archive
    assert '| NiNformer (ours) | 98.40 ' not in table and '| 75.53 | 76.11 | 81.59 | -6.06 | 77.00 |' in table
    seed_table = (seed1 / 'table.md').read_text()
    assert 'seed=1' in seed_table and '| ViT | 64.07 | 64.95 | 65.74 | -1.67 | 100.00 |' in seed_table
    assert (repo / 'runs/gpu-t1-seed1' / VIT / 'results.json').is_file()  # unpacked where the command reads it
    assert (seed1 / VIT / 'eval_train_augment.json').is_file()
    assert not (repo / 'runs/gpu_speed').exists() and not (docs / 'gpu_speed').exists()
    row = f'| {VIT} | 64.07 | 62.00 | -2.07 | 61.50, 62.00, 62.50 |'
    assert row in seed_table and row in out.stdout and 'through the training augmentation' not in table  # none here


def test_an_archive_that_is_no_job_state_is_refused(tmp_path):
    (tmp_path / '.gpu_data').mkdir()
    (tmp_path / 'bad.tgz').write_bytes(b'not a tar')
    out = _collect(tmp_path, 'bad.tgz')
    assert out.returncode != 0 and 'not a readable tar.gz' in out.stderr
    (tmp_path / 'etc').mkdir()
    (tmp_path / 'etc/passwd').write_text('x')
    with tarfile.open(tmp_path / 'other.tgz', 'w:gz') as tar:
        tar.add(tmp_path / 'etc', arcname='etc')
    out = _collect(tmp_path, 'other.tgz')
    assert out.returncode != 0 and "holds 'etc'" in out.stderr
    assert 'no such file' in _collect(tmp_path, 'missing.tgz').stderr
