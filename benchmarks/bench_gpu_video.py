"""Wan 2.1 1.3B-sized LoRA steps on a GPU at 480p x 81 frames: (W, H, F) buckets against fixed-size clips (issue 38).

Usage::

    python benchmarks/bench_gpu_video.py                        # on a CUDA machine: the figures (~2 min on an H200)
    python benchmarks/bench_gpu_video.py --device cpu --tiny    # the code paths, tiny (tests/test_bench_gpu_video.py)
    python benchmarks/bench_gpu_video.py --markdown benchmarks/results/gpu_video/h200.json

The denoiser is ``WanTransformer3DModel`` built from Wan 2.1 T2V 1.3B's published config
(``benchmarks/gpu_configs/video/wan21_t2v_1_3b.json``) with random weights, in bf16 on the GPU, with a rank-16 LoRA
on the family's target modules, gradient checkpointing and AdamW, behind accelerate (``mixed_precision="bf16"``):
what ``train_text_to_image_arb.py --rank 16 --gradient_checkpointing --mixed_precision bf16 --cache_latents
--cache_text_embeddings`` runs per step. Inputs are cached-latent-like (the VAE posterior's mean and std of the clip's
latent shape, ``(B, 2, 16, F', H/8, W/8)``) and random UMT5-shaped prompt embeddings (512 x 4096), so no VAE or text
encoder is needed: the figures are the denoiser's step, which is what a bucket changes.

Each case is one step shape, timed over ``--repeats`` steps after one warm-up step (``torch.cuda.synchronize`` around
each), with the peak memory since the case started:

- ``fixed``: every clip cropped to the pipeline's default 832x480x81 (``WanPipeline.__call__``'s defaults), batch 1 and
  2: what a trainer without buckets runs;
- ``bucket``: buckets of the ``wan`` preset (the same 832x480x81 budget in pixels x frames) at each frame count of its
  ladder, at the batch size that ``--video_token_budget`` (:func:`token_budget`: the largest bucket's latent tokens,
  1.013x one fixed clip's) gives each bucket (``batch_sizes_for_tokens``, as the script's sampler), and the stills'
  bucket at batch 1 too (what a token budget saves).

The question it answers: does a bucketed run cost more per latent token, or peak higher, than fixed-size clips? A
token budget of about one fixed clip should keep every bucket's peak near the fixed clip's, whatever its shape.

Writes ``benchmarks/results/gpu_video/<card>.json`` (``--out``); ``benchmarks/report.py`` renders it into
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(ROOT), str(HERE)):  # hf_arb from this checkout (a bare GPU machine) and bench_gpu beside it
    if path not in sys.path:
        sys.path.insert(0, path)

from bench_gpu import GIB, StepBench  # noqa: E402  (after the path set-up)

SPEC = HERE / "gpu_configs" / "video" / "wan21_t2v_1_3b.json"
RESULTS = HERE / "results" / "gpu_video"


def load_spec(tiny: bool) -> dict[str, Any]:
    """The Wan spec, its ``tiny`` overrides applied where ``tiny``; ``vae``: ``AutoencoderKLWan``'s default config
    (``z_dim``, ``latents_mean``/``latents_std``, scale factors: Wan 2.1's VAE), read from diffusers, not copied."""
    import diffusers
    import torch

    spec = json.loads(SPEC.read_text())
    if tiny:
        spec = {**spec, "config": {**spec["config"], **spec["tiny"]}, "text": {**spec["text"], **spec["tiny_text"]},
                "clip": [64, 32, 9]}
    with torch.device("meta"):
        vae = diffusers.AutoencoderKLWan()
    cfg = vae.config
    spec["vae"] = {"latent_channels": int(cfg.z_dim), "z_dim": int(cfg.z_dim),
                   "latents_mean": list(cfg.latents_mean), "latents_std": list(cfg.latents_std),
                   "scale_factor_spatial": int(cfg.scale_factor_spatial),
                   "scale_factor_temporal": int(cfg.scale_factor_temporal)}
    return spec


def token_shape(spec: dict[str, Any]) -> dict[str, int]:
    """``tokens_per_sample``'s keywords for ``spec``'s VAE and transformer (16, 4, 1 for Wan 2.1)."""
    vae, (pt, ph, _) = spec["vae"], spec["config"]["patch_size"]
    return {"spatial": vae["scale_factor_spatial"] * ph, "frame_step": vae["scale_factor_temporal"], "patch_t": pt}


def latent_tokens(spec: dict[str, Any], shape: tuple[int, int, int]) -> int:
    """Transformer tokens of one ``(W, H, F)`` sample, as the sampler's token budget counts them
    (``tokens_per_sample``): ``F' x (H / 16) x (W / 16)`` for Wan 2.1."""
    from hf_arb.sampling.planning.batch_sizes import tokens_per_sample

    return int(tokens_per_sample([shape], **token_shape(spec))[0])


def token_budget(spec: dict[str, Any], res: Any) -> int:
    """``--video_token_budget`` of the bucketed cases: one fixed clip's latent tokens, or the preset's largest
    bucket's where that is larger (the 49-frame buckets: the pixels x frames budget counts frames, the latents count
    ``(F - 1) / 4 + 1`` of them), as the sampler demands."""
    return max(latent_tokens(spec, tuple(spec["clip"])), *(latent_tokens(spec, tuple(r)) for r in res.tolist()))


def plan_cases(spec: dict[str, Any], tiny: bool) -> list[dict[str, Any]]:
    """The cases to time: ``[{"kind", "shape": [w, h, f], "batch", "tokens"}]`` (see the module docstring)."""
    import numpy as np

    from hf_arb import BucketSet
    from hf_arb.sampling.planning.batch_sizes import batch_sizes_for_tokens

    fixed = tuple(spec["clip"])
    if tiny:  # the same ladder's shape, small: a (k, 3) table of 4k+1 frames at sides of 16
        res = np.array([[64, 32, 9], [32, 64, 9], [32, 32, 9], [64, 48, 5], [96, 64, 1], [32, 32, 1]])
    else:
        res = np.asarray(BucketSet.preset("wan").resolutions)  # (k, 3): width, height, frames
    budget = token_budget(spec, res)
    sizes = batch_sizes_for_tokens(res, budget, **token_shape(spec))
    cases = [{"kind": "fixed", "shape": list(fixed), "batch": b} for b in (1, 2)]
    portrait = res[:, 0] < res[:, 1]
    for frames in sorted(set(res[:, 2].tolist()), reverse=True):  # per frame count: its largest portrait bucket
        rows = np.flatnonzero((res[:, 2] == frames) & (portrait | tiny))
        if not len(rows):
            continue
        i = rows[np.argmax(res[rows, 0] * res[rows, 1])]
        cases.append({"kind": "bucket", "shape": res[i].tolist(), "batch": int(sizes[i])})
        if frames == 1 and int(sizes[i]) > 1:
            cases.append({"kind": "bucket (batch 1)", "shape": res[i].tolist(), "batch": 1})
    longest = np.flatnonzero(res[:, 2] == res[:, 2].max())
    square = longest[np.argmin(np.abs(res[longest, 0] - res[longest, 1]))]  # the longest clips' squarest bucket
    if res[square, 0] == res[square, 1] or not tiny:
        cases.insert(3, {"kind": "bucket", "shape": res[square].tolist(), "batch": int(sizes[square])})
    for case in cases:
        case.update(tokens=latent_tokens(spec, tuple(case["shape"])), budget=budget)
    return cases


class ClipStepBench(StepBench):
    """:class:`bench_gpu.StepBench` on clips: ``batch((w, h, f), size)`` gives the cached posterior of a clip's latents
    ``(size, 2, C, F', h, w)`` (``(size, 2, C, h, w)`` for a 1-frame still, as the Wan adapter caches stills)."""

    def batch(self, shape: tuple[int, int, int], size: int) -> dict[str, Any]:  # type: ignore[override]
        import torch

        w, h, f = shape
        vae = self.spec["vae"]
        s, frames = vae["scale_factor_spatial"], (f - 1) // vae["scale_factor_temporal"] + 1
        dims = (size, self.latent_channels, *((frames,) if f > 1 else ()), h // s, w // s)
        g = torch.Generator().manual_seed(0)
        stats = torch.stack([torch.randn(dims, generator=g), torch.rand(dims, generator=g) * 0.1], dim=1)
        return {"latent_stats": stats.to(self.device), "captions": ["a clip"] * size, "rows": list(range(size))}


def environment() -> dict[str, Any]:
    import accelerate
    import diffusers
    import peft
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
           "accelerate": accelerate.__version__, "peft": peft.__version__}
    if torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(0),
                   gpu_memory_gib=torch.cuda.get_device_properties(0).total_memory / GIB, cuda=torch.version.cuda)
    return env


def run(opts: argparse.Namespace) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator

    spec = load_spec(opts.tiny)
    cuda = opts.device == "cuda"
    accelerator = Accelerator(mixed_precision="bf16" if cuda else "no", cpu=not cuda)
    result: dict[str, Any] = {"tiny": opts.tiny, "device": opts.device, "environment": environment(),
                              "date": time.strftime("%Y-%m-%d"), "title": spec["title"], "source": spec["source"],
                              "command": " ".join(["python benchmarks/bench_gpu_video.py", *opts.shown_argv]),
                              "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        bench = ClipStepBench(spec, accelerator, Path(tmp), opts.tiny)
        result.update(parameters=bench.parameters, lora_parameters=sum(p.numel() for p in bench.params),
                      build_s=time.perf_counter() - t0,
                      shift=float(bench.models.options.shift.shift),
                      clip=spec["clip"],
                      text_shape=[bench.tokens, bench.dim])
        cases = plan_cases(spec, opts.tiny)
        result["max_tokens_per_batch"] = cases[0]["budget"]
        for case in cases:
            try:
                step = bench.step("hf_arb", tuple(case["shape"]), case["batch"], opts.repeats)
                step["tokens_per_s"] = case["tokens"] * step["images_per_s"]
                result["cases"].append({**case, **step})
            except torch.OutOfMemoryError as e:
                result["cases"].append({**case, "error": f"OOM: {e}"[:300]})
                torch.cuda.empty_cache()
            print(json.dumps(result["cases"][-1]), flush=True)
    return result


def markdown(result: dict[str, Any]) -> str:
    """The docs table of a result file."""
    env = result["environment"]
    tokens, dim = result["text_shape"]
    clip = "x".join(map(str, result["clip"]))
    lines = [f"{result['title']}: {result['parameters'] / 1e9:.2f} B parameters (random init, bf16), rank-16 LoRA "
             f"({result['lora_parameters'] / 1e6:.1f} M trained), gradient checkpointing, AdamW; cached-latent inputs, "
             f"{tokens} x {dim} prompt embeddings; fixed `flow_shift` {result['shift']:g}. "
             f"{env.get('gpu', result['device'])}, torch {env['torch']}, diffusers {env['diffusers']}; "
             f"`--video_token_budget {result['max_tokens_per_batch']}` (the largest bucket's tokens; one {clip} "
             f"clip has {result['cases'][0]['tokens']:,}).",
             "",
             "| case | W x H x F | batch | tokens / sample | s / step | samples / s | tokens / s | peak GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for c in result["cases"]:
        shape = "x".join(map(str, c["shape"]))
        if "error" in c:
            lines.append(f"| {c['kind']} | {shape} | {c['batch']} | {c['tokens']:,} | {c['error'][:40]} | | | |")
            continue
        peak = "" if c.get("peak_gib") is None else f"{c['peak_gib']:.1f}"
        lines.append(f"| {c['kind']} | {shape} | {c['batch']} | {c['tokens']:,} | {c['step_s']:.2f} | "
                     f"{c['images_per_s']:.2f} | {c['tokens_per_s']:,.0f} | {peak} |")
    lines += ["", *findings(result)]
    return "\n".join(lines) + "\n"


def findings(result: dict[str, Any]) -> list[str]:
    """What the table says, computed from it: the buckets' cost per token and peak against the fixed clip's, and what
    the token budget's batch gives the stills."""
    ok = [c for c in result["cases"] if "error" not in c]
    fixed = next((c for c in ok if c["kind"] == "fixed" and c["batch"] == 1), None)
    budgeted = [c for c in ok if c["kind"] == "bucket"]
    if fixed is None or not budgeted:
        return []
    full = [c for c in budgeted  # clip buckets of about one fixed clip's tokens
            if c["shape"][2] > 1 and c["tokens"] * c["batch"] >= 0.9 * fixed["tokens"]]
    rates = [c["tokens_per_s"] / fixed["tokens_per_s"] for c in full]
    out = [f"- Clip buckets of about one fixed clip's tokens ({len(full)} shapes) run at {min(rates):.2f}-"
           f"{max(rates):.2f}x the fixed clip's tokens per second."] if full else []
    if fixed.get("peak_gib"):
        peaks = [c["peak_gib"] / fixed["peak_gib"] for c in budgeted]
        out.append(f"- Every bucket at the token budget peaks at {min(peaks):.2f}-{max(peaks):.2f}x the fixed clip's "
                   f"{fixed['peak_gib']:.1f} GiB (the budget is the largest bucket's tokens, "
                   f"{result['max_tokens_per_batch'] / fixed['tokens']:.3f}x one fixed clip's).")
    one = {c["batch"]: c for c in ok if c["shape"][2] == 1}
    if len(one) > 1:
        big, small = one[max(one)], one[min(one)]
        gain = big["tokens_per_s"] / small["tokens_per_s"]
        out.append(f"- Stills at the budget's batch {big['batch']} train {gain:.1f}x the tokens per second of batch "
                   f"{small['batch']}.")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny config and shapes (the code paths, not the figures)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per case, after one warm-up step")
    p.add_argument("--out", default="", help="result file (default: benchmarks/results/gpu_video/<card>.json)")
    p.add_argument("--markdown", metavar="RESULT_JSON", help="print the docs table of a result file and exit")
    opts = p.parse_args(argv)
    given = list(sys.argv[1:] if argv is None else argv)
    opts.shown_argv = [a for i, a in enumerate(given)  # the command without --out's path (the machine's own)
                       if a != "--out" and not a.startswith("--out=") and (i == 0 or given[i - 1] != "--out")]
    if opts.markdown:
        print(markdown(json.loads(Path(opts.markdown).read_text())))
        return 0
    result = run(opts)
    card = result["environment"].get("gpu", opts.device).split()[-1].lower()
    out = Path(opts.out) if opts.out else RESULTS / f"{card}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
