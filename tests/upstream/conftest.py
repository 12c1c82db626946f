"""Tiny local stand-ins for the Hub ids and repository paths diffusers' example tests use (see _upstream.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _upstream import HUB


def _instance_images(root: Path, images: str) -> dict[str, str]:
    """A folder of images and nothing else (no captions), as diffusers' docs/source/en/imgs: one per aspect ratio."""
    files = sorted(p for p in Path(images).iterdir() if p.suffix == ".png")
    for f in files[::4][:5]:
        shutil.copy(f, root / f.name)
    return {"dir": str(root)}


@pytest.fixture(autouse=True)
def upstream_hub(shared_artifact, train_assets, flow_assets):
    """Fill ``_upstream.HUB`` with the session's tiny pipelines and image folders."""
    instance = shared_artifact("upstream-instance-images", lambda root: _instance_images(root, train_assets["images"]))
    HUB.update({
        "hf-internal-testing/tiny-stable-diffusion-torch": train_assets["sd"],
        "hf-internal-testing/tiny-stable-diffusion-xl-pipe": train_assets["sdxl"],
        "hf-internal-testing/tiny-sd3-pipe": flow_assets["sd3"],
        "hf-internal-testing/tiny-flux-pipe": flow_assets["flux"],
        "hf-internal-testing/dummy_image_text_data": train_assets["images"],
        "docs/source/en/imgs": instance["dir"],
    })
    yield HUB
