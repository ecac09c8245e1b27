"""Saving the drafter a server serves as a folder that sglang loads as an EAGLE draft.

The folder has the layout of `sglang_rl.drafter.checkpoint` (``config.json`` and
``model.safetensors`` with the drafter checkpoint names) plus ``sglang_rl_drafter.json``, a small
metadata file naming the saved version (co-training round and policy version, time, source
folder). That file also marks the folder as a previous save, which a later save may replace when
asked to (``overwrite``).

A save is atomic: everything is written to a hidden temporary folder beside the destination,
which is then renamed into place, so a failed save leaves nothing half-written and a reader never
sees a partial folder. Nothing here imports sglang; the scheduler side is
`sglang_rl.adapters.drafter_save`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from safetensors.torch import save_file

from sglang_rl.drafter.checkpoint import WEIGHTS_FILE

__all__ = [
    "METADATA_FILE",
    "DraftSaveError",
    "check_destination",
    "is_previous_save",
    "parse_save_request",
    "read_save_metadata",
    "write_drafter_folder",
]

METADATA_FILE = "sglang_rl_drafter.json"
METADATA_FORMAT = "sglang-rl drafter save"
CONFIG_FILE = "config.json"
# files a drafter folder may hold; overwrite replaces such a folder, never any other one
_DRAFTER_FILES = (CONFIG_FILE, METADATA_FILE, "model.safetensors.index.json")
_SAVE_FIELDS = ("path", "overwrite")


class DraftSaveError(ValueError):
    """A save the caller asked for that cannot be done (bad path, refused destination); the
    message says why. Nothing was written."""


def parse_save_request(body: Any) -> tuple[str, bool]:
    """(absolute path, overwrite) from a request body ``{"path": DIR, "overwrite": false}``;
    DraftSaveError for anything else (so HTTP and Engine callers get the same reasons)."""
    if not isinstance(body, Mapping):
        raise DraftSaveError(f"the body must be a JSON object like {{\"path\": DIR}}, got {type(body).__name__}")
    unknown = sorted(set(body) - set(_SAVE_FIELDS))
    if unknown:
        raise DraftSaveError(f"unknown fields {unknown}; the fields are {list(_SAVE_FIELDS)}")
    path = body.get("path")
    if not isinstance(path, str) or not path.strip():
        got = "nothing" if path is None else repr(path)
        raise DraftSaveError(f"path must be a non-empty string naming a folder on the server, got {got}")
    if "\x00" in path:
        raise DraftSaveError("path must not contain NUL characters")
    overwrite = body.get("overwrite", False)
    if not isinstance(overwrite, bool):
        raise DraftSaveError(f"overwrite must be true or false, got {overwrite!r}")
    # relative paths are taken from the caller's working directory (the server's, over HTTP)
    return os.path.abspath(path), overwrite


def read_save_metadata(folder: str | Path) -> Optional[dict]:
    """The metadata of a previous save in ``folder`` (None when it is not one)."""
    file = Path(folder) / METADATA_FILE
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == METADATA_FORMAT else None


def is_previous_save(folder: str | Path) -> bool:
    """Whether ``folder`` holds a save written by `write_drafter_folder`."""
    return read_save_metadata(folder) is not None


def _is_drafter_folder(entries: list[Path]) -> bool:
    """Only drafter files (config, safetensors, metadata) and no sub-folders."""
    return all(e.is_file() and (e.name in _DRAFTER_FILES or e.name.endswith(".safetensors")) for e in entries)


def check_destination(path: str | Path, overwrite: bool) -> bool:
    """Refuse a destination a save must not write (DraftSaveError with the reason); returns
    whether an existing folder will be replaced.

    Allowed: a path that does not exist (parents are created), an empty folder, and, with
    ``overwrite``, a previous save or a drafter folder (config.json + *.safetensors only). A file
    or any other non-empty folder is always refused: a save never deletes what it cannot
    recreate."""
    dest = Path(path)
    if not dest.is_absolute():
        raise DraftSaveError(f"path {str(path)!r} must be absolute")
    if dest.parent == dest:
        raise DraftSaveError(f"path {str(path)!r} cannot be a filesystem root")
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise DraftSaveError(f"path {str(dest)!r} exists and is not a folder; choose a new path or a folder")
    if not dest.exists():
        return False
    try:
        entries = list(dest.iterdir())
    except OSError as exc:
        raise DraftSaveError(f"path {str(dest)!r} cannot be read: {exc.strerror or exc}") from exc
    if not entries:
        return False
    if is_previous_save(dest) or _is_drafter_folder(entries):
        if overwrite:
            return True
        what = "a previous save" if is_previous_save(dest) else "a drafter folder"
        raise DraftSaveError(f"path {str(dest)!r} holds {what}; pass \"overwrite\": true to replace it")
    raise DraftSaveError(f"path {str(dest)!r} is a folder that is not empty and not a drafter folder; "
                         "a save replaces only an empty folder, a drafter folder or a previous save")


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (best effort: some filesystems do not sync folders)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_contents(tmp: Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                    metadata: Mapping[str, Any]) -> None:
    save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, str(tmp / WEIGHTS_FILE),
              metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    # written last: a folder with the metadata file is a complete save
    (tmp / METADATA_FILE).write_text(json.dumps({"format": METADATA_FORMAT, **metadata}, indent=2) + "\n")
    for entry in tmp.iterdir():
        os.chmod(entry, 0o644)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; sglang may run as another user


def write_drafter_folder(path: str | Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                         metadata: Mapping[str, Any], overwrite: bool = False) -> Path:
    """Write a drafter folder at ``path`` atomically; returns the folder.

    ``config`` is config.json's content, ``tensors`` the drafter checkpoint tensors, ``metadata``
    the version fields stored in METADATA_FILE (with ``format`` and ``saved_at`` added). The
    destination is checked by `check_destination`; a failure removes the temporary folder and
    leaves the destination as it was."""
    if not tensors:
        raise DraftSaveError("there are no draft tensors to save")
    dest = Path(path)
    replace = check_destination(dest, overwrite)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.saving-", dir=dest.parent))
    except OSError as exc:
        raise DraftSaveError(f"cannot write to {str(dest.parent)!r}: {exc.strerror or exc}") from exc
    aside: Optional[Path] = None
    try:
        try:
            _write_contents(tmp, config, tensors, {**metadata, "saved_at": time.time()})
        except OSError as exc:
            raise DraftSaveError(f"cannot write the drafter to {str(dest.parent)!r}: {exc.strerror or exc}") from exc
        if replace:
            aside = Path(tempfile.mkdtemp(prefix=f".{dest.name}.replaced-", dir=dest.parent))
            os.replace(dest, aside / "old")  # the old folder leaves the name in one rename
        try:
            # a rename also replaces an empty folder; one that filled up meanwhile fails here
            os.replace(tmp, dest)
        except OSError as exc:
            if aside is not None:
                os.replace(aside / "old", dest)
            raise DraftSaveError(f"cannot move the saved drafter to {str(dest)!r}: {exc.strerror or exc}") from exc
        _fsync_dir(dest.parent)
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
