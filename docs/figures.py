"""Draw the pictures in docs/ from real photos (scikit-image's bundled samples).

Usage: ``python docs/figures.py`` → ``docs/img/crop_comparison.png``, ``docs/img/buckets_novelai.png``;
``python docs/figures.py tiers`` → ``docs/img/tiers_photos.png`` (``hf-arb stats --resolution 256,512 --chart`` on
the test photo folder, written to ``/tmp/photos``).
Needs the ``test`` and ``plot`` extras (scikit-image, matplotlib).
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from hf_arb import BucketSet, fit_to_bucket
from hf_arb.annotate.plot import plot_bucket_chart

OUT = Path(__file__).resolve().parent / "img"


def sample_photos() -> list[tuple[str, Image.Image]]:
    """A wide and a tall real photo: motorcycle (741×500) and a portrait crop of the rocket launch."""
    import skimage

    data = Path(skimage.__file__).parent / "data"
    rocket = Image.open(data / "rocket.jpg").convert("RGB")  # 640×427, the rocket stands in the middle
    tall = rocket.crop((200, 0, 470, 427))  # 270×427 portrait
    wide = Image.open(data / "motorcycle_left.png").convert("RGB")
    return [(f"wide photo ({wide.width}×{wide.height})", wide), (f"tall photo ({tall.width}×{tall.height})", tall)]


def centre_square(im: Image.Image, side: int = 512) -> Image.Image:
    """What diffusers' train_text_to_image.py does: resize the short side to `side`, centre-crop a square."""
    s = side / min(im.size)
    im = im.resize((round(im.width * s), round(im.height * s)), Image.Resampling.LANCZOS)
    left, top = (im.width - side) // 2, (im.height - side) // 2
    return im.crop((left, top, left + side, top + side))


def crop_comparison(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bs = BucketSet.novelai()
    photos = sample_photos()
    fig, axes = plt.subplots(len(photos), 3, figsize=(11, 4 * len(photos)))
    for (label, im), ax in zip(photos, axes):
        (bid,), (err,) = bs.assign([im.width], [im.height])
        fit = fit_to_bucket(im, bs[bid], crop="center")
        ax[0].imshow(im)
        ax[0].set_title(label)
        ax[1].imshow(centre_square(im))
        ax[1].set_title("centre square 512×512\n(diffusers' default)")
        ax[2].imshow(fit.image)
        w, h = bs[bid]
        ax[2].set_title(f"hf_arb bucket {w}×{h}\n(aspect error {err:.3f}, crop at {fit.crop_top_left})")
        for a in ax:
            a.set_xticks([])
            a.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def bucket_chart(path: Path) -> None:
    """The NovelAI buckets filled with photo-like synthetic sizes (the assignment benchmark's distribution)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_assign import synthetic_sizes

    bs = BucketSet.novelai(max_aspect_error=0.25)
    w, h = synthetic_sizes(100_000)
    ids, err = bs.assign(w, h)
    plot_bucket_chart(bs, ids, err, path, title="NovelAI buckets, 100,000 photo-like sizes")


#: the photo folder of tests/test_cli_annotate.py: (scikit-image photo, size or None, EXIF orientation)
TIER_PHOTOS = [("coffee.png", None, 1), ("chelsea.png", None, 6), ("rocket.jpg", (427, 900), 1),
               ("motorcycle_left.png", None, 1), ("hubble_deep_field.jpg", (1200, 500), 1), ("cell.png", None, 8)]


def tier_chart(folder: Path, path: Path) -> None:
    """Write the photo folder, annotate it and draw rows per tier and bucket with ``hf-arb stats``."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from _photos import save_photo

    from hf_arb.cli import main as hf_arb

    for i, (name, size, orientation) in enumerate(TIER_PHOTOS):
        save_photo(folder / f"img{i}.jpg", name, "JPEG", orientation, size=size, quality=85)
    assert hf_arb(["annotate", str(folder), "--output-dir", f"{folder}-arb"]) == 0
    assert hf_arb(["stats", f"{folder}-arb", "--resolution", "256,512", "--chart", str(path)]) == 0


def main() -> None:
    import sys

    OUT.mkdir(parents=True, exist_ok=True)
    if sys.argv[1:] == ["tiers"]:
        tier_chart(Path("/tmp/photos"), OUT / "tiers_photos.png")
        return
    crop_comparison(OUT / "crop_comparison.png")
    bucket_chart(OUT / "buckets_novelai.png")
    print(f"wrote {OUT}/crop_comparison.png and buckets_novelai.png")


if __name__ == "__main__":
    main()
