"""pytest plugin that runs timm's ``tests/test_models.py`` over vitblocks models (loaded by
``scripts/timm_conformance.py`` with ``-p timm_conformance_plugin``; see docs/conformance.md).

timm parametrizes its model tests at import time with ``timm.list_models(filter, module,
exclude_filters, ...)``. Before the test file is collected (``pytest_configure``), this plugin replaces
that function with one that returns the vitblocks models whose *timm base* the same call returns: each
model joins the test kinds its timm family joins, under timm's own filters. The base comes from the
registry (``get_variant(name).base``, also named in the model config's ``description``), not from the
name: ``ninformer_baseline_localvit_patch4_28`` is a timm ViT although no filter matches its name. The
backbones vitblocks adds to timm are their own base; those whose features are tokens rather than a map
(no spatial ``pool_size``: LV-ViT) are routed like timm's token families (``vit_*``, ``volo_*``,
``cait_*``), which timm selects by name through ``NON_STD_FILTERS``. timm selects the models of its
feature-API tests (``forward_intermediates``, ``prune_intermediate_layers``) by module
(``FEAT_INTER_FILTERS``), which cannot name ours: every added backbone implements that API and joins them.

Environment (set by the runner):

* ``VITBLOCKS_CONFORMANCE_MODELS``: comma-separated models to keep; every other case is deselected.
* ``VITBLOCKS_CONFORMANCE_KINDS``: comma-separated shell-style patterns of the test names to keep
  (``test_model_`` may be left out; default all); the kinds run in the order of the patterns.
* ``VITBLOCKS_CONFORMANCE_SHARD``: ``i/n``, keep every n-th selected case from the i-th (0-based).
* ``VITBLOCKS_CONFORMANCE_COLLECTED``: a file to which one JSON line per kept case is written.
* ``VITBLOCKS_CONFORMANCE_RESULTS``: a file to which one JSON line per finished case is appended.
* ``VITBLOCKS_CONFORMANCE_TIME_LIMIT``: seconds, replaces every case's ``timeout`` mark (timm's limits
  are sized for its CI runners, some are fixed at 120 s and ignore timm's ``TIMEOUT`` variable).
"""
import fnmatch
import json
import os

import pytest
import timm
import torch

import vitblocks
from vitblocks.models import get_variant, list_backbones

torch.set_num_threads(int(os.environ.get('VITBLOCKS_CONFORMANCE_THREADS', '1')))
_timm_list_models = timm.list_models
ADDED = set(list_backbones())


def base_of(name):
    """The timm model whose family ``name`` belongs to: itself for a backbone vitblocks adds."""
    return name if name in ADDED else get_variant(name).base


def is_token_family(base):
    """An added backbone whose features are tokens (no spatial pool_size), like timm's ViT or VOLO."""
    return base in ADDED and timm.get_pretrained_cfg(base).pool_size is None


def _names_non_std(filters):
    return isinstance(filters, (list, tuple)) and 'vit_*' in filters  # timm's NON_STD_FILTERS


def _names_feature_modules(module):
    # timm's FEAT_INTER_FILTERS: the modules whose models have forward_intermediates / prune_intermediate_layers
    return isinstance(module, (list, tuple)) and 'pvt_v2' in module


def list_models(filter='', module='', pretrained=False, exclude_filters='', name_matches_cfg=False,
                include_tags=None):
    """timm.list_models for vitblocks: the models whose timm base the same timm call lists."""
    if pretrained:
        return []  # vitblocks registers no pretrained weights
    bases = {n.split('.')[0] for n in _timm_list_models(filter, module, pretrained, exclude_filters,
                                                        name_matches_cfg, include_tags)}
    excluded = [exclude_filters] if isinstance(exclude_filters, str) else list(exclude_filters)
    out = []
    for name in sorted(vitblocks.list_models() + sorted(ADDED)):
        base = base_of(name)
        if any(f and fnmatch.fnmatch(name, f) for f in excluded):
            continue
        # every added backbone has timm's feature API (tests/test_staged.py; LV-ViT: timm's ViT's)
        listed = base in bases or (base in ADDED and _names_feature_modules(module))
        if is_token_family(base):
            if _names_non_std(filter) or (listed and not _names_non_std(exclude_filters)):
                out.append(name)
        elif listed:
            out.append(name)
    return out


def pytest_configure(config):
    timm.list_models = list_models  # before timm's test file is imported (collection)


def _model_of(item):
    callspec = getattr(item, 'callspec', None)
    return callspec.params.get('model_name') if callspec is not None else None


_MODEL_OF_CASE = {}


def pytest_collection_modifyitems(config, items):
    wanted = set(filter(None, os.environ.get('VITBLOCKS_CONFORMANCE_MODELS', '').split(',')))
    kinds = list(filter(None, os.environ.get('VITBLOCKS_CONFORMANCE_KINDS', '').split(','))) or ['*']
    shard, shards = (int(v) for v in os.environ.get('VITBLOCKS_CONFORMANCE_SHARD', '0/1').split('/'))
    limit = os.environ.get('VITBLOCKS_CONFORMANCE_TIME_LIMIT')

    def rank(it):  # the first kind pattern the case's test name matches, with or without 'test_model_'
        names = (it.originalname, it.originalname.removeprefix('test_model_'))
        return next((i for i, k in enumerate(kinds) if any(fnmatch.fnmatch(n, k) for n in names)), None)

    chosen = [it for it in items if _model_of(it) in wanted and rank(it) is not None]
    # the kinds in the order of their patterns (timm's file order within a pattern), the models of a kind
    # dealt round the shards in name order, so that each shard gets a share of the large models
    position = {id(it): i for i, it in enumerate(items)}
    by_kind = sorted(chosen, key=lambda it: (rank(it), it.originalname, _model_of(it), it.nodeid))
    keep = by_kind[shard::shards]
    kept = set(id(it) for it in keep)
    config.hook.pytest_deselected(items=[it for it in items if id(it) not in kept])
    items[:] = sorted(keep, key=lambda it: (rank(it), position[id(it)]))
    _MODEL_OF_CASE.update((it.nodeid, _model_of(it)) for it in items)
    path = os.environ.get('VITBLOCKS_CONFORMANCE_COLLECTED')
    if path:
        with open(path, 'w') as f:
            f.writelines(json.dumps(dict(nodeid=it.nodeid, model=_model_of(it), kind=it.originalname)) + '\n'
                         for it in items)
    if limit:
        for it in items:
            it.own_markers = [m for m in it.own_markers if m.name != 'timeout']
            it.add_marker(pytest.mark.timeout(float(limit)))


def pytest_runtest_logreport(report):
    path = os.environ.get('VITBLOCKS_CONFORMANCE_RESULTS')
    if not path or not (report.when == 'call' or report.outcome != 'passed'):
        return
    kind = report.nodeid.split('::')[-1].partition('[')[0]  # the test function's name
    message = ''
    if report.failed:
        crash = getattr(report.longrepr, 'reprcrash', None)
        message = crash.message if crash is not None else str(report.longrepr)
    elif report.skipped:
        message = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    row = dict(nodeid=report.nodeid, model=_MODEL_OF_CASE.get(report.nodeid), kind=kind, when=report.when,
               outcome=report.outcome, seconds=round(report.duration, 2), message=message.splitlines()[0][:300]
               if message else '')
    with open(path, 'a') as f:
        f.write(json.dumps(row) + '\n')
