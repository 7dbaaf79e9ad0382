"""`qwen-serve model fetch`: what the operator's fetch-model init container runs. The Hub cannot be reached here:
a local folder stands in for it, and huggingface_hub is replaced only at its download function."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from qwenserve import model_fetch
from qwenserve.default_model import TINY_CONFIG, main, write_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("src") / "qwen3-fetch", TINY_CONFIG, seed=3)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("scheme", ["file://", ""])
def test_a_local_folder_is_copied_into_the_target_byte_for_byte(checkpoint: Path, tmp_path: Path, scheme: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "models" / "qwen3-fetch"
    assert main(["fetch", f"{scheme}{checkpoint}", "--dir", str(dest)]) == 0
    assert capsys.readouterr().out.strip() == str(dest)
    assert _files(dest) == _files(checkpoint) and "config.json" in _files(dest)


def test_a_folder_that_is_no_checkpoint_fails_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["fetch", f"file://{tmp_path / 'empty'}", "--dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no config.json" in err


def test_hf_sources_download_the_checkpoint_files_with_the_token_and_revision(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import huggingface_hub

    calls: list[dict[str, Any]] = []

    def snapshot_download(**kwargs: Any) -> str:  # the Hub: serves the stand-in checkpoint
        calls.append(kwargs)
        model_fetch._copy_folder(checkpoint, Path(kwargs["local_dir"]))
        return str(kwargs["local_dir"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    dest = tmp_path / "Qwen3-0.6B"
    assert model_fetch.fetch("hf://Qwen/Qwen3-0.6B", dest, "abc123") == dest
    assert calls == [{"repo_id": "Qwen/Qwen3-0.6B", "revision": "abc123", "local_dir": str(dest),
                      "allow_patterns": model_fetch.CHECKPOINT_FILES, "token": "hf_secret"}]
    assert _files(dest) == _files(checkpoint)


@pytest.mark.parametrize(("source", "revision", "message"), [
    ("hf://just-a-name", None, "hf://org/name"),
    ("/no/such/folder", None, "no such folder"),
    ("file:///tmp", "main", "only hf:// sources have revisions"),
])
def test_bad_sources_are_refused_with_the_fix(tmp_path: Path, source: str, revision: str | None,
                                              message: str) -> None:
    with pytest.raises(model_fetch.FetchError, match=message):
        model_fetch.fetch(source, tmp_path / "out", revision)


def test_without_huggingface_hub_an_hf_source_says_which_extra_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as if not installed
    with pytest.raises(model_fetch.FetchError, match=r"qwen-serve\[hf\]"):
        model_fetch.fetch("hf://Qwen/Qwen3-0.6B", tmp_path / "out")
