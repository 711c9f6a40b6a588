# ---- the training step, with in-job restart on spare nodes (recovery/injob.py) ----
# One task per GPU, each task one rank, no launcher between Slurm and the ranks (see srun.sh for why, and for
# --signal and --kill-on-bad-exit); --ntasks, because the allocation's own count includes the spares.
# The allocation holds {{nodes}} + {{spare_nodes}} spare node(s) and was submitted with --no-kill, so a failed node
# does not end it: after a crash, a hang or a lost node, a new srun step starts on {{nodes}} healthy nodes of
# it (cluster.in_job_restarts={{budget}} times per allocation), resuming from the newest verified checkpoint as
# after a requeue; then the requeue path takes over.
# If the node running this script fails, Slurm ends the job and --requeue brings it back.
# --overlap: a step cut by a lost node keeps its CPUs booked until Slurm gives up on the dead node's
# slurmstepd (minutes); its processes on the live nodes are gone, so the next step may use them.
set +e
# Every step is an attempt of its own (restart limit, zero-progress guard, events): its restart count is
# Slurm's plus the relaunches this job made before it.
export SLURMTRON_IN_JOB_OFFSET=$({{python}} -m recovery.injob offset "$RUN_DIR" || echo 0)
{{python}} -m recovery.exclusion start "$RUN_DIR"{{exclusion_flags}}
[ $? -eq 42 ] && exit 42
read -r STEP_NODES NEXT_ADDR < <({{python}} -m recovery.injob first "$RUN_DIR" --nodes {{nodes}})
if [ -z "$STEP_NODES" ]; then  # the pick could not run: the first nodes of the allocation
    STEP_NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n {{nodes}} | paste -sd, -)
    NEXT_ADDR=$MASTER_ADDR
fi
while :; do
    export MASTER_ADDR=${NEXT_ADDR:-$MASTER_ADDR}
    # a port per step: the previous step's rendezvous port may still be in TIME_WAIT
    export MASTER_PORT={{master_port}}
    # the banner of an attempt (analysis/signatures.py): the lines after it belong to this step's restart count
    echo "slurmtron: job ${SLURM_JOB_ID:-?} restart $((${SLURM_RESTART_COUNT:-0} + SLURMTRON_IN_JOB_OFFSET)) step on $STEP_NODES (MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT, in-job offset $SLURMTRON_IN_JOB_OFFSET)"
    srun --nodelist="$STEP_NODES" --ntasks={{ntasks}} --overlap {{srun_args}} {{python}} -u -m train.worker "$RUN_DIR"
    rc=$?
    echo "slurmtron: srun exited $rc"
    [ $rc -eq 0 ] && exit 0
    # The judgement of recovery/crash.py (a final reason stays final), then: relaunch here (exit 0 and the
    # nodes), the requeue path (42), or stop (1).
    NEXT=$({{python}} -m recovery.injob next "$RUN_DIR" --rc "$rc" --nodes "$STEP_NODES" --budget {{budget}} --gpus {{gpus}}{{exclusion_flags}})
    decision=$?
    [ $decision -eq 42 ] && exit 42
    [ $decision -eq 0 ] && [ -n "$NEXT" ] || exit $rc
    read -r STEP_NODES NEXT_ADDR <<< "$NEXT"
    SLURMTRON_IN_JOB_OFFSET=$((SLURMTRON_IN_JOB_OFFSET + 1))
done
