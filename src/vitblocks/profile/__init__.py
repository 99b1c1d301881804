"""Complexity (params, MACs) and speed (latency, throughput) measurement."""
from .allocator import FAULTS_NOTED, AllocatorError, fault_note, minor_page_faults, steady_malloc
from .complexity import MacReport, count_macs, count_params, fixed_image_size, input_size_of
from .latency import (AMP_DTYPES, COMPILE_MODES, BenchOptionError, LatencyResult, amp_kernel_note, benchmark_models,
                      check_bench_options, fixed_threads, interleaved_times, step_timer, timm_record)

__all__ = ['FAULTS_NOTED', 'AllocatorError', 'fault_note', 'minor_page_faults', 'steady_malloc', 'MacReport',
           'count_macs', 'count_params', 'fixed_image_size', 'input_size_of', 'AMP_DTYPES', 'COMPILE_MODES',
           'BenchOptionError', 'LatencyResult', 'amp_kernel_note', 'benchmark_models', 'check_bench_options',
           'fixed_threads', 'interleaved_times', 'step_timer', 'timm_record']
