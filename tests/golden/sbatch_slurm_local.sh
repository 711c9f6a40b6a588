#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=2
#SBATCH --job-name=golden
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --open-mode=append
#SBATCH --output=/runs/golden/logs/%j_batch.out
#SBATCH --partition=debug
#SBATCH --requeue
#SBATCH --signal=USR2@30
#SBATCH --time=10
#SBATCH --wckey=slurmtron

# setup
# ---- slurmtron: run golden ----
# Rendered by launch/render.py from sbatch_templates/; every config value below is shell-quoted.
# The batch shell only prepares the environment and starts one srun step; the training ranks
# are the srun tasks, so Slurm's warning signal (--signal without B:) reaches them directly.
set -eo pipefail
RUN_DIR=/runs/golden
mkdir -p "$RUN_DIR/logs"
echo "slurmtron: job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-?} run $RUN_DIR"
# ---- environment (cluster.env: NCCL/IB/UCX ...); exported to every srun task ----
export PYTHONUNBUFFERED=1
export PYTHONPATH=/opt/slurmtron${PYTHONPATH:+:$PYTHONPATH}
export SLURMTRON_RUN_DIR="$RUN_DIR"
export GLOO_SOCKET_IFNAME=lo
export OMP_NUM_THREADS=1
export PYTHONUNBUFFERED=1
# ---- rendezvous: MASTER_ADDR is the first node of the allocation, as an address ----
# Node names do not always resolve (e.g. test clusters): try the resolver first, then the
# NodeAddr Slurm itself uses, and only then the bare name.
MASTER_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_ADDR=$(getent ahostsv4 "$MASTER_HOST" | awk '{print $1; exit}' || true)
if [ -z "$MASTER_ADDR" ]; then
    MASTER_ADDR=$(scontrol show node "$MASTER_HOST" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' | head -n 1 || true)
fi
export MASTER_ADDR=${MASTER_ADDR:-$MASTER_HOST}
# A port derived from the job id and the restart count (launch/dist_env.py, rendezvous_port), below the kernel's
# ephemeral range: two jobs sharing a node do not collide, and a requeued job does not reuse the port its
# previous attempt may have left in TIME_WAIT.
export MASTER_PORT=$((20000 + (${SLURM_JOB_ID:-0} + 7919 * (${SLURM_RESTART_COUNT:-0} + ${SLURMTRON_IN_JOB_OFFSET:-0})) % 12000))
echo "slurmtron: MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"

# command
export SUBMITIT_EXECUTOR=slurm
# ---- the training step: one task per GPU, each task is one rank ----
# Why no torchrun: an extra launcher between Slurm and the ranks swallows or delays Slurm's
# signals. Why --signal=USR2@lead without "B:": with B: Slurm signals only the batch shell, which
# would have to forward it; without it, Slurm delivers USR2 to every task of the step, i.e. to
# every training rank, whose handler sets a stop flag that the ranks agree on at the next step.
# --kill-on-bad-exit=1: one failed rank ends the step instead of leaving the others hanging in a
# collective. Exit 42 from the ranks means "checkpointed, requeue me" (see recovery/).
set +e
# Before each attempt: learn nodes Slurm saw fail (sacct -D after a NODE_FAIL) and, if this
# allocation holds a recorded failed node, requeue away from it (exit 42) instead of training
# there. A check that cannot run only costs the exclusion, never the attempt.
python3 -m recovery.exclusion start "$RUN_DIR"
[ $? -eq 42 ] && exit 42
srun --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=2 --cpus-per-task=2 --open-mode=append --output=/runs/golden/logs/%j_%t.out python3 -u -m train.worker "$RUN_DIR"
rc=$?
echo "slurmtron: srun exited $rc"
# Slurm never reruns a FAILED job: a crashed attempt (per the run's event log, not srun's code,
# which --kill-on-bad-exit makes 143) is requeued here; the next attempt's zero-progress guard
# and training.max_restarts end a deterministic crash loop (recovery/crash.py). A final code (a refusal,
# listed below) is never requeued, and a job that does not hold the run lock writes nothing into the run.
# Final codes (recovery/exit_codes.py): zero_progress 3, max_restarts 4, no_loadable_checkpoint 5, foreign_checkpoint 6, storage_error 7, disk_full 8, run_locked 9, unsupported_software 10, nan 11, unsafe_checkpoint 12, shared_checkpoint 13, bad_config 14, checkpoint_mismatch 15, replay_mismatch 16, budget 17, oom 18
REQUEUE_ON_CRASH=1  # cluster.requeue_allowed and training.requeue_on_crash
if [ $rc -ne 0 ] && [ "$REQUEUE_ON_CRASH" = 1 ]; then
    python3 -m recovery.crash "$RUN_DIR" --rc "$rc"
    [ $? -eq 42 ] && exit 42
fi
exit $rc
