# ---- environment (cluster.env: NCCL/IB/UCX ...); exported to every srun task ----
export PYTHONUNBUFFERED=1
export PYTHONPATH={{code_dir}}${PYTHONPATH:+:$PYTHONPATH}
export SLURMTRON_RUN_DIR="$RUN_DIR"
{{exports}}
