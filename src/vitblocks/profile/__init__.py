"""Complexity (params, MACs) and speed (latency, throughput) measurement."""
from .complexity import MacReport, count_macs, count_params, fixed_image_size, input_size_of
from .latency import LatencyResult, benchmark_models, fixed_threads
