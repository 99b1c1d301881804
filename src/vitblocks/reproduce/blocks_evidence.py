"""The evidence plan of the CIFAR-10 blocks benchmark: which runs separate each block's gain from the
locality prior its depthwise convs add, which test the sign of each paper's ablation, and which check
the ordering on a longer schedule; in the order that tells the most first, with a verdict per claim.

``EVIDENCE_PLAN`` lists the tiers (run in this order; under a wall-clock limit the later tiers are
paused first): the locality and size controls, then the ablations, then the main rows at 100 epochs.
``CLAIMS`` pairs each configuration with the one it is compared with and the sign its paper reports;
:func:`verdicts` turns finished runs into a table: the mean difference over the seeds both rows share,
the seed spread of the paired differences, and a verdict:

* ``holds``: the difference has the paper's sign and exceeds its spread (sample std of the paired
  differences; with one seed no spread is known and the verdict says so);
* ``does not hold``: the opposite sign, beyond the spread;
* ``not separable``: within the spread. For a locality claim (IFFN or AFBO against the vanilla FFN with
  a depthwise conv at the same parameters) that reads *not separable from locality*.
"""
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .blocks_benchmark import BENCH_SEEDS

__all__ = ['Tier', 'EVIDENCE_PLAN', 'Claim', 'CLAIMS', 'verdicts', 'verdict_table', 'remaining_runs', 'LONG_EPOCHS']

LONG_EPOCHS = 100


@dataclass(frozen=True)
class Tier:
    name: str  # also the sub-folder of --output its runs go to ('' = --output itself)
    configs: Tuple[str, ...]
    seeds: Tuple[int, ...]
    epochs: Optional[int] = None  # None: the recipe's (20)
    what: str = ''


EVIDENCE_PLAN = (
    Tier('', ('vanilla', 'local_ffn', 'iffn', 'afbo', 'local_ffn_afbo', 'iffn_spatial_only', 'iffn_channel_only',
              'afbo_c', 'vanilla_wide', 'ninformer'), BENCH_SEEDS,
         what='locality and size controls beside the blocks they control for'),
    Tier('', ('iffn_k5', 'iffn_k7', 'iffn_n4', 'afbo_post', 'afbo_g2_2', 'afbo_g2_6', 'afbo_g1_4', 'repa',
              'repa_idle_25', 'repa_idle_50', 'repa_idle_100', 'mabvit_glu', 'mabvit_pr_glu'), BENCH_SEEDS,
         what="the papers' ablations: is each sign reproduced"),
    Tier('long', ('vanilla', 'local_ffn', 'iffn', 'afbo', 'repa', 'ninformer'), (0,), LONG_EPOCHS,
         what='the main rows on a 100-epoch schedule: does the ordering hold once vanilla is not underfit'),
)


@dataclass(frozen=True)
class Claim:
    config: str
    reference: str
    sign: int  # +1: the paper reports config above reference; -1: below; 0: no difference reported
    paper: str
    locality: bool = False  # a block against its locality control


CLAIMS = (
    Claim('iffn', 'local_ffn', +1, 'IFFN above a vanilla FFN with the same depthwise conv (locality alone)', True),
    Claim('afbo', 'local_ffn_afbo', +1, 'AFBO above a vanilla FFN with the same depthwise conv (locality alone)',
          True),
    Claim('iffn', 'vanilla', +1, 'IFFN Table 1: DeiT-Ti 72.2 -> 72.6'),
    Claim('iffn_spatial_only', 'vanilla', +1, 'IFFN Table 2: spatial part only 72.8 vs 72.2'),
    Claim('iffn_channel_only', 'vanilla', -1, 'IFFN Table 2: channel part only 70.5 vs 72.2'),
    Claim('iffn', 'iffn_channel_only', +1, 'IFFN Table 2: adding the spatial part, 72.6 vs 70.5'),
    Claim('iffn_k5', 'iffn', +1, 'IFFN Table 6: kernel 5, 72.8 vs 72.6'),
    Claim('iffn_k7', 'iffn_k5', +1, 'IFFN Table 6: kernel 7, 72.9 vs 72.8'),
    Claim('iffn_n4', 'iffn', -1, 'IFFN Table 4: N = 4, 68.6 vs 72.6'),
    Claim('afbo', 'vanilla', +1, 'AFBO Table 2: DeiT-T 72.2 -> 74.6'),
    Claim('afbo_c', 'vanilla', +1, 'AFBO Table 5: AFBO-C (channel maps only) 73.7 vs 72.2'),
    Claim('afbo', 'afbo_c', +1, 'AFBO Table 5: adding spatial modelling, 74.6 vs 73.7'),
    Claim('afbo_post', 'afbo', -1, 'AFBO Table 6: activation after the product, 73.5 vs 74.6'),
    Claim('afbo_g2_2', 'afbo', -1, 'AFBO Table 7: G2 = 2, 73.0 vs 74.6 (G2 = 4)'),
    Claim('afbo_g2_6', 'afbo', +1, 'AFBO Table 7: G2 = 6, 74.8 vs 74.6'),
    Claim('afbo_g1_4', 'afbo', -1, 'AFBO Table 7: G1 = 4, 73.5 vs 74.6 (G1 = 2)'),
    Claim('repa_idle_100', 'repa', -1, 'RePa Table 4: idle ratio 1.0, 73.7 vs 81.4 (0.75; DeiT-B)'),
    Claim('repa_idle_50', 'repa', 0, 'RePa Table 4: idle ratio 0.5, 81.4 vs 81.4 (0.75; DeiT-B)'),
    Claim('repa_idle_25', 'repa_idle_50', 0, 'RePa Table 4: idle ratio 0.25, 81.1 vs 81.4 (0.5; DeiT-B)'),
    Claim('mabvit_glu', 'vanilla', +1, 'MABViT: Ti/16 GLU on V 73.29 vs 72.44'),
    Claim('mabvit_pr_glu', 'vanilla', +1, 'MABViT: PR-GLU Ti/16 surpasses the standard ViT'),
    Claim('ninformer', 'vanilla', +1, 'NiNformer Table 1: CIFAR-10 81.59 vs 65.74'),
    Claim('ninformer', 'vanilla_wide', +1, "NiNformer above a vanilla ViT widened to NiNformer's parameters"),
)


def _verdict(claim: Claim, diffs: List[float]) -> str:
    mean = statistics.mean(diffs)
    if len(diffs) < 2:
        return 'one seed: no spread known'
    spread = statistics.stdev(diffs)
    if claim.sign == 0:
        return 'holds (no difference beyond the spread)' if abs(mean) <= spread else 'does not hold'
    if abs(mean) <= spread:
        return 'not separable from locality' if claim.locality else 'not separable (within the spread)'
    return 'holds' if (mean > 0) == (claim.sign > 0) else 'does not hold'


def verdicts(top1: Dict[str, Dict[int, float]], claims: Optional[Sequence[Claim]] = None) -> List[Dict]:
    """One entry per claim (default :data:`CLAIMS`) whose two configurations share at least one finished seed:
    ``top1`` maps configuration -> {seed: final top-1}. The difference is paired by seed (same seed, same data
    order)."""
    out = []
    for claim in CLAIMS if claims is None else claims:
        a, b = top1.get(claim.config, {}), top1.get(claim.reference, {})
        seeds = sorted(set(a) & set(b))
        if not seeds:
            continue
        diffs = [a[s] - b[s] for s in seeds]
        out.append(dict(config=claim.config, reference=claim.reference, paper=claim.paper, paper_sign=claim.sign,
                        seeds=seeds, differences=diffs, mean=statistics.mean(diffs),
                        spread=statistics.stdev(diffs) if len(diffs) > 1 else None,
                        verdict=_verdict(claim, diffs)))
    return out


def verdict_table(rows: Sequence[Dict]):
    """(headers, rows, alignment, notes) for ``render_table``."""
    sign = {1: 'above', -1: 'below', 0: 'equal'}
    table = [[f"{r['config']} vs {r['reference']}", sign[r['paper_sign']], f"{r['mean']:+.2f}",
              '-' if r['spread'] is None else f"{r['spread']:.2f}", str(len(r['seeds'])), r['verdict'], r['paper']]
             for r in rows]
    notes = ['difference: top-1 of the first minus the second, paired by seed, mean over the seeds both finished; '
             'spread: sample std of the paired differences']
    return ['claim', 'paper', 'ours (points)', 'spread', 'seeds', 'verdict', 'paper says'], table, 'llrrrll', notes


def remaining_runs(plan: Sequence[Tier], finished) -> List[Tuple[Tier, str, int]]:
    """(tier, config, seed) of every run of the plan for which ``finished(tier, config, seed)`` is False."""
    return [(tier, c, s) for tier in plan for c in tier.configs for s in tier.seeds if not finished(tier, c, s)]
