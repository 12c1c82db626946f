"""The demo's tiny models: hf_arb's offline SD / Flux pipelines, with a VAE that has seen photographs.

A randomly initialised VAE decodes anything to coloured noise, so no amount of training would make the demo's
samples look like its photos. :func:`pretrain_vae` fits the tiny VAE to random crops of the demo photos for a few
hundred steps (about 10–20 s on 2 cores) and sets ``scaling_factor`` / ``shift_factor`` from the latents' statistics,
as the real VAEs' configs carry them; the UNet / transformer stays random and is what the demo trains.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

CROP = 64  # pixels a side of the VAE's training crops


def _crops(photos: list[Image.Image], n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` random ``CROP``² crops of ``photos`` (random photo, position, mirror), ``(n, 3, CROP, CROP)`` in [-1,
    1]."""
    out = []
    for _ in range(n):
        im = photos[int(torch.randint(len(photos), (1,), generator=g))]
        x = int(torch.randint(im.width - CROP + 1, (1,), generator=g))
        y = int(torch.randint(im.height - CROP + 1, (1,), generator=g))
        a = np.asarray(im.crop((x, y, x + CROP, y + CROP)), dtype=np.float32) / 127.5 - 1.0
        if torch.rand(1, generator=g) < 0.5:
            a = a[:, ::-1]
        out.append(torch.from_numpy(np.ascontiguousarray(a)).permute(2, 0, 1))
    return torch.stack(out)


def pretrain_vae(vae: Any, photos: list[Image.Image], *, steps: int = 300, batch: int = 8, lr: float = 2e-3,
                 seed: int = 0, shift: bool = False) -> dict[str, float]:
    """Train ``vae`` to reconstruct crops of ``photos`` (MSE + a small KL term); set its latent scale (and shift).

    Returns:
        ``{"seconds", "mse", "scaling_factor", "shift_factor"}``.
    """
    g = torch.Generator().manual_seed(seed)
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=lr)
    t0 = time.perf_counter()
    for _ in range(steps):
        x = _crops(photos, batch, g)
        dist = vae.encode(x).latent_dist
        rec = vae.decode(dist.sample(generator=g)).sample
        loss = torch.nn.functional.mse_loss(rec, x) + 1e-6 * dist.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    vae.eval()
    with torch.no_grad():
        x = _crops(photos, 32, g)
        z = vae.encode(x).latent_dist.mean
        mse = float(torch.nn.functional.mse_loss(vae.decode(z).sample, x))
    mean = float(z.mean()) if shift else 0.0
    scale = 1.0 / float((z - mean).std())
    vae.register_to_config(scaling_factor=scale, **({"shift_factor": mean} if shift else {}))
    return {"seconds": time.perf_counter() - t0, "mse": mse, "scaling_factor": scale, "shift_factor": mean}


def save_demo_model(family: str, path: Path, photos: list[Image.Image], *, vae_steps: int) -> dict[str, float]:
    """Write a tiny ``sd`` or ``flux`` pipeline to ``path`` with a photo-trained VAE; returns the VAE's figures."""
    from hf_arb.testing.tiny import tiny_flux_pipeline, tiny_sd_pipeline

    pipe = tiny_flux_pipeline() if family == "flux" else tiny_sd_pipeline()
    figures = pretrain_vae(pipe.vae, photos, steps=vae_steps, shift=family == "flux")
    shutil.rmtree(path, ignore_errors=True)
    pipe.save_pretrained(path)
    return figures
