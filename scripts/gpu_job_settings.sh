# How a GPU job trains Table 1 (fp32 with TF32 matmuls, compiled with CUDA graphs, no determinism), in
# one place for scripts/gpu_job.sh (the job) and scripts/gpu_stack_check.sh (its check, on this CPU,
# under the GPU image's versions). Sourced, not run.
T1_SETTINGS="compile=true compile_mode=reduce-overhead deterministic=false matmul_precision=high"
