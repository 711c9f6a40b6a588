# ---- Lustre: stripe the checkpoint directory so every rank's shard write uses many OSTs ----
# Striping applies to files created afterwards; an existing directory keeps its files' layout.
CKPT_DIR={{checkpoint_dir}}
mkdir -p "$CKPT_DIR"
if command -v lfs >/dev/null 2>&1; then
    lfs setstripe -c {{stripe_count}} -S {{stripe_size}} "$CKPT_DIR" || echo "slurmtron: lfs setstripe failed on $CKPT_DIR (continuing unstriped)"
else
    echo "slurmtron: lfs not found; $CKPT_DIR is not striped"
fi
