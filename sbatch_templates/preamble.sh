# ---- slurmtron: run {{run_name}} ----
# Rendered by launch/render.py from sbatch_templates/; every config value below is shell-quoted.
# The batch shell only prepares the environment and starts one srun step; the training ranks
# are the srun tasks, so Slurm's warning signal (--signal without B:) reaches them directly.
set -eo pipefail
RUN_DIR={{run_dir}}
mkdir -p "$RUN_DIR/logs"
echo "slurmtron: job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-?} run $RUN_DIR"
