"""The command-line surface the login entry points share: one line for every override error,
the unknown-key refusal, and the short ``--help`` usages.

Hydra's own override errors are several lines (a caret under a lexer error, "To append to your
config use +key", the config search path, "Set HYDRA_FULL_ERROR=1") and exit 1. Every
entry point turns them into the one refusal line of :func:`override_error_line` (the override,
what is wrong, a "did you mean" from the schema or the group's choices) and exit 2, the same
status as any other refusal. :func:`job_or_refusal` is the one check of a composed config that
``pretrain.py``, ``plan.py`` and ``preflight.py`` share (a ``+key`` the schema lacks, a missing
value, an unresolvable ``${...}``).

Login-node code: Hydra, OmegaConf and the schema only, no torch.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from typing import Optional, Sequence

from omegaconf import DictConfig
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from launch.compose import CONFIG_DIR, MOVED, config_error, migrate_overrides, to_job, unknown_keys
from launch.config import Job, register_configs
from launch.problems import format_problems

EXIT_REFUSED = 2
GROUPS = ("cluster", "data", "model", "parallelism", "training")


def group_choices(group: str) -> list[str]:
    """The options a user can pick for a config group (the YAML files of ``hydra_conf/<group>/``)."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def _close(word: str, options: Sequence[str]) -> Optional[str]:
    found = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    if not found:  # 7bb -> 7b, tinyy -> tiny: a prefix is a good guess for short names
        found = [o for o in options if word.startswith(o) or o.startswith(word)][:1]
    return found[0] if found else None


def _in_map(dotted: str) -> bool:
    """Whether ``dotted`` names a key inside a dict field of the schema (``cluster.env.NAME``)."""
    cls: object = Job
    parts = dotted.split(".")
    for part in parts[:-1]:
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return False
        if part not in {f.name for f in dataclasses.fields(cls)}:
            return False
        cls = typing.get_type_hints(cls).get(part)
    return len(parts) > 1 and typing.get_origin(cls) in (dict, typing.Dict)


def schema_suggestion(dotted: str) -> tuple[str, Optional[str]]:
    """(the first unknown part of ``dotted``, the closest existing dotted key or None).

    ``trainig.lr`` -> ("trainig", "training.lr"); ``parallelism.tpp`` -> ("parallelism.tpp",
    "parallelism.tp"). Walks the schema dataclasses (launch/config.py); a part below a field that
    is not a dataclass (a dict, a list) is left as it is.
    """
    parts = dotted.split(".")
    cls: object = Job
    fixed: list[str] = []
    bad = ""
    for i, part in enumerate(parts):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            fixed.extend(parts[i:])
            break
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            bad = bad or ".".join(fixed + [part])
            guess = _close(part, names)
            if guess is None:
                return bad, None
            part = guess
        fixed.append(part)
        cls = typing.get_type_hints(cls).get(part)
    return bad or dotted, (".".join(fixed) if bad else None)


def _user_override(argv: Sequence[str], key: str) -> str:
    """The override on the command line that sets ``key`` (``key=value`` as typed), or ''."""
    for a in argv:
        k, sep, _ = a.partition("=")
        if sep and k.lstrip("+~") == key:
            return a
    return ""


def override_error_line(exc: BaseException, argv: Sequence[str] = ()) -> str:
    """One line for an error Hydra raised while parsing the overrides or composing the config."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    if isinstance(exc, OverrideParseException):
        first = next((ln.strip() for ln in str(exc.message).splitlines() if ln.strip()), "syntax error")
        return (f"refused: cannot parse the override {exc.override!r} ({first}); quote a value that has spaces, "
                f"non-ASCII or special characters, e.g. 'run.name=\"my run\"', and write key=value once per "
                f"word (Hydra's override grammar)")
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and "/" in str(exc.missing_cfg_file):
        group, _, choice = str(exc.missing_cfg_file).rpartition("/")
        options = list(exc.options or group_choices(group))
        guess = _close(choice, options)
        hint = f"did you mean {group}={guess}? " if guess else ""
        return f"refused: unknown choice {group}={choice}; {hint}(choices: {', '.join(options)})"
    if isinstance(exc, ConfigCompositionException):
        line = _yaml_key_line(str(exc))
        if line:
            return line
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        key = msg.split("'")[1] if msg.startswith("Could not override '") and msg.count("'") >= 2 else ""
        cause = exc.__cause__
        if not key and msg.startswith("Error merging override "):  # a value of the wrong type
            key = msg.removeprefix("Error merging override ").partition("=")[0].lstrip("+~")
        typed = _user_override(argv, key) or key
        if key and (cause is None or type(cause).__name__ in ("ConfigKeyError", "ConfigAttributeError")):
            if "." not in key and key in GROUPS:  # e.g. model=... given twice or a group removed
                return f"refused: {typed}: {msg}"
            bad, guess = schema_suggestion(key)
            if guess is None and "." not in key:
                guess = _close(key, list(GROUPS))
            value = typed.partition("=")[2]
            if _in_map(key) and not typed.startswith("+"):  # cluster.env.NAME: a new key of a map needs Hydra's '+'
                return (f"refused: {key} is a new key of the map {key.rpartition('.')[0]}: add it with "
                        f"+{key}={value} (Hydra's '+' adds a key; without it only existing keys can be changed)")
            hint = f"; did you mean {guess}={value}?" if guess else \
                "; the fields are in launch/config.py (python launch/pretrain.py --help-config lists them)"
            return f"refused: unknown key {bad} in {typed}{hint}"
        if isinstance(cause, OmegaConfBaseException):
            why = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
            return f"refused: {typed or key}: {why}"
        return f"refused: {msg}"
    if isinstance(exc, ValueError) and str(exc).startswith("Config group override must be a string"):
        line = _group_value_line(argv)  # model=70: Hydra parsed the choice as a number
        if line:
            return line
    text = str(exc).strip()
    return f"refused: {text.splitlines()[0] if text else type(exc).__name__}"


def _yaml_key_line(text: str) -> str:
    """One line for a key of a YAML file under hydra_conf/ that the schema lacks (Hydra: "In 'cluster/site':
    ConfigKeyError ... full_key: cluster.x"), naming the new place of a moved key (:data:`launch.compose.MOVED`)
    or the closest field; '' for any other error."""
    found = re.match(r"In '([^']+)': ConfigKeyError", text)
    key = re.search(r"full_key: (\S+)", text)
    if not (found and key):
        return ""
    where, key = f"hydra_conf/{found.group(1)}.yaml", key.group(1)
    if key in MOVED:
        parts = MOVED[key].split(".")[1:]  # below the group the file sets
        nested = "".join(f"{p}: {{" for p in parts[:-1]) + f"{parts[-1]}: ..." + "}" * (len(parts) - 1)
        return f"refused: {where}: {key} moved to {MOVED[key]}; write it in that file as {nested}"
    _, guess = schema_suggestion(key)
    hint = f"; did you mean {guess}?" if guess else "; the fields are in launch/config.py"
    return f"refused: {where}: unknown key {key}{hint}"


def _group_value_line(argv: Sequence[str]) -> str:
    """One line for a config group given a value that is no name (``model=70``), or ''."""
    for a in argv:
        key, sep, value = a.partition("=")
        group = key.lstrip("+~")
        if sep and group in GROUPS and value not in group_choices(group):
            options = group_choices(group)
            guess = _close(value, options)
            hint = f"did you mean {group}={guess}? " if guess else ""
            return (f"refused: {a}: {group} takes one of its choices by name; {hint}"
                    f"(choices: {', '.join(options)})")
    return ""


def interpolation_refusal(exc: InterpolationResolutionError) -> str:
    """One line for a ``${...}`` that OmegaConf could not resolve (typically shell text in cluster.setup/env)."""
    key = getattr(exc, "full_key", "") or "?"
    why = str(getattr(exc, "msg", "") or exc).splitlines()[0]
    return (f"refused: {key}: {why}; OmegaConf reads ${{...}} as a reference to another config key. For a shell "
            f"variable write $HOME (no braces) or escape it as \\${{HOME}} (the batch script then gets ${{HOME}})")


def job_or_refusal(cfg: DictConfig, done: str = "nothing was submitted") -> tuple[Optional[Job], str]:
    """(the typed Job, '') or (None, the refusal text): the one check of a composed config that every
    entry point makes before its own work. A ``+key`` the schema lacks is refused (with a "did you
    mean"), never dropped; a missing value (``???``) or an unresolvable ``${...}`` is one line."""
    unknown = unknown_keys(cfg)
    if unknown:
        return None, format_problems(unknown).replace("nothing was submitted", done)
    try:
        return to_job(cfg), ""
    except InterpolationResolutionError as exc:  # typically shell text ${HOME} in cluster.setup/env
        return None, interpolation_refusal(exc)
    except OmegaConfBaseException as exc:  # a missing value (???) or a bad interpolation
        return None, f"refused: {config_error(exc)}; {done}"


def compose_config(overrides: Sequence[str]) -> DictConfig:
    """Compose ``hydra_conf/config.yaml`` with ``overrides`` outside ``@hydra.main`` (Hydra's errors
    propagate: give them to :func:`override_error_line`)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=migrate_overrides(overrides))


# ---- --help -----------------------------------------------------------------------------------

COMMON_OVERRIDES = """\
common overrides (Hydra key=value; the schema is launch/config.py):
  model=<{models}>
  cluster=<{clusters}>   cluster.nodes=N  cluster.run_root=DIR
  parallelism=<recipe|auto>  parallelism.tp=N  parallelism.pp=N
  training.train_iters=N  training.global_batch_size=N  data=<{data}>  run.name=NAME
  --help-config   the config groups, their choices and the composed config (Hydra's help)
  --cfg job       print the composed config and exit"""


def usage(what: str, synopsis: str, docs: str, extra: str = "", overrides: bool = True) -> str:
    """A short ``--help`` text: the synopsis, what the command does, the common arguments, the docs page
    (``docs``: a file name under docs/)."""
    parts = [f"usage: {synopsis}", "", what.strip()]
    if extra:
        parts += ["", extra.rstrip()]
    if overrides:
        parts += ["", COMMON_OVERRIDES.format(models=", ".join(group_choices("model")),
                                             clusters=", ".join(group_choices("cluster")),
                                             data=", ".join(group_choices("data")))]
    parts += ["", f"documentation: docs/{docs} in the slurmtron repository"]
    return "\n".join(parts)


def wants_help(argv: Sequence[str]) -> bool:
    """``-h`` or ``--help`` among the arguments (not a value of ``key=value``)."""
    return any(a in ("-h", "--help") for a in argv)
