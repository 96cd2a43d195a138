"""The paths a run specification names on the trainer, resolved against the trainer's roots.

A question file (``data.train``, ``data.validation``) must lie under one of the data roots
(``PBSD_TRAINER_DATA_ROOTS``); a checkpoint or tokenizer directory (``model.path``,
``model.tokenizer``) under one of the model roots (``PBSD_TRAINER_MODEL_ROOTS``) or the runs
folder (a run may start from another's checkpoint); a DeepSpeed config file under any of them,
held to the inline config's rules. Neither may name a file or folder for DeepSpeed to write to
(:mod:`services.trainer.deepspeed_config`) unless the operator allows it.
A path is resolved first (``..`` and symbolic links followed, relative to the trainer's working
directory), so none of them leads out of a root. What lies outside is refused with the same
words whether or not it exists: the error must not tell a client what is on the trainer's disk.
Inside a root, a path that does not exist is refused by name. Accepted paths are stored
resolved, so the run reads exactly what was checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from proto.runs import RunSpec
from services.settings import is_hub_id
from services.trainer.deepspeed_config import checked_config
from services.trainer.settings import TrainerSettings

__all__ = ["SpecPathError", "resolve_spec_paths"]


class SpecPathError(ValueError):
    """A path of the spec the trainer refuses: ``loc`` is the field, the message says why."""

    def __init__(self, loc: list[str], msg: str) -> None:
        super().__init__(msg)
        self.loc, self.msg = loc, msg


def _under(value: str, roots: Sequence[Path]) -> Path | None:
    path = Path(value).resolve()
    return path if any(path.is_relative_to(root.resolve()) for root in roots) else None


_KINDS = {"directory": Path.is_dir, "file": Path.is_file, "anything": Path.exists}


def _is(path: Path, kind: str) -> bool:
    """Whether there is a ``kind`` (a key of ``_KINDS``) at ``path``."""
    try:
        return _KINDS[kind](path)
    except OSError:  # a name longer than the file system takes, a folder it may not read: nothing there
        return False


def _resolve(value: str, loc: list[str], roots: Sequence[Path], roots_name: str, *, kind: str) -> str:
    path = _under(value, roots)
    if path is None:
        raise SpecPathError(loc, f"{value} is not under the trainer's {roots_name}")
    if not _is(path, kind):
        raise SpecPathError(loc, f"no {kind} at {value} on the trainer")
    return str(path)


def resolve_spec_paths(spec: RunSpec, settings: TrainerSettings) -> RunSpec:
    """``spec`` with its paths resolved, or SpecPathError for the first one the trainer refuses."""
    data, models = settings.data_roots, [*settings.model_roots, settings.runs_dir]
    data_name, model_name = "data roots (PBSD_TRAINER_DATA_ROOTS)", "model roots (PBSD_TRAINER_MODEL_ROOTS)"
    update: dict = {}

    train = _resolve(spec.data.train, ["data", "train"], data, data_name, kind="file")
    validation = spec.data.validation
    if validation:
        validation = _resolve(validation, ["data", "validation"], data, data_name, kind="file")
    update["data"] = spec.data.model_copy(update={"train": train, "validation": validation})

    def checkpoint(value: str, loc: list[str]) -> str:
        local = _under(value, models)
        if settings.hub_models and is_hub_id(value) and not _is(local or Path(value), "anything"):
            return value  # fetched from the hub: no local path is read
        return _resolve(value, loc, models, model_name, kind="directory")

    tokenizer = spec.model.tokenizer
    update["model"] = spec.model.model_copy(
        update={
            "path": checkpoint(spec.model.path, ["model", "path"]),
            "tokenizer": checkpoint(tokenizer, ["model", "tokenizer"]) if tokenizer else None,
        }
    )
    config, loc = spec.trainer.deepspeed_config, ["trainer", "deepspeed_config"]
    trainer = spec.trainer
    if isinstance(config, str):
        resolved = _resolve(config, loc, [*data, *models], "data or model roots", kind="file")
        trainer = trainer.model_copy(update={"deepspeed_config": resolved})
    try:
        checked_config(trainer, allow_paths=settings.deepspeed_paths)  # checked again as the run opens
    except ValueError as exc:
        raise SpecPathError(loc, str(exc)) from None
    update["trainer"] = trainer
    return spec.model_copy(update=update)
