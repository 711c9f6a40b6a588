"""Find the checkpoint to resume from: the newest one that is complete AND verified.

The ``latest`` pointer is only a hint. The truth is the directory listing plus each
candidate's manifest: a checkpoint is loaded only if ``manifest.json`` parses, names this
format and version, agrees with the directory's step, and every listed file is present with
the listed size and BLAKE2b digest (and no unlisted file sneaked in). Anything else, such as
a staging ``.tmp`` left by a kill during a save, a directory without a manifest, or a shard
with one flipped byte, is skipped *with a reason*, and the search falls back to the
previous checkpoint. The worker turns every skip into a ``resume_fallback`` event and a log
line, so a silent fallback cannot happen (Megatron-LM #1570, NVRx PR #376 are what loading
torn or mixed checkpoints looks like).

No torch here: ``python -m recovery.resume RUN_DIR/checkpoints`` verifies on a login node.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from launch.kinds import EventKind
from launch.paths import CHECKPOINTS, RunDirError, RunPaths, given_run_dir
from recovery.commit import (
    ASIDE_SUFFIX,
    DELETE_SUFFIX,
    LATEST,
    STAGING_SUFFIX,
    _storage_error,
    manifest_of,
    parse_dir_name,
    read_latest,
    verify,
)
from recovery.events import read_events
from recovery.exit_codes import FINAL_REASONS
from recovery.identity import model_shape, read_run_id
from recovery.pickle_guard import unsafe_pickles
from recovery.quarantine import QUARANTINE_DIR, list_quarantine, quarantine
from recovery.storage import LocalStorage, StorageError
from recovery.trust import TRUST_ENV, trusts_shared, writable_by_others

__all__ = ["Resume", "ResumePlan", "find_latest_verified", "plan_resume", "explain", "main", "verify"]


@dataclass
class Resume:
    """The search result. ``path``/``step`` are None when there is nothing to resume from."""

    path: Optional[Path]
    step: Optional[int]
    meta: dict = field(default_factory=dict)
    skipped: list = field(default_factory=list)  # [(path, reason)] newer candidates passed over, newest first
    latest_hint: Optional[str] = None  # what the `latest` file said (may disagree; it is only a hint)
    owner: Optional[dict] = None  # the manifest's ``run`` (name, id, model) of the chosen checkpoint


def _list_root(root: Path, st: LocalStorage) -> list[str]:
    try:
        return st.list_dir(root)
    except OSError as e:
        err = _storage_error(e, root)
        if err is not None:
            raise err from e
        raise


def candidates_of(root: Path, *, storage: Optional[LocalStorage] = None,
                  not_dirs: Optional[list] = None) -> list[tuple[int, str, str]]:
    """Every checkpoint-like directory under ``root``: [(step, suffix, name)], newest first.

    At equal step: the final name, then ``.old``, then ``.tmp``. ``.del`` (a deletion the
    prune had begun) and ``quarantine/`` are not candidates. A committed checkpoint's name that
    is not a directory (replaced by a regular file) is not one either; its name is appended to
    ``not_dirs`` when given, so the caller can say so.
    """
    st = storage or LocalStorage()
    root = Path(root)
    out = []
    for name in _list_root(root, st):
        parsed = parse_dir_name(name)
        if parsed is None or parsed[1] == DELETE_SUFFIX:
            continue
        if not st.is_dir(root / name):
            if not_dirs is not None and parsed[1] != STAGING_SUFFIX:
                not_dirs.append(name)
            continue
        out.append((parsed[0], parsed[1], name))
    out.sort(key=lambda c: (-c[0], {"": 0, ASIDE_SUFFIX: 1}.get(c[1], 2)))
    return out


def find_latest_verified(
    root: Path,
    *,
    storage: Optional[LocalStorage] = None,
    deep: bool = True,
) -> Resume:
    """Newest verified checkpoint under ``root``; newer candidates that fail are in ``skipped``.

    Candidates are every ``iter_NNNNNNN[.tmp|.old]`` directory, newest step first (at equal
    step: the final name, then ``.old``, then ``.tmp``). A ``.old`` directory is a committed
    checkpoint that a re-save of the same step had moved aside when it was killed, so it is
    loaded if it verifies; a ``.tmp`` never is. Older checkpoints than the one chosen are not
    read at all, so the cost is one deep verification in the common case.

    Raises :class:`recovery.storage.StorageError` when a candidate cannot be read at all: the
    search does not fall back past a checkpoint it could not judge.
    """
    st = storage or LocalStorage()
    root = Path(root)
    hint = read_latest(root, storage=st)
    skipped: list = []
    for step, _suffix, name in candidates_of(root, storage=st):
        path = root / name
        reason = verify(path, storage=st, deep=deep)
        if reason is None:
            doc = manifest_of(path, storage=st)
            return Resume(path=path, step=step, meta=doc.get("meta") or {}, skipped=skipped, latest_hint=hint,
                          owner=doc.get("run"))
        skipped.append((path, reason))
    return Resume(path=None, step=None, meta={}, skipped=skipped, latest_hint=hint)


# ---- whose checkpoint is it ---------------------------------------------------------------

def owner_problem(owner: Optional[dict], identity: Optional[dict], meta: Optional[dict] = None) -> Optional[str]:
    """Why a checkpoint whose manifest says ``owner`` is not this run's (``identity``), or None.

    Both are ``{"name", "id", "model"}``. A different run name, a different run id (the run
    directory was created anew under the same name) or a different model shape is another
    run's checkpoint. A manifest without an owner (written before manifests carried one) is
    judged by its model shape only (``meta["model"]``).
    """
    if identity is None:
        return None
    if not owner:
        shape = (meta or {}).get("model")
        if shape is not None and identity.get("model") is not None and shape != identity.get("model"):
            return f"model shape {shape} != this run's {identity.get('model')}"
        return None
    if owner.get("name") != identity.get("name"):
        return f"written by run {owner.get('name')!r} (id {owner.get('id')}), this is run {identity.get('name')!r}"
    if identity.get("id") and owner.get("id") != identity.get("id"):
        return (f"written by an earlier run named {owner.get('name')!r} with run id {owner.get('id')}; this run "
                f"directory's run id is {identity.get('id')} (the run directory was created anew)")
    if identity.get("model") is not None and owner.get("model") not in (None, identity.get("model")):
        return f"model shape {owner.get('model')} != this run's {identity.get('model')}"
    return None


# ---- the start decision: resume, start, or refuse --------------------------------------------

@dataclass
class ResumePlan:
    """What an attempt does with the checkpoints it finds (:func:`plan_resume`).

    ``action`` is ``resume`` (``path``/``step``), ``start`` (step 0) or ``refuse`` (``reason``,
    ``detail``; the worker exits with the reason's exit code and Slurm does not requeue).
    ``notices`` are the visible fallbacks: each is a WARNING line and an event
    ``{"event": kind, "message": text, **fields}``.
    """

    action: str
    reason: str
    detail: str = ""
    path: Optional[Path] = None
    step: Optional[int] = None
    meta: dict = field(default_factory=dict)
    notices: list = field(default_factory=list)


def committed_steps(events: list) -> list:
    """Steps the run's event log says were committed, since its last explicit start-over."""
    steps: list = []
    for e in events:
        if e.get("event") == EventKind.START_OVER:
            steps = []
        elif e.get("event") == EventKind.CHECKPOINT_SAVED and e.get("step") is not None:
            steps.append(e.get("step"))
    return steps


def plan_resume(
    root: Path,
    *,
    identity: Optional[dict] = None,
    committed: Sequence[int] = (),
    restart_from_scratch: bool = False,
    apply: bool = True,
    storage: Optional[LocalStorage] = None,
    clock: Callable[[], float] = time.time,
    trust_shared: bool = False,
    uid: Optional[int] = None,
) -> ResumePlan:
    """Decide how an attempt starts; never falls back silently, never deletes.

    * A checkpoint that cannot be read at all (EACCES, EIO, ESTALE, a missing mount: the
      directory is gone although ``committed`` says checkpoints were written) -> refuse,
      reason ``storage_error``. Nothing is skipped, pruned or quarantined on that evidence.
    * ``restart_from_scratch`` (the caller passes it on a fresh submission only) -> every
      existing checkpoint is moved to ``quarantine/`` and the run starts at step 0.
    * The newest verified checkpoint belongs to another run -> refuse, ``foreign_checkpoint``.
    * One verifies -> resume from it; every newer one passed over is a notice, and a corrupt
      committed one (checksum/completeness) is quarantined. A ``latest`` naming a directory
      that no longer exists is a notice too.
    * Checkpoints exist (committed, set aside, or a staged save when ``committed`` is not
      empty) and none verifies -> refuse, ``no_loadable_checkpoint``, listing each and why.
      A lone staged save of a run that never committed anything (killed in its first save)
      is not a checkpoint that could be lost: that starts at step 0, with a notice.

    * The checkpoint that would be loaded holds a pickle needing more than checkpoint data
      types (:mod:`recovery.pickle_guard`) -> it is quarantined, refuse, ``unsafe_checkpoint``.
    * It (or the checkpoint directory) is writable by other users or owned by another uid
      (:mod:`recovery.trust`) -> refuse, ``shared_checkpoint``, unless ``trust_shared``
      (then a notice).

    ``apply=False`` changes nothing on disk (``python -m recovery.resume`` explains with it):
    its notices say "would quarantine".
    """
    st = storage or LocalStorage()
    root = Path(root)
    notices: list = []
    try:
        if not st.is_dir(root):
            if st.exists(root):  # a file where the directory belongs: neither missing nor something to start over on
                return ResumePlan(
                    "refuse", "storage_error",
                    f"the checkpoint directory {root} is a file, not a directory; nothing was started. Move it "
                    f"away (mv {root} {root}.file), then launch again")
            if committed and not restart_from_scratch:
                return ResumePlan(
                    "refuse", "storage_error",
                    f"checkpoint directory {root} is missing, but the event log records committed checkpoints "
                    f"(steps {', '.join(str(s) for s in committed[-3:])}): is its filesystem mounted? Nothing "
                    f"was started; to start over deliberately set training.restart_from_scratch=true")
            return ResumePlan("start", "start", "no checkpoint directory yet")
        not_dirs: list = []
        found = candidates_of(root, storage=st, not_dirs=not_dirs)
        for name in not_dirs:  # moved aside (never deleted): a save of that step would otherwise replace it
            dest = quarantine(root, root / name, "not a directory (a checkpoint replaced by a file?)", storage=st,
                              clock=clock) if apply else None
            notices.append({"event": EventKind.RESUME_FALLBACK, "skipped": str(root / name),
                            "reason": "not_a_directory", "to": str(dest) if dest else None,
                            "message": f"skipping {root / name}: it is not a directory (a checkpoint replaced by a "
                                       f"file?); " + (f"moved to {dest}, so that no save replaces it" if apply else
                                                      "the restart would move it to quarantine/")})
        if restart_from_scratch:
            for step, suffix, name in found:
                dest = quarantine(root, root / name, "training.restart_from_scratch=true", storage=st,
                                  clock=clock) if apply else None
                notices.append({"event": EventKind.QUARANTINE, "path": str(root / name), "to": str(dest),
                                "reason": "training.restart_from_scratch=true",
                                "message": f"restart_from_scratch: moving {root / name} to {dest}" if apply else
                                           f"restart_from_scratch: would move {root / name} to quarantine/"})
            return ResumePlan("start", "restart_from_scratch",
                              f"starting at step 0 as asked; {len(found)} earlier checkpoint(s) moved to "
                              f"{root / QUARANTINE_DIR}", notices=notices)
        res = find_latest_verified(root, storage=st)
    except StorageError as e:
        return ResumePlan("refuse", "storage_error",
                          f"cannot read the checkpoints: {e}. This is an environment error (permissions, quota, "
                          f"I/O, a stale or missing mount), not a corrupt checkpoint: nothing was skipped, "
                          f"pruned or quarantined; fix access and resubmit")
    hint = res.latest_hint
    raw = _raw_latest(root, st)
    if raw and not hint:
        notices.append({"event": EventKind.RESUME_FALLBACK, "skipped": None, "reason": "latest_invalid",
                        "message": f"'latest' says {raw[:200]!r}, which is not a checkpoint name of {root} (it "
                                   f"points outside the run's checkpoint directory?); ignoring it, searching the "
                                   f"directory instead"})
    if hint and not st.exists(root / hint):
        notices.append({"event": EventKind.RESUME_FALLBACK, "skipped": str(root / hint),
                        "reason": "latest_target_missing",
                        "message": f"'latest' names {hint}, which does not exist; searching the directory instead"})
    if res.path is not None:
        problem = owner_problem(res.owner, identity, res.meta)
        if problem:
            return ResumePlan("refuse", "foreign_checkpoint",
                              f"{res.path} is not this run's checkpoint: {problem}. Nothing was loaded or changed; "
                              f"give this run its own directory (run.name / cluster.checkpoint_root) or start over "
                              f"deliberately with training.restart_from_scratch=true")
        if res.owner is None and identity is not None:
            notices.append({"event": EventKind.RESUME_FALLBACK, "skipped": None, "reason": "no_owner",
                            "message": f"{res.path} records no owner (an older manifest); its model shape matches, "
                                       f"loading it"})
    for path, reason in res.skipped:
        parsed = parse_dir_name(Path(path).name)
        notices.append({"event": EventKind.RESUME_FALLBACK, "skipped": str(path), "reason": reason,
                        "message": f"skipping checkpoint {path}: {reason}"})
        if res.path is not None and parsed and parsed[1] != STAGING_SUFFIX:
            dest = quarantine(root, Path(path), reason, storage=st, clock=clock) if apply else None
            notices.append({"event": EventKind.QUARANTINE, "path": str(path), "to": str(dest), "reason": reason,
                            "message": f"quarantined {path} -> {dest}: {reason}" if apply else
                                       f"would quarantine {path} (to quarantine/): {reason}"})
    if res.path is not None:
        refused = _vet_safety(root, res.path, notices, apply=apply, storage=st, clock=clock,
                              trust_shared=trust_shared, uid=uid)
        if refused is not None:
            return refused
        return ResumePlan("resume", "resume", f"newest verified checkpoint {res.path}", path=res.path,
                          step=res.step, meta=res.meta, notices=notices)
    committed_like = [p for p, _r in res.skipped if parse_dir_name(Path(p).name)[1] != STAGING_SUFFIX]
    if res.skipped and (committed_like or committed):
        listing = "; ".join(f"{Path(p).name}: {r}" for p, r in res.skipped)
        return ResumePlan("refuse", "no_loadable_checkpoint",
                          f"{len(res.skipped)} checkpoint(s) in {root} and none verifies ({listing}). Not starting "
                          f"over on my own: inspect them, or start from step 0 deliberately with "
                          f"training.restart_from_scratch=true (they are moved to {root / QUARANTINE_DIR}, "
                          f"not deleted)", notices=notices)
    if committed and not res.skipped:
        try:
            moved = [name for name, _why in list_quarantine(root, storage=st)]
        except OSError:
            moved = []
        if moved:  # every checkpoint was quarantined: say where they are and how one comes back
            q = root / QUARANTINE_DIR
            return ResumePlan("refuse", "storage_error",
                              f"{root} holds no checkpoint: every one was moved to {q} ({', '.join(moved[-3:])}; "
                              f"`python -m recovery.resume {root}` lists why). Nothing was started; to resume from "
                              f"one, move it back (mv {q / moved[-1]} {root / moved[-1].split('.')[0]}); to start "
                              f"over deliberately set training.restart_from_scratch=true")
        return ResumePlan("refuse", "storage_error",
                          f"{root} holds no checkpoint, but the event log records committed checkpoints (steps "
                          f"{', '.join(str(s) for s in committed[-3:])}): were they moved, deleted, or is this "
                          f"the wrong filesystem? Nothing was started; to start over deliberately set "
                          f"training.restart_from_scratch=true")
    if res.skipped:
        notices.append({"event": EventKind.RESUME_FALLBACK, "skipped": str(res.skipped[0][0]),
                        "reason": "torn_first_save",
                        "message": "the only checkpoint is a staged save that never committed, and the run never "
                                   "committed one: starting at step 0"})
    return ResumePlan("start", "start", "no checkpoint yet", notices=notices)


def _raw_latest(root: Path, st: LocalStorage) -> Optional[str]:
    """What the ``latest`` file says, unchecked (None when it is missing or unreadable)."""
    try:
        return st.read_text(Path(root) / LATEST).strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _vet_safety(root: Path, path: Path, notices: list, *, apply: bool, storage: LocalStorage,
                clock: Callable[[], float], trust_shared: bool, uid: Optional[int]) -> Optional[ResumePlan]:
    """The checkpoint about to be loaded: no pickle that could run code, no writer but the run's user.

    A refusal, or None to go on (a trusted shared checkpoint adds a notice)."""
    try:
        unsafe = unsafe_pickles(path)
        shared = None if unsafe else writable_by_others(root, path, uid=uid)
    except OSError as e:
        return ResumePlan("refuse", "storage_error",
                          f"cannot read {path} to check it before loading ({e.strerror or e}): an environment "
                          f"error, nothing was loaded, skipped or quarantined; fix access and resubmit",
                          notices=notices)
    if unsafe:
        reason = f"unsafe pickle: {unsafe}"
        dest = quarantine(root, path, reason, storage=storage, clock=clock) if apply else None
        notices.append({"event": EventKind.QUARANTINE, "path": str(path), "to": str(dest),
                        "reason": "unsafe_checkpoint",
                        "why": unsafe,
                        "message": f"quarantined {path} -> {dest}: {reason}" if apply else
                                   f"would quarantine {path} (to quarantine/): {reason}"})
        where = f"it was moved to {dest}" if apply else "a restart would move it to quarantine/"
        return ResumePlan("refuse", "unsafe_checkpoint",
                          f"{path} was not loaded: {unsafe}. Checkpoints this toolkit writes need only checkpoint "
                          f"data types, so it was changed after its save (a manifest does not stop a writer: it can "
                          f"be resealed); {where}. Find out who changed it; a resubmission resumes from the "
                          f"previous verified checkpoint", notices=notices)
    if shared:
        if not trust_shared:
            return ResumePlan("refuse", "shared_checkpoint",
                              f"{shared}: another user could have changed what this run would load. Nothing was "
                              f"loaded or changed; make it private (chmod -R go-w {root}, owned by this user) or, "
                              f"if sharing it is intended, set {TRUST_ENV}=1", notices=notices)
        notices.append({"event": EventKind.SHARED_CHECKPOINT_TRUSTED, "path": str(path), "reason": "trusted_by_env",
                        "message": f"{shared}; loading it anyway because {TRUST_ENV}=1"})
    return None


def run_context(arg: Path, *, storage: Optional[LocalStorage] = None) -> tuple[Path, Optional[Path], Optional[dict]]:
    """What the inspector was given: (checkpoint directory, run directory or None, run identity or None).

    ``arg`` is a run directory (it holds ``config.yaml``: its checkpoint directory follows
    ``cluster.checkpoint_root`` and ``run.name``, as for the worker) or a checkpoint directory
    (``runs/NAME/checkpoints``: its parent is the run directory when it holds ``config.yaml``).
    Read-only: a missing run id is not created.
    """
    from types import SimpleNamespace

    import yaml

    st = storage or LocalStorage()
    arg = Path(arg)
    run_dir = arg if st.exists(RunPaths.of(arg).config) else (
        arg.parent if arg.name == CHECKPOINTS and st.exists(RunPaths.of(arg.parent).config) else None)
    if run_dir is None:
        return arg, None, None
    try:
        cfg = yaml.safe_load(st.read_text(RunPaths.of(run_dir).config))
        name, ckroot = str(cfg["run"]["name"]), str(cfg["cluster"].get("checkpoint_root") or "")
        model = model_shape(SimpleNamespace(**cfg["model"]))
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        return (arg if arg != run_dir else RunPaths.of(run_dir).checkpoints), run_dir, None
    root = RunPaths.of(run_dir, name, ckroot).checkpoints
    return root, run_dir, {"name": name, "id": read_run_id(run_dir), "model": model}


def explain(root: Path, *, storage: Optional[LocalStorage] = None,
            env: Optional[dict] = None) -> tuple[int, str]:
    """``python -m recovery.resume RUN_DIR|CHECKPOINT_ROOT``: (exit code, text) saying what a restart would do.

    The verdict is :func:`plan_resume`'s, with ``apply=False``: the same decision the worker makes
    (with the run's identity and the checkpoints its event log records when the run directory is
    known), changing nothing on disk.
    """
    st = storage or LocalStorage()
    given = Path(root)
    root, run_dir, identity = run_context(given, storage=st)
    if run_dir is None and not st.exists(root):
        return 2, f"error: {root} does not exist (give the run directory, e.g. runs/NAME, or its checkpoint directory)"
    if st.exists(root) and not st.is_dir(root):
        return 2, f"error: {root} is not a directory (give the run directory, e.g. runs/NAME, or its checkpoint directory)"
    committed = committed_steps(read_events(RunPaths.of(run_dir).events)) if run_dir is not None else []
    lines = [f"checkpoint directory {root}" + (f" (run directory {run_dir})" if run_dir is not None else
                                               " (run directory unknown: whose checkpoints these are is not checked; "
                                               "give the run directory to check it)")]
    if st.is_dir(root):
        try:
            found = candidates_of(root, storage=st)
            hint = read_latest(root, storage=st)
            raw = _raw_latest(root, st)
            shown = hint or (f"{raw!r} (WARNING: not a checkpoint of this directory)" if raw else "(none)")
            lines.append(f"latest -> {shown}" + ("" if not hint or st.exists(root / hint) else
                                                 "  (WARNING: that directory does not exist)"))
            for step, _suffix, name in found:
                reason = verify(root / name, storage=st)
                lines.append(f"  {name}: {'verified' if reason is None else reason}")
        except StorageError as e:
            lines.append(f"  cannot read: {e} (an environment error, not a corrupt checkpoint)")
        try:
            for name, reason in list_quarantine(root, storage=st):
                lines.append(f"  quarantine/{name}: {reason}")
        except OSError:
            pass
    else:
        lines.append("  (the checkpoint directory does not exist)")
    plan = plan_resume(root, identity=identity, committed=committed, apply=False, storage=st,
                       trust_shared=trusts_shared(os.environ if env is None else env))
    for n in plan.notices:
        lines.append(f"WARNING: {n['message']}")
    if plan.action == "resume":
        lines.append(f"a restart would load {plan.path} (step {plan.step})")
        code = 0
    elif plan.action == "start":
        lines.append(f"a restart would start at step 0: {plan.detail}")
        code = 1
    else:
        lines.append(f"a restart would refuse ({plan.reason}, the worker exits {FINAL_REASONS.get(plan.reason)}): "
                     f"{plan.detail}")
        code = 3
    lines.append(json.dumps({"action": plan.action, "reason": plan.reason, "exit_code": FINAL_REASONS.get(plan.reason),
                             "path": str(plan.path) if plan.path else None, "step": plan.step,
                             "latest_hint": read_latest(root, storage=st) if st.is_dir(root) else None,
                             "meta": plan.meta}, default=str))
    return code, "\n".join(lines)


USAGE = """usage: python -m recovery.resume RUN_DIR|CHECKPOINT_ROOT   (e.g. runs/NAME or runs/NAME/checkpoints)

Read-only: print which checkpoint a restart would load and why, verifying each candidate's manifest
(every file's size and digest) newest first, with the reason for every one it skips, and checking the
one it would load as the restart does (no pickle that could run code, no other user able to write it).
Given the run directory, it also judges whose checkpoints they are and what the event log records, as
the restart does. Moves nothing ("would quarantine").

exit codes: 0 it would resume, 1 nothing to resume (it would start at step 0), 2 bad argument,
            3 it would refuse (the reason is printed)

documentation: docs/recovery.md in the slurmtron repository"""


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m recovery.resume RUN_DIR|CHECKPOINT_ROOT``: print what a restart would load, and why.

    Exit 0: it would resume; 1: nothing to resume (it would start at step 0); 3: it would
    refuse (the reason is printed); 2: bad argument.
    """
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m recovery.resume RUN_DIR|CHECKPOINT_ROOT (--help for more)", file=sys.stderr)
        return 2
    try:  # the run-directory rule of every entry point: resolved, so the verdict names the real directory
        root = given_run_dir(args[0], "checkpoint directory")
    except RunDirError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    code, text = explain(root)
    print(text, file=sys.stderr if code == 2 else sys.stdout)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
