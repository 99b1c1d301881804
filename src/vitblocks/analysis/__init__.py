"""Analysis tools that run on trained or freshly built models (no model edits)."""
from .collapse import BlockNorms, CollapseReport, plot_residual_growth, residual_growth
