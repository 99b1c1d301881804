"""The papers' own harnesses, kept apart from the generic trainer in ``vitblocks.experiments``:

* ``ninformer_table1``: NiNformer's Table 1 (four models, MNIST / CIFAR-10 / CIFAR-100), trained with
  the ``ninformer`` recipe and printed beside the paper's numbers;
* ``blocks_benchmark``: every paper's block in one small ViT on CIFAR-10, three seeds;
* ``blocks_evidence``: the controls and ablations that test the benchmark's claims, most telling first;
* ``jobs``: several runs at once inside a wall-clock limit (a GPU job with a time limit): the runs that
  cannot finish are paused at a checkpoint, so the next job resumes them;
* ``common``: what the harnesses and the command share: run folders (find a dataset, the budget's config
  keys, reuse or resume or train a run, archive the runs), and the command's child processes, budget line
  and saved tables. No harness imports another for these.

``vitblocks reproduce`` is the command line of all of them.
"""
