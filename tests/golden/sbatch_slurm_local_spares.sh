#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=2
#SBATCH --job-name=golden
#SBATCH --no-kill
#SBATCH --nodes=3
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
# ---- the training step, with in-job restart on spare nodes (recovery/injob.py) ----
# One task per GPU, each task one rank, no launcher between Slurm and the ranks (see srun.sh for why, and for
# --signal and --kill-on-bad-exit); --ntasks, because the allocation's own count includes the spares.
# The allocation holds 2 + 1 spare node(s) and was submitted with --no-kill, so a failed node
# does not end it: after a crash, a hang or a lost node, a new srun step starts on 2 healthy nodes of
# it (cluster.in_job_restarts=3 times per allocation), resuming from the newest verified checkpoint as
# after a requeue; then the requeue path takes over.
# If the node running this script fails, Slurm ends the job and --requeue brings it back.
# --overlap: a step cut by a lost node keeps its CPUs booked until Slurm gives up on the dead node's
# slurmstepd (minutes); its processes on the live nodes are gone, so the next step may use them.
set +e
# Every step is an attempt of its own (restart limit, zero-progress guard, events): its restart count is
# Slurm's plus the relaunches this job made before it.
export SLURMTRON_IN_JOB_OFFSET=$(python3 -m recovery.injob offset "$RUN_DIR" || echo 0)
python3 -m recovery.exclusion start "$RUN_DIR"
[ $? -eq 42 ] && exit 42
read -r STEP_NODES NEXT_ADDR < <(python3 -m recovery.injob first "$RUN_DIR" --nodes 2)
if [ -z "$STEP_NODES" ]; then  # the pick could not run: the first nodes of the allocation
    STEP_NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 2 | paste -sd, -)
    NEXT_ADDR=$MASTER_ADDR
fi
while :; do
    export MASTER_ADDR=${NEXT_ADDR:-$MASTER_ADDR}
    # a port per step: the previous step's rendezvous port may still be in TIME_WAIT
    export MASTER_PORT=$((20000 + (${SLURM_JOB_ID:-0} + 7919 * (${SLURM_RESTART_COUNT:-0} + ${SLURMTRON_IN_JOB_OFFSET:-0})) % 12000))
    # the banner of an attempt (analysis/signatures.py): the lines after it belong to this step's restart count
    echo "slurmtron: job ${SLURM_JOB_ID:-?} restart $((${SLURM_RESTART_COUNT:-0} + SLURMTRON_IN_JOB_OFFSET)) step on $STEP_NODES (MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT, in-job offset $SLURMTRON_IN_JOB_OFFSET)"
    srun --nodelist="$STEP_NODES" --ntasks=4 --overlap --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=2 --cpus-per-task=2 --open-mode=append --output=/runs/golden/logs/%j_%t.out python3 -u -m train.worker "$RUN_DIR"
    rc=$?
    echo "slurmtron: srun exited $rc"
    [ $rc -eq 0 ] && exit 0
    # The judgement of recovery/crash.py (a final reason stays final), then: relaunch here (exit 0 and the
    # nodes), the requeue path (42), or stop (1).
    NEXT=$(python3 -m recovery.injob next "$RUN_DIR" --rc "$rc" --nodes "$STEP_NODES" --budget 3 --gpus 0)
    decision=$?
    [ $decision -eq 42 ] && exit 42
    [ $decision -eq 0 ] && [ -n "$NEXT" ] || exit $rc
    read -r STEP_NODES NEXT_ADDR <<< "$NEXT"
    SLURMTRON_IN_JOB_OFFSET=$((SLURMTRON_IN_JOB_OFFSET + 1))
done
