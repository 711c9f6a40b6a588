# ---- rendezvous: MASTER_ADDR is the first node of the allocation, as an address ----
# Node names do not always resolve (e.g. test clusters): try the resolver first, then the
# NodeAddr Slurm itself uses, and only then the bare name.
MASTER_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_ADDR=$(getent ahostsv4 "$MASTER_HOST" | awk '{print $1; exit}' || true)
if [ -z "$MASTER_ADDR" ]; then
    MASTER_ADDR=$(scontrol show node "$MASTER_HOST" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' | head -n 1 || true)
fi
export MASTER_ADDR=${MASTER_ADDR:-$MASTER_HOST}
# A port derived from the job id: two jobs sharing a node do not collide, and a requeued job
# (same id) gets the same port back.
export MASTER_PORT=$((20000 + ${SLURM_JOB_ID:-0} % 40000))
echo "slurmtron: MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"
