# ---- the training step: one task per GPU, each task is one rank ----
# Why no torchrun: an extra launcher between Slurm and the ranks swallows or delays Slurm's
# signals. Why --signal=USR2@lead without "B:": with B: Slurm signals only the batch shell, which
# would have to forward it; without it, Slurm delivers USR2 to every task of the step, i.e. to
# every training rank, whose handler sets a stop flag that the ranks agree on at the next step.
# --kill-on-bad-exit=1: one failed rank ends the step instead of leaving the others hanging in a
# collective. Exit {{exit_requeue}} from the ranks means "checkpointed, requeue me" (see recovery/).
set +e
# Before each attempt: learn nodes Slurm saw fail (sacct -D after a NODE_FAIL) and, if this
# allocation holds a recorded failed node, requeue away from it (exit {{exit_requeue}}) instead of training
# there. A check that cannot run only costs the exclusion, never the attempt.
{{python}} -m recovery.exclusion start "$RUN_DIR"{{exclusion_flags}}
[ $? -eq {{exit_requeue}} ] && exit {{exit_requeue}}
srun {{srun_args}} {{python}} -u -m train.worker "$RUN_DIR"
rc=$?
echo "slurmtron: srun exited $rc"
# Slurm never reruns a FAILED job: a crashed attempt (per the run's event log, not srun's code,
# which --kill-on-bad-exit makes 143) is requeued here; the next attempt's zero-progress guard
# and training.max_restarts end a deterministic crash loop (recovery/crash.py). A final code (a refusal,
# listed below) is never requeued, and a job that does not hold the run lock writes nothing into the run.
# Final codes (recovery/exit_codes.py): {{refusal_codes}}
REQUEUE_ON_CRASH={{requeue_on_crash}}  # cluster.requeue_allowed and training.requeue_on_crash
if [ $rc -ne 0 ] && [ "$REQUEUE_ON_CRASH" = 1 ]; then
    {{python}} -m recovery.crash "$RUN_DIR" --rc "$rc"
    [ $? -eq {{exit_requeue}} ] && exit {{exit_requeue}}
fi
exit $rc
