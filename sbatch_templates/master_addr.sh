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
export MASTER_PORT={{master_port}}
echo "slurmtron: MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"
