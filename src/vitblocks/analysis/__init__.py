"""Analysis tools that run on trained or freshly built models (no model edits): the papers' analyses.

- :mod:`.lipschitz` — IFFN Theorem 4.3 SDP bound, naive bound, empirical Jacobian bound
- :mod:`.entropy` — AFBO Table 18 feature entropy per block
- :mod:`.gradcam` — AFBO Figs. 3-4 Grad-CAM maps (``grad-cam`` package)
- :mod:`.breakdown` — RePa Fig. 3 latency per component
- :mod:`.collapse` — MABViT residual growth and sequential-vs-parallel divergence
"""
from .breakdown import LatencyBreakdown, latency_breakdown, plot_breakdown
from .collapse import (BlockDivergence, BlockNorms, CollapseReport, plot_divergence, plot_residual_growth,
                       residual_growth, sequential_vs_parallel)
from .entropy import EntropyReport, block_entropy, feature_entropy, plot_entropy
from .gradcam import gradcam_maps, gradcam_target, plot_gradcam
from .lipschitz import FfnLipschitz, ffn_lipschitz, model_lipschitz, sdp_lipschitz_bound

__all__ = ['LatencyBreakdown', 'latency_breakdown', 'plot_breakdown', 'BlockDivergence', 'BlockNorms', 'CollapseReport',
           'plot_divergence', 'plot_residual_growth', 'residual_growth', 'sequential_vs_parallel', 'EntropyReport',
           'block_entropy', 'feature_entropy', 'plot_entropy', 'gradcam_maps', 'gradcam_target', 'plot_gradcam',
           'FfnLipschitz', 'ffn_lipschitz', 'model_lipschitz', 'sdp_lipschitz_bound']
