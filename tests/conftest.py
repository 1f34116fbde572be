"""Shared fixtures: tiny models built once per session, the real data folder, small real images.

def test_x(tiny_models):
    path = tiny_models("qwen2_vl")          # built on first use, then reused
    model, processor = load_backbone(path)  # fresh objects each time: mutate freely
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from real_data import DATA

# Tiny models gain nothing from intra-op threads, and two OpenMP pools fighting over 2 cores
# (pytest plus a recipe subprocess) made matmuls ~15x slower here: one thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def tokenized_data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Recipes run by tests cache tokenized data in a session folder, not in ~/.cache."""
    folder = tmp_path_factory.mktemp("mmprm_cache")
    os.environ["MMPRM_CACHE"] = str(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory arch -> directory of that tiny model (seed 0), built at most once per session.

    The directory is shared by every test: load it, never write into it.
    """
    from mmprm.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_tiny_model(arch, root / arch, seed=0)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_models: Callable[[str], Path]) -> Callable[[str], Path]:
    """Alias of `tiny_models` (same factory, same directories)."""
    return tiny_models


@pytest.fixture(scope="session")
def real_data() -> Path:
    """The real data folder: `../shared/data` when present, else the repo's `data/` subset (tests/real_data.py)."""
    return DATA


@pytest.fixture(scope="session")
def mathv_images(real_data: Path) -> Callable[..., list]:
    """Factory (ids, size=56) -> real MATH-V images as small RGB PIL images, aspect kept.

    Small so the tiny processors stay fast; ids 4 and 7 are in the repo subset too.
    """
    from PIL import Image

    folder = real_data / "mathv" / "images"

    def load(ids: list[str], size: int = 56) -> list:
        images = []
        for image_id in ids:
            with Image.open(folder / f"{image_id}.jpg") as im:
                im = im.convert("RGB")
                im.thumbnail((size, size))
                images.append(im)
        return images

    return load


@pytest.fixture(scope="session")
def vllm_toy_policy(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory arch -> a vLLM-ready toy policy (the vLLM tier): tiny preset at head_dim 64 with its
    full processor, taught our step format (`train_toy_policy`), built at most once per session."""
    from mmprm.annotate.simulated import train_toy_policy
    from mmprm.models.tiny import VLLM_HEAD_DIM, build_tiny_model

    root = tmp_path_factory.mktemp("vllm_policies")
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            base = build_tiny_model(arch, root / f"{arch}_base", head_dim=VLLM_HEAD_DIM, vllm_ready=True)
            built[arch] = Path(train_toy_policy(str(base), str(root / arch)))
        return built[arch]

    return get
