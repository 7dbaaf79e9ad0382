"""The Dockerfile (no Docker engine here): it copies what the package needs and runs as non-root."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
NEEDED = ["pyproject.toml", "README.md", "qwenserve/", "services/", "operator/", "proto/"]


def _stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions per build stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, list[tuple[str, str]]] = {}
    current = "<global>"
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            current = rest.split(" AS ")[-1].strip() if " AS " in rest else rest
            stages[current] = []
        stages.setdefault(current, []).append((word.upper(), rest.strip()))
    return stages


def _copied(instructions: list[tuple[str, str]]) -> list[str]:
    return [src for word, rest in instructions if word == "COPY" and "--from" not in rest
            for src in rest.split()[:-1]]


@pytest.mark.parametrize("stage", ["cpu", "cuda-build"])
def test_build_stages_copy_everything_the_package_needs_before_installing(stage: str) -> None:
    instructions = _stages()[stage]
    copied = _copied(instructions)
    for needed in NEEDED:
        assert needed in copied, f"{stage} does not COPY {needed}"
    install = next(i for i, (w, rest) in enumerate(instructions) if w == "RUN" and re.search(r"pip install [\".]", rest))
    last_copy = max(i for i, (w, _) in enumerate(instructions) if w == "COPY")
    assert last_copy < install


def test_needed_paths_exist_and_are_not_docker_ignored() -> None:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    for needed in NEEDED:
        assert (ROOT / needed).exists() or needed == "README.md", needed
        assert not any(fnmatch.fnmatch(needed.rstrip("/"), p) for p in patterns), f"{needed} is ignored"


def test_every_package_folder_of_pyproject_is_copied() -> None:
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    copied = _copied(_stages()["cpu"])
    for folder in package_dirs.values():
        # A package may sit below a copied folder (operator/qwenserve_operator/ comes with operator/).
        assert any(f"{folder}/".startswith(src) for src in copied if src.endswith("/")), f"COPY {folder}/"


def test_cpu_torch_comes_from_the_cpu_index_before_the_project() -> None:
    instructions = _stages()["cpu"]
    runs = [rest for word, rest in instructions if word == "RUN"]
    torch_run = next(i for i, r in enumerate(runs) if "download.pytorch.org/whl/cpu" in r)
    project_run = next(i for i, r in enumerate(runs) if re.search(r"pip install \"?\.", r))
    assert torch_run < project_run
    assert 'ARG TORCH_VERSION=2.13.0' in (ROOT / "Dockerfile").read_text()


@pytest.mark.parametrize("stage", ["cpu", "cuda"])
def test_final_images_run_qwen_serve_as_a_non_root_user(stage: str) -> None:
    instructions = _stages()[stage]
    users = [rest for word, rest in instructions if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert ("ENTRYPOINT", '["qwen-serve"]') in instructions


def test_cpu_is_the_default_target_and_cuda_builds_flash_attn() -> None:
    stages = list(_stages())
    assert stages[-1] == "cpu"  # docker build without --target builds the last stage
    cuda_build = " ".join(rest for _, rest in _stages()["cuda-build"])
    assert re.search(r"\.\[gpu[],]", cuda_build)  # the gpu extra is flash-attn


@pytest.mark.parametrize(("build", "final"), [("cpu", "cpu"), ("cuda-build", "cuda")])
def test_images_can_hand_off_over_mooncake(build: str, final: str) -> None:
    """kvTransfer.mode: mooncake needs the mooncake extra installed and libibverbs in the final image."""
    installs = " ".join(rest for word, rest in _stages()[build] if word == "RUN")
    extras = re.search(r'pip install "\.\[([^\]]*)\]"', installs)
    assert extras and "mooncake" in extras.group(1).split(",")
    assert "mooncake" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any("libibverbs1" in rest for word, rest in _stages()[final] if word == "RUN")


@pytest.mark.parametrize("build", ["cpu", "cuda-build"])
def test_images_install_the_operator_extra_for_the_operator_they_run(build: str) -> None:
    installs = " ".join(rest for word, rest in _stages()[build] if word == "RUN")
    extras = re.search(r'pip install "\.\[([^\]]*)\]"', installs)
    assert extras and "operator" in extras.group(1).split(",")


def _baked_models(stage: str) -> list[str]:
    """The folders a build stage writes the built-in model into (`qwen-serve model init --dir DIR`)."""
    runs = " ".join(rest for word, rest in _stages()[stage] if word == "RUN")
    return re.findall(r"qwen-serve model init --dir (\S+)", runs)


@pytest.mark.parametrize("values", [
    ROOT / "examples/qwendeployment-cpu.yaml", ROOT / "charts/qwen-serve/values.yaml"], ids=lambda p: p.name)
def test_an_image_model_path_is_a_folder_the_cpu_image_bakes(values: Path) -> None:
    body = yaml.safe_load(values.read_text())
    model = (body.get("example") or body)["spec"]["model"]
    assert model["source"] == "image"
    assert model["path"] in _baked_models("cpu"), f"the CPU image has no model at {model['path']}"
    from qwenserve.default_model import DEFAULT_MODEL_NAME

    assert model["path"] == f"/models/{DEFAULT_MODEL_NAME}" and model["name"] == DEFAULT_MODEL_NAME


def test_the_model_is_baked_after_the_project_is_installed_and_before_dropping_root() -> None:
    instructions = _stages()["cpu"]
    bake = next(i for i, (w, rest) in enumerate(instructions) if w == "RUN" and "model init" in rest)
    install = next(i for i, (w, rest) in enumerate(instructions) if w == "RUN" and re.search(r'pip install "?\.', rest))
    user = next(i for i, (w, _) in enumerate(instructions) if w == "USER")
    assert install < bake < user
