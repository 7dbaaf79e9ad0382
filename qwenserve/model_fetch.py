"""`qwen-serve model fetch SOURCE --dir DIR`: put a checkpoint in a folder, as the operator's init container does.

Sources: `hf://org/name` (the Hugging Face Hub through huggingface_hub's snapshot_download, the `hf` extra; a
token from HF_TOKEN), or a local folder (`file:///path` or a plain path), copied. Either way the folder must end
up a checkpoint (config.json), else the fetch fails in one line: a pod never starts on half a model.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from qwenserve.preflight import StartupError, check_model_folder

HF_SCHEME = "hf://"
FILE_SCHEME = "file://"
#: What a Hub repository id looks like (org/name), as the CRD's pattern says too.
HF_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
#: Files a serving checkpoint needs; the rest of a Hub repository (other weight formats, images) stays there.
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


class FetchError(StartupError):
    """A checkpoint could not be fetched; the message says why and what to change."""


def fetch(source: str, dest: Path, revision: str | None = None) -> Path:
    """Put the checkpoint `source` names into `dest` (created if needed) and return `dest`."""
    if source.startswith(HF_SCHEME):
        _fetch_hf(source[len(HF_SCHEME):].strip("/"), dest, revision)
    else:
        if revision:
            raise FetchError(f"--revision {revision}: only hf:// sources have revisions")
        _copy_folder(Path(source[len(FILE_SCHEME):] if source.startswith(FILE_SCHEME) else source), dest)
    try:
        check_model_folder(dest, "the fetched folder")
    except StartupError as e:
        raise FetchError(f"{source}: {e}") from None
    return dest


def _fetch_hf(repo: str, dest: Path, revision: str | None) -> None:
    if not HF_REPO.fullmatch(repo):
        raise FetchError(f"hf://{repo}: a Hub source is hf://org/name")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FetchError("hf:// sources need huggingface_hub, which is not installed; install the hf extra "
                         "(pip install 'qwen-serve[hf]')") from None
    from huggingface_hub.utils import HfHubHTTPError

    dest.mkdir(parents=True, exist_ok=True)
    try:
        snapshot_download(repo_id=repo, revision=revision, local_dir=str(dest), allow_patterns=CHECKPOINT_FILES,
                          token=os.environ.get("HF_TOKEN") or None)
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise FetchError(f"cannot download hf://{repo}" + (f"@{revision}" if revision else "")
                         + f": {e} (a private or gated repository needs HF_TOKEN)") from None


def _copy_folder(source: Path, dest: Path) -> None:
    if not source.is_dir():
        raise FetchError(f"{source}: no such folder (give hf://org/name, file:///path or a folder)")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, dest, dirs_exist_ok=True)
