import os

import pytest
import torch

# The fused Triton kernels (vitblocks.kernels) run through Triton's interpreter on a machine without a
# GPU; Triton reads this when a kernel module is first imported, so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope='session')
def _node_cache(tmp_path_factory):
    """vitblocks' node cache (decoded small shard sets, shard indexes) in a folder of this test session, for
    the subprocesses too: no test reads what a user or an earlier session left, none writes to ~/.cache."""
    patch = pytest.MonkeyPatch()
    patch.setenv('VITBLOCKS_CACHE', str(tmp_path_factory.mktemp('vitblocks-cache')))
    yield
    patch.undo()
