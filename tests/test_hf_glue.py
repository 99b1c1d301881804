"""`vitblocks glue`: GLUE TSV layouts, the metrics, a tiny fine-tuning run, exact resume after SIGTERM, one-line
errors. Offline: fixture files written here, a tokenizer trained on them, tiny random BERT configs, and a guard
that fails any network connection."""
import csv
import json
import os
import signal
import socket

import pytest
import torch

os.environ['HF_HUB_OFFLINE'] = '1'  # before transformers reads it; nothing here may reach the hub
pytest.importorskip('transformers')
pytest.importorskip('tokenizers')

from _glue_fixtures import LABELS, header, rows, write_task, write_tsv  # noqa: E402

from vitblocks.cli import main  # noqa: E402
from vitblocks.experiments import ConfigError, TrainingInterrupted, load_checkpoint  # noqa: E402
from vitblocks.glue import (GlueConfig, GlueDataError, GlueModelError, GlueRun, fine_tune, get_task,  # noqa: E402
                            matthews_corrcoef, read_task, train_wordpiece)
from vitblocks.glue.metrics import accuracy  # noqa: E402

TINY_BERT = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=64)
TINY_ARGS = ['--model', 'bert-tiny', '--model-args', *[f'{k}={v}' for k, v in TINY_BERT.items()],
             '--train-tokenizer', '120', '--batch-size', '8', '--max-length', '32', '--lr', '1e-3',
             '--progress', 'none']


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f'network access attempted: {args[1:] or kwargs}')
    monkeypatch.setattr(socket.socket, 'connect', refuse)
    monkeypatch.setattr(socket.socket, 'connect_ex', refuse)
    monkeypatch.setattr(socket, 'create_connection', refuse)


def tiny_cfg(data, **kw) -> GlueConfig:
    base = dict(task='cola', data=str(data), model='bert-tiny', model_args=dict(TINY_BERT), train_tokenizer=120,
                batch_size=8, max_length=32, lr=1e-3, epochs=2, progress='none', log_interval=2)
    return GlueConfig(**{**base, **kw})


# --- files -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('task', ['cola', 'rte', 'qnli', 'mnli'])
def test_each_layout_reads_its_texts_and_labels(tmp_path, task):
    folder = write_task(tmp_path, task, n_train=30, n_dev=12)
    train, dev = read_task(get_task(task), folder)
    expected = rows(task, 30, seed=1)
    assert len(train) == 30
    text_at = {'cola': [3], 'rte': [1, 2], 'qnli': [1, 2], 'mnli': [8, 9]}[task]
    assert train.texts == [tuple(r[i] for i in text_at) for r in expected]
    label_at = 1 if task == 'cola' else -1
    assert train.labels == [LABELS[task].index(r[label_at]) for r in expected]
    assert sorted(dev) == (['dev_matched', 'dev_mismatched'] if task == 'mnli' else ['dev'])
    assert all(len(split) == 12 for split in dev.values())
    assert len(set(train.labels)) == len(LABELS[task])  # every class occurs: the fixture exercises the mapping


def test_quotes_are_text_not_csv_quoting(tmp_path):
    """GLUE's sentences hold unmatched quotes; a CSV reader would swallow the following lines into one field."""
    path = write_tsv(tmp_path / 'CoLA' / 'train.tsv', None,
                     [['s', '1', '', '"he said so'], ['s', '0', '*', 'it is "big'], ['s', '1', '', 'plain']])
    write_tsv(tmp_path / 'CoLA' / 'dev.tsv', None, [['s', '1', '', 'x']])
    train, _ = read_task(get_task('cola'), path.parent)
    assert train.texts == [('"he said so',), ('it is "big',), ('plain',)]
    assert train.labels == [1, 0, 1]


def _error(tmp_path, task, mutate):
    folder = write_task(tmp_path, task, n_train=10, n_dev=4)
    mutate(folder)
    with pytest.raises(GlueDataError) as e:
        read_task(get_task(task), folder)
    assert '\n' not in str(e.value)
    return str(e.value)


def test_malformed_files_name_the_file_the_line_and_the_layout(tmp_path):
    def cola_with_header(f):
        write_tsv(f / 'train.tsv', ['source', 'label', 'star', 'sentence'], rows('cola', 5, 1))
    msg = _error(tmp_path / 'a', 'cola', cola_with_header)
    assert 'train.tsv line 1' in msg and "label 'label'" in msg and 'no header' in msg

    def rte_short_line(f):
        body = rows('rte', 6, 1)
        body[3] = body[3][:3]
        write_tsv(f / 'train.tsv', header('rte'), body)
    msg = _error(tmp_path / 'b', 'rte', rte_short_line)
    assert 'train.tsv line 5: 3 tab-separated fields, expected 4' in msg and 'sentence1, sentence2, label' in msg

    def qnli_renamed_column(f):
        write_tsv(f / 'dev.tsv', ['index', 'query', 'sentence', 'label'], rows('qnli', 4, 2))
    msg = _error(tmp_path / 'c', 'qnli', qnli_renamed_column)
    assert 'dev.tsv line 1: the header has no question column' in msg

    def mnli_unknown_label(f):
        body = rows('mnli', 5, 3, dev=True)
        body[2][-1] = 'maybe'
        write_tsv(f / 'dev_mismatched.tsv', header('mnli', dev=True), body)
    msg = _error(tmp_path / 'd', 'mnli', mnli_unknown_label)
    assert "dev_mismatched.tsv line 4: label 'maybe' is not one of entailment, neutral, contradiction" in msg

    msg = _error(tmp_path / 'e', 'mnli', lambda f: (f / 'dev_matched.tsv').unlink())
    assert 'dev_matched.tsv: no such file' in msg and 'train.tsv, dev_matched.tsv, dev_mismatched.tsv' in msg

    msg = _error(tmp_path / 'f', 'cola', lambda f: (f / 'dev.tsv').write_bytes(b's\t1\t\tok\ns\t0\t*\tbad \xff\n'))
    assert 'dev.tsv line 2: not UTF-8' in msg


# --- metrics ---------------------------------------------------------------------------------------------

def test_matthews_correlation_against_hand_computed_values():
    # TP 3, TN 2, FP 1, FN 2: (3*2 - 1*2) / sqrt((3+1)(3+2)(2+1)(2+2)) = 4 / sqrt(240)
    labels = [1, 1, 1, 1, 1, 0, 0, 0]
    preds = [1, 1, 1, 0, 0, 0, 0, 1]
    assert matthews_corrcoef(preds, labels) == pytest.approx(4 / 240 ** 0.5, abs=1e-12)
    assert accuracy(preds, labels) == pytest.approx(5 / 8)
    assert matthews_corrcoef(labels, labels) == pytest.approx(1.0)
    assert matthews_corrcoef([1 - y for y in labels], labels) == pytest.approx(-1.0)
    assert matthews_corrcoef([1] * 8, labels) == 0.0  # one predicted class: no correlation (sklearn's convention)
    sklearn = pytest.importorskip('sklearn.metrics')
    g = torch.Generator().manual_seed(0)
    y, p = torch.randint(0, 3, (200,), generator=g), torch.randint(0, 3, (200,), generator=g)
    assert matthews_corrcoef(p, y) == pytest.approx(sklearn.matthews_corrcoef(y.numpy(), p.numpy()), abs=1e-12)


# --- tokenizer -------------------------------------------------------------------------------------------

def test_trained_tokenizer_is_deterministic_and_marks_the_pair():
    """Same texts, same ids (tokenizers' own trainer breaks ties in hash order); the vocabulary holds the specials,
    each character alone and as ##-continuation, and the most frequent words (ties alphabetical) up to the size."""
    texts = ['bb aa cc aa', 'dd bb aa ee', 'cc cc']  # words: aa 3, cc 3, bb 2, dd 1, ee 1; characters a..e
    a, b = train_wordpiece(iter(texts), 5 + 10 + 3), train_wordpiece(iter(texts), 5 + 10 + 3)
    assert a.get_vocab() == b.get_vocab()
    vocab = sorted(a.get_vocab(), key=a.get_vocab().get)
    assert vocab[:5] == ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']
    assert vocab[5:] == [*'abcde', *('##' + c for c in 'abcde'), 'aa', 'cc', 'bb']
    assert a.tokenize('AA dd') == ['aa', 'd', '##d']
    enc = a('aa bb', 'cc')
    ids = a.convert_tokens_to_ids(['[CLS]', 'aa', 'bb', '[SEP]', 'cc', '[SEP]'])
    assert enc['input_ids'] == ids and enc['token_type_ids'] == [0, 0, 0, 0, 1, 1]


# --- runs ------------------------------------------------------------------------------------------------

def read_rows(run):
    with open(run / 'metrics.csv', newline='') as f:
        return [{k: v for k, v in r.items() if k not in ('elapsed_s', 'examples_per_s')} for r in csv.DictReader(f)]


@pytest.mark.parametrize('task', ['cola', 'mnli'])
def test_tiny_run_trains_and_reports_the_task_metric(tmp_path, capsys, task):
    """A CLI run writes the run folder; its reported dev metric is what the saved model/ predicts on dev."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    folder = write_task(tmp_path, task)
    code = main(['glue', task, '--data', str(folder), *TINY_ARGS, '--epochs', '2', '--output', str(tmp_path / 'runs'),
                 '--log-interval', '2'])
    out = capsys.readouterr()
    assert code == 0, out.err
    run = tmp_path / 'runs' / f'glue-{task}-bert-tiny'
    assert {'config.yaml', 'last.pth', 'best.pth', 'metrics.csv', 'results.json', 'tokenizer', 'model'} <= \
        {p.name for p in run.iterdir()}
    metric = 'matthews' if task == 'cola' else 'accuracy'
    devs = ['dev_matched', 'dev_mismatched'] if task == 'mnli' else ['dev']
    metrics_rows = read_rows(run)
    assert [r['step'] for r in metrics_rows if r['split'] == 'train'] == ['2', '4', '6', '8', '10', '12']
    assert [(r['step'], r['split']) for r in metrics_rows if r['split'] != 'train'] == \
        [(s, d) for s in ('6', '12') for d in devs]
    results = json.loads((run / 'results.json').read_text())
    assert results['metric'] == metric and results['global_step'] == 12 and sorted(results['final']) == devs
    assert f'{"Matthews correlation" if task == "cola" else "accuracy"} {results["final"][devs[0]][metric]:.4f}' \
        in out.out

    model = AutoModelForSequenceClassification.from_pretrained(run / 'model', local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(run / 'model', local_files_only=True)
    _, dev = read_task(get_task(task), folder)
    for name in devs:
        first, second = zip(*dev[name].texts) if task == 'mnli' else (list(zip(*dev[name].texts))[0], None)
        enc = tokenizer(list(first), list(second) if second else None, truncation=True, max_length=32,
                        padding=True, return_tensors='pt')
        with torch.no_grad():
            preds = model(**enc).logits.argmax(-1)
        reported = results['final'][name]
        assert reported['accuracy'] == pytest.approx(accuracy(preds, dev[name].labels), abs=1e-9)
        assert reported['matthews'] == pytest.approx(matthews_corrcoef(preds, dev[name].labels), abs=1e-9)
    assert model.config.id2label == dict(enumerate(LABELS[task]))


def _signal_after(monkeypatch, step=None, evaluation_batch=None):
    """Send this process a SIGTERM after training step ``step``, or during the first evaluation, after it has
    evaluated ``evaluation_batch`` batches (as a cluster preempting the job would)."""
    step_fn, evaluate_fn = GlueRun._step, GlueRun._evaluate
    seen = {'batches': 0}

    def step_then_signal(self, idx):
        loss = step_fn(self, idx)
        if self.global_step == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    def batch_then_signal(self, data):
        batch = self._batch

        def counting(*args):
            seen['batches'] += 1
            if seen['batches'] == evaluation_batch:
                os.kill(os.getpid(), signal.SIGTERM)
            return batch(*args)
        self._batch = counting
        try:
            return evaluate_fn(self, data)
        finally:
            del self._batch
    if step is not None:
        monkeypatch.setattr(GlueRun, '_step', step_then_signal)
    else:
        monkeypatch.setattr(GlueRun, '_evaluate', batch_then_signal)


RESUME_CFG = dict(task='rte', epochs=2, eval_batch_size=8, model_args={**TINY_BERT, 'hidden_dropout_prob': 0.3})


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
    """(data folder, run folder) of an RTE run trained without a stop."""
    root = tmp_path_factory.mktemp('glue-full')
    folder = write_task(root, 'rte')
    fine_tune(tiny_cfg(folder, **RESUME_CFG), root / 'full')
    return folder, root / 'full'


@pytest.mark.parametrize('where', ['step', 'evaluation'])
def test_interrupted_run_resumes_to_the_uninterrupted_weights(uninterrupted, tmp_path, monkeypatch, capsys, where):
    """SIGTERM after step 4 (mid-epoch; with dropout, so the RNG state matters) or one batch into the first
    evaluation (3 batches); `vitblocks glue --resume` then ends on exactly the weights and metrics rows of an
    uninterrupted run."""
    folder, full_run = uninterrupted
    cfg = RESUME_CFG
    with monkeypatch.context() as patch:
        _signal_after(patch, **({'step': 4} if where == 'step' else {'evaluation_batch': 1}))
        with pytest.raises(TrainingInterrupted, match='resume with: vitblocks glue --resume'):
            fine_tune(tiny_cfg(folder, **cfg), tmp_path / 'part')
    stopped = load_checkpoint(tmp_path / 'part' / 'last.pth')
    assert stopped['global_step'] == (4 if where == 'step' else 6)
    assert stopped['evaluation_owed'] == (where == 'evaluation')
    assert json.loads((tmp_path / 'part' / 'stopped.json').read_text())['reason'] == 'interrupted'

    assert main(['glue', '--resume', str(tmp_path / 'part'), '--progress', 'none']) == 0, capsys.readouterr().err
    full, part = load_checkpoint(full_run / 'last.pth'), load_checkpoint(tmp_path / 'part' / 'last.pth')
    assert full['global_step'] == part['global_step'] == 12
    assert full['model'].keys() == part['model'].keys()
    for key, value in full['model'].items():
        assert torch.equal(value, part['model'][key]), key
    assert read_rows(tmp_path / 'part') == read_rows(full_run)
    assert not (tmp_path / 'part' / 'stopped.json').exists()


# --- command-line errors ---------------------------------------------------------------------------------

def run_cli(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    folder = write_task(tmp_path, 'rte', n_train=10, n_dev=4)
    body = rows('rte', 10, 1)
    body[6][3] = 'yes'
    broken = write_task(tmp_path / 'broken', 'rte', n_train=10, n_dev=4)
    write_tsv(broken / 'train.tsv', header('rte'), body)
    out = ['--output', str(tmp_path / 'runs')]
    cases = [
        (['glue', 'rte', '--data', str(broken), *TINY_ARGS, *out],
         "train.tsv line 8: label 'yes' is not one of entailment, not_entailment"),
        (['glue', 'rte', '--data', str(tmp_path / 'nowhere'), *TINY_ARGS, *out], 'nowhere: no such folder'),
        (['glue', 'rte', '--data', str(folder), *TINY_ARGS, '--tokenizer', str(tmp_path), *out],
         '--tokenizer and --train-tokenizer both name the tokenizer; give one of them'),
        (['glue', 'rte', '--data', str(folder), '--model', 'bert-tiny', '--batch-size', '4', *out],
         '--model bert-tiny brings no tokenizer; give --tokenizer PATH'),
        (['glue', 'rte', '--data', str(folder), '--model', 'bert-small', *out], 'not a folder, a config .json file or'),
        (['glue', 'rte', '--data', str(folder), *TINY_ARGS, '--block-cfg', 'kernel_size=3', *out],
         '--block-cfg configures the FFN that --ffn swaps in'),
        (['glue', 'rte', '--data', str(folder), *TINY_ARGS, '--max-length', '100', *out],
         '--max-length 100: the model has 64 positions'),
        (['glue', '--data', str(folder)], 'TASK, --model required (or --resume RUN)'),
        (['glue', 'rte', '--data', str(folder), *TINY_ARGS, '--batch-size', '32', *out],
         'train.tsv: 10 examples are fewer than one batch of 32; lower --batch-size'),
        (['glue', '--resume', str(tmp_path)], 'no config.yaml there'),
    ]
    (tmp_path / 'early').mkdir()
    (tmp_path / 'early' / 'config.yaml').write_text('task: rte\n')
    cases.append((['glue', '--resume', str(tmp_path / 'early')], 'no last.pth there (the run stopped before its first'))
    for argv, expected in cases:
        code, err = run_cli(capsys, argv)
        assert code == 2 and expected in err and err.count('\n') == 1, (argv, err)
        assert err.startswith('vitblocks glue: error: ')
    assert not (tmp_path / 'runs').exists()  # nothing is written before the run is set up


def test_resume_keeps_the_settings_and_checks_the_files(tmp_path, capsys):
    folder = write_task(tmp_path, 'cola', n_train=16, n_dev=8)
    runs = ['--output', str(tmp_path / 'runs'), '--name', 'r']
    assert main(['glue', 'cola', '--data', str(folder), *TINY_ARGS, '--max-steps', '1', *runs]) == 0
    run = str(tmp_path / 'runs' / 'r')
    code, err = run_cli(capsys, ['glue', '--resume', run, '--lr', '0.1'])
    assert code == 2 and 'cannot change --lr (only' in err
    code, err = run_cli(capsys, ['glue', 'cola', '--data', str(folder), *TINY_ARGS, *runs])
    assert code == 2 and 'already holds a run (last.pth); resume it with --resume' in err
    (folder / 'dev.tsv').write_text((folder / 'dev.tsv').read_text().replace('\t1\t', '\t0\t', 1))
    code, err = run_cli(capsys, ['glue', '--resume', run])
    assert code == 2 and 'dev.tsv is not the file this run was trained on' in err
    config = tmp_path / 'runs' / 'r' / 'config.yaml'
    config.write_text(config.read_text().replace('lr: 0.001', 'lr: fast'))
    code, err = run_cli(capsys, ['glue', '--resume', run])
    assert code == 2 and "config.yaml: lr='fast': expected a number" in err


# --- pretrained folders and swapped FFNs -----------------------------------------------------------------

def pretrained_folder(root, data):
    """A local 'pretrained' BERT folder (random weights saved with save_pretrained) with its own tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    train, _ = read_task(get_task('rte'), data)
    tokenizer = train_wordpiece((t for pair in train.texts for t in pair), 200)
    config = AutoConfig.for_model('bert', vocab_size=len(tokenizer), **TINY_BERT)
    folder = root / 'tiny-bert'
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_pretrained_folder_brings_its_weights_and_tokenizer_and_warm_starts_repa(tmp_path):
    from safetensors.torch import load_file
    data = write_task(tmp_path, 'rte', n_train=16, n_dev=8)
    folder = pretrained_folder(tmp_path, data)
    saved = load_file(folder / 'model.safetensors')
    base = dict(task='rte', data=str(data), model=str(folder), batch_size=8, max_length=32, progress='none')
    run = GlueRun(GlueConfig(**base), tmp_path / 'vanilla')
    assert run.pretrained and run.tokenizer.get_vocab() == load_tokenizer_vocab(folder)
    state = run.model.state_dict()
    assert torch.equal(state['bert.embeddings.word_embeddings.weight'], saved['bert.embeddings.word_embeddings.weight'])
    assert torch.equal(state['bert.encoder.layer.1.intermediate.dense.weight'],
                       saved['bert.encoder.layer.1.intermediate.dense.weight'])

    run = GlueRun(GlueConfig(**base, ffn='repa', warm_start=True), tmp_path / 'repa')
    assert run.swapped == 2
    state = run.model.state_dict()
    for layer in range(2):
        block = f'bert.encoder.layer.{layer}.intermediate.block'
        assert torch.equal(state[f'{block}.fc1.weight'], saved[f'bert.encoder.layer.{layer}.intermediate.dense.weight'])
        assert torch.equal(state[f'{block}.fc2.weight'], saved[f'bert.encoder.layer.{layer}.output.dense.weight'])

    with pytest.raises(ConfigError, match='holds pretrained weights, whose embedding belongs to its own tokenizer'):
        GlueRun(GlueConfig(**base, train_tokenizer=100), tmp_path / 'a')
    with pytest.raises(ConfigError, match='iffn.*--warm-start: cannot swap it into BertForSequenceClassification'):
        GlueRun(GlueConfig(**base, ffn='iffn', warm_start=True), tmp_path / 'b')
    with pytest.raises(ConfigError, match='--model bert-tiny is randomly initialized'):
        GlueRun(tiny_cfg(data, task='rte', ffn='repa', warm_start=True), tmp_path / 'c')


def load_tokenizer_vocab(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder, local_files_only=True).get_vocab()


def test_swapped_run_resumes_exactly_and_its_model_reloads(tmp_path, monkeypatch, capsys):
    """IFFN (convs over the sequence, masked BatchNorm) swapped into a tiny BERT: SIGTERM after step 3 and resume
    end on the uninterrupted weights; model/ reloads with vitblocks.hf.from_pretrained and predicts the reported
    dev metric."""
    hf = pytest.importorskip('vitblocks.hf')
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    data = write_task(tmp_path, 'cola', n_train=32, n_dev=16)
    cfg = dict(epochs=1, ffn='iffn', block_cfg={'kernel_size': 3})
    fine_tune(tiny_cfg(data, **cfg), tmp_path / 'full')
    with monkeypatch.context() as patch:
        _signal_after(patch, step=3)
        with pytest.raises(TrainingInterrupted):
            fine_tune(tiny_cfg(data, **cfg), tmp_path / 'part')
    assert main(['glue', '--resume', str(tmp_path / 'part')]) == 0, capsys.readouterr().err
    full, part = load_checkpoint(tmp_path / 'full' / 'last.pth'), load_checkpoint(tmp_path / 'part' / 'last.pth')
    assert any('intermediate.block' in k for k in full['model'])
    assert full['model'].keys() == part['model'].keys()
    for key, value in full['model'].items():
        assert torch.equal(value, part['model'][key]), key

    results = json.loads((tmp_path / 'part' / 'results.json').read_text())
    assert results['ffn'] == 'iffn' and results['ffns_swapped'] == 2
    model = hf.from_pretrained(AutoModelForSequenceClassification, tmp_path / 'part' / 'model').eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / 'part' / 'model', local_files_only=True)
    _, dev = read_task(get_task('cola'), data)
    enc = tokenizer([t[0] for t in dev['dev'].texts], truncation=True, max_length=32, padding=True,
                    return_tensors='pt')
    with torch.no_grad():
        preds = model(**enc).logits.argmax(-1)
    assert results['final']['dev']['accuracy'] == pytest.approx(accuracy(preds, dev['dev'].labels), abs=1e-9)


def test_gpt2_classifier_reads_the_last_real_token_of_a_padded_batch(tmp_path):
    """A GPT classifier pools the last token before the padding, found by config.pad_token_id (set from the
    tokenizer): a right-padded batch gives each sequence the logits it has alone."""
    data = write_task(tmp_path, 'rte', n_train=16, n_dev=8)
    run = GlueRun(tiny_cfg(data, task='rte', model='gpt2', batch_size=8,
                           model_args=dict(n_layer=2, n_embd=32, n_head=2, n_positions=64)), tmp_path / 'run')
    model = run.model.eval()
    assert model.config.pad_token_id == run.tokenizer.pad_token_id == 0 and model.config.eos_token_id is None
    lengths = [len(ids) for ids in run.dev_data['dev'].input_ids[:4]]
    assert len(set(lengths)) > 1  # the batch is padded
    inputs, _ = run._batch(run.dev_data['dev'], [0, 1, 2, 3])
    with torch.no_grad():
        batched = model(**inputs).logits
        for row in range(4):
            alone, _ = run._batch(run.dev_data['dev'], [row])
            assert torch.allclose(model(**alone).logits[0], batched[row], atol=1e-5)


def test_a_pretrained_head_of_another_size_is_replaced_but_a_resized_body_is_refused(tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification
    data = write_task(tmp_path, 'mnli', n_train=16, n_dev=8)
    tokenizer = train_wordpiece(['a b c'], 50)
    folder = tmp_path / 'rte-model'  # a 2-label classifier, fine-tuned elsewhere
    AutoModelForSequenceClassification.from_config(
        AutoConfig.for_model('bert', vocab_size=len(tokenizer), num_labels=2, **TINY_BERT)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    base = dict(task='mnli', data=str(data), model=str(folder), batch_size=8, max_length=32, progress='none')
    run = GlueRun(GlueConfig(**base), tmp_path / 'a')
    assert run.model.classifier.out_features == 3 and run.model.config.num_labels == 3
    with pytest.raises(GlueModelError, match='the config gives bert.embeddings.* another shape than the pretrained'):
        GlueRun(GlueConfig(**base, model_args={'hidden_size': 64}), tmp_path / 'b')
