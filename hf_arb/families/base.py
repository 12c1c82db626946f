"""What the training script asks a model family, and the registry of families.

The script never branches on a family's name: it detects the family of ``--pretrained_model_name_or_path``
(:func:`detect_family`), takes its adapter (:func:`get_family`) and asks it for everything that differs between
families. A :class:`Family` answers, in the order the script asks:

1. **flags**: its defaults (``--resolution``, ``--output_dir``), the flags that do not apply to it
   (:attr:`Family.refused_flags`), whether ``--packing`` applies;
2. **loading**: :meth:`Family.load_models` returns :class:`Models` (frozen VAE and text encoders, the trained
   denoiser; only the frozen parts the run's data needs: :meth:`Family.load_frozen`, :meth:`Family.complete_models`
   loads the rest when validation or the saved pipeline asks), :meth:`Family.check_buckets` checks the bucket sizes
   the denoiser can take;
3. **training**: :meth:`Family.encode_text` (prompt embeddings, cacheable), :meth:`Family.training_loss` (the
   noise, the target and the conditioning: SDXL time ids, resolution conditioning, the per-bucket shift);
4. **LoRA**: :meth:`Family.lora_targets`, :meth:`Family.lora_text_encoders`, :attr:`Family.denoiser_name`;
5. **outputs**: :meth:`Family.register_checkpoint_hooks`, :meth:`Family.build_pipeline` (validation and the
   saved pipeline), :meth:`Family.save_pipeline`, :meth:`Family.card_lines` and :meth:`Family.usage`.

Adding a family is one file in ``hf_arb/families/`` with a :class:`Family` subclass decorated with
:func:`register_family`, its tiny builder in :mod:`hf_arb.testing` and its tests. Built-in families are listed in
:data:`BUILTIN_MODULES` (loaded on first use); a plugin or a test registers its own class with
:func:`register_family`, which :func:`detect_family` then asks first.

Nothing here imports torch: detection and the flag checks answer before it loads.
"""

from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BUILTIN_MODULES", "FROZEN_PARTS", "Family", "Models", "PartNames", "UnloadedVAE", "builtin_family",
           "claiming_families", "detect_family", "family_names", "get_family", "read_class_name", "register_family",
           "unregister_family"]

#: Modules of the built-in families (loaded on first use; :func:`family_names` lists them in this order). Detection
#: does not depend on the order but on specificity (:func:`claiming_families`: a subclass's claim beats its base's,
#: as Flux.1 Kontext's beats Flux.1's; tested unambiguous for every tiny builder of :mod:`hf_arb.testing` and known
#: Hub names); the last, SD 1.x/2.x, is the fallback when no family claims a checkpoint.
BUILTIN_MODULES: tuple[str, ...] = ("hf_arb.families.sd3", "hf_arb.families.flux2", "hf_arb.families.flux_kontext",
                                    "hf_arb.families.flux",
                                    "hf_arb.families.qwenimage_edit_plus", "hf_arb.families.qwenimage_edit",
                                    "hf_arb.families.qwenimage", "hf_arb.families.zimage", "hf_arb.families.wan",
                                    "hf_arb.families.ltx",
                                    "hf_arb.families.hunyuan_video15",
                                    "hf_arb.families.sdxl", "hf_arb.families.sd")
class PartNames(frozenset):
    """A frozenset of part names whose ``repr`` is sorted (a set's order follows the run's string hashing, and the
    generated API reference shows the default)."""

    def __repr__(self) -> str:
        return f"frozenset({{{', '.join(map(repr, sorted(self)))}}})"


#: the frozen parts a run may leave unloaded where its data already holds what they compute (an encoded dataset: the
#: latents and the prompt embeddings); the denoiser and the scheduler always load
FROZEN_PARTS: frozenset[str] = PartNames({"vae", "text_encoders"})


class UnloadedVAE:
    """The VAE of a run that did not load its weights (:attr:`Models.unloaded`): its ``config`` (the folder's
    ``config.json``) answers what the loss and the bucket checks read (scaling and shift factors, the scale factor);
    moving it is a no-op; encoding is refused. :meth:`Family.complete_models` replaces it by the real VAE."""

    dtype = None

    def __init__(self, config: Any) -> None:
        self.config = config

    def to(self, *args: Any, **kwargs: Any) -> UnloadedVAE:
        return self

    def requires_grad_(self, requires_grad: bool = True) -> UnloadedVAE:
        return self

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("This run did not load the VAE (its data holds the latents): nothing may encode pixels. "
                           "Load it with Family.complete_models first.")


@dataclass
class Models:
    """Everything a run loads from the pretrained folder.

    Attributes:
        family: the :class:`Family` that loaded them.
        noise_scheduler: the training scheduler (DDPM for UNets, flow matching for transformers).
        tokenizers, text_encoders: in the pipeline's order; frozen.
        vae: the frozen ``AutoencoderKL``.
        unet: the trained denoiser (a UNet, or a transformer for flow families).
        options: the family's resolved training options (flow families: ``FlowOptions``), or None.
        ema_unet: diffusers' ``EMAModel`` of the denoiser with ``--use_ema``.
        trained_text_encoders: with LoRA ``--train_text_encoder``: the prepared (wrapped) encoders.
        extra: what the family found after ``accelerator.prepare`` (:meth:`Family.prepare_denoiser`).
        unloaded: the :data:`FROZEN_PARTS` not loaded (``text_encoders``: ``tokenizers`` and ``text_encoders`` are
            empty; ``vae``: ``vae`` is an :class:`UnloadedVAE`); :meth:`Family.complete_models` loads them.
    """

    family: Family
    noise_scheduler: Any
    tokenizers: list[Any]
    text_encoders: list[Any]
    vae: Any
    unet: Any
    options: Any = None
    ema_unet: Any = None
    trained_text_encoders: list[Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    unloaded: frozenset[str] = frozenset()

    @property
    def text_encoders_in_use(self) -> list[Any]:
        """The encoders prompts go through: the trained (LoRA) ones first, then the frozen rest."""
        trained = self.trained_text_encoders or []
        return [*trained, *self.text_encoders[len(trained):]]


class Family:
    """One model family, as the training script sees it. Subclasses set the class attributes and the methods
    marked "required"; the defaults suit a family that needs nothing special there."""

    #: registry key and ``--family`` name in reports and the run statistics
    name: str = ""
    #: how reports name it ("SDXL", "Flux.1")
    title: str = ""
    #: the trained model's subfolder, checkpoint folder and LoRA key: ``"unet"`` or ``"transformer"``
    denoiser_name: str = "unet"
    #: how the model card names it ("UNet", "transformer")
    denoiser_title: str = "UNet"
    #: diffusers pipeline class the outputs load with
    pipeline_class_name: str = ""
    #: ``model_index.json`` / ``transformer/config.json`` ``_class_name`` prefixes that mean this family
    class_prefixes: tuple[str, ...] = ()
    #: substrings of a Hub id's name that mean this family (used only when the path is not a local folder)
    hub_name_hints: tuple[str, ...] = ()
    #: words that rule a Hub id out even when a hint matches (e.g. ``("edit",)``: Qwen-Image is not its edit models)
    hub_name_excludes: tuple[str, ...] = ()
    #: upstream defaults: (``--resolution``, ``--validation_epochs``, ``--num_validation_images``) for a full
    #: fine-tune and for LoRA, as diffusers' text-to-image scripts of this family set them
    full_defaults: tuple[int, int, int] = (512, 5, 1)
    lora_defaults: tuple[int, int, int] = (512, 1, 4)
    #: ``--output_dir`` defaults (full fine-tune, LoRA)
    output_dirs: tuple[str, str] = ("model-finetuned", "model-finetuned-lora")
    #: flags that do not apply to this family, with their "not given" values: given, they are refused by name
    refused_flags: dict[str, Any] = {}
    #: what those flags are for, in the refusal ("SD3 / Flux (flow matching)")
    refused_flags_for: str = ""
    #: the end of that refusal: "." or a pointer to what the family trains with instead
    refusal_note: str = "."
    #: the training objective: ``"flow"`` (flow matching) or ``"noise"`` (epsilon / v-prediction); the flow families
    #: (:func:`hf_arb.families.flow_families`) are the registered adapters whose objective is ``"flow"``
    objective: str = ""
    #: ``--packing`` (several images at their own size in one token sequence) applies
    supports_packing: bool = False
    #: the diffusers class of the VAE (``--pretrained_vae_model_name_or_path`` loads as this class too)
    vae_class_name: str = "AutoencoderKL"
    #: the :data:`FROZEN_PARTS` the loss reads even from stored latents and embeddings (Flux.2: the VAE's batch-norm
    #: statistics normalise its latents): loaded whatever the data holds
    loss_reads: frozenset[str] = frozenset()
    #: model card front matter
    card_tags: tuple[str, ...] = ()
    card_license: str = "other"
    #: the dtype the model card's code runs the pipeline in on a GPU (float32 on CPU)
    inference_dtype: str = "float16"
    #: how the pipeline takes the input images of ``--reference_image_column``: ``""`` (it takes none: the card
    #: shows no image), ``"one"`` (``image=PIL image``) or ``"list"`` (``image=[...]``, one per column)
    image_argument: str = ""
    #: a video family's frame rule, a name of :data:`hf_arb.video.frames.FRAME_RULES` (``"wan"``: clips of 4k+1
    #: frames); ``""`` for an image family, every sample of which is one frame (:meth:`frame_rule`)
    frame_rule_name: str = ""

    # ------------------------------------------------------------------------------------------ detection
    @classmethod
    def detect(cls, path: str) -> bool:
        """Whether ``path`` (a local diffusers folder or a Hub id) holds this family. Default: the folder's
        ``model_index.json`` (or ``transformer/config.json``) class name starts with one of
        :attr:`class_prefixes`; a Hub id's name contains one of :attr:`hub_name_hints` and none of
        :attr:`hub_name_excludes`."""
        root = Path(path)
        if root.is_dir():
            for config in (root / "model_index.json", root / "transformer" / "config.json"):
                name = read_class_name(config)
                if name:
                    return name.startswith(cls.class_prefixes) if cls.class_prefixes else False
            return False
        lowered = root.name.lower()
        return (any(hint in lowered for hint in cls.hub_name_hints)
                and not any(word in lowered for word in cls.hub_name_excludes))

    # ------------------------------------------------------------------------------------------ flags
    def defaults(self, lora: bool) -> dict[str, Any]:
        """The family's upstream defaults for the flags left unset on the command line."""
        resolution, epochs, images = self.lora_defaults if lora else self.full_defaults
        return {"resolution": resolution, "output_dir": self.output_dirs[lora], "validation_epochs": epochs,
                "num_validation_images": images}

    def check_flags(self, args: argparse.Namespace) -> None:
        """Family-specific flag checks beyond :attr:`refused_flags` (raise ``UsageError``)."""

    def checkpoint_dirs(self, args: argparse.Namespace) -> tuple[str, ...]:
        """The model folders a full fine-tune's checkpoint must hold (``--resume_from_checkpoint`` checks them)."""
        return (self.denoiser_name,)

    # ------------------------------------------------------------------------------------------ models
    def load_models(self, args: argparse.Namespace, parts: frozenset[str] = FROZEN_PARTS) -> Models:
        """Required. Load the trained denoiser and the frozen ``parts`` (of :data:`FROZEN_PARTS`, plus
        :attr:`loss_reads`) from ``args.pretrained_model_name_or_path``: :meth:`load_frozen` loads them."""
        raise NotImplementedError

    def load_text_encoders(self, path: str, revision: str | None, variant: str | None) -> tuple[list[Any], list[Any]]:
        """Required. The family's ``(tokenizers, text encoders)``, in the pipeline's order."""
        raise NotImplementedError

    def vae_source(self, args: argparse.Namespace) -> tuple[str, str | None]:
        """``(folder or Hub id, subfolder)`` of the run's VAE: ``--pretrained_vae_model_name_or_path``, else the
        model's ``vae/``."""
        if getattr(args, "pretrained_vae_model_name_or_path", None):
            return args.pretrained_vae_model_name_or_path, None
        return args.pretrained_model_name_or_path, "vae"

    def load_vae(self, args: argparse.Namespace) -> Any:
        """The run's VAE (:meth:`vae_source`), as :attr:`vae_class_name`."""
        import diffusers

        path, sub = self.vae_source(args)
        return getattr(diffusers, self.vae_class_name).from_pretrained(path, subfolder=sub, revision=args.revision,
                                                                       variant=args.variant)

    def load_frozen(self, args: argparse.Namespace, parts: frozenset[str]) -> tuple[list[Any], list[Any], Any]:
        """``(tokenizers, text encoders, VAE)``, frozen: the ``parts`` asked; a part not asked stays unloaded (no
        tokenizer or encoder; the VAE's config only, :class:`UnloadedVAE`). :meth:`load_models` asks its ``parts``
        and :attr:`loss_reads`, and records the rest in :attr:`Models.unloaded`."""
        tokenizers, encoders = (self.load_text_encoders(args.pretrained_model_name_or_path, args.revision,
                                                        args.variant) if "text_encoders" in parts else ([], []))
        if "vae" in parts:
            vae = self.load_vae(args)
        else:
            import diffusers
            from diffusers.configuration_utils import FrozenDict

            path, sub = self.vae_source(args)
            config = getattr(diffusers, self.vae_class_name).load_config(path, subfolder=sub, revision=args.revision)
            vae = UnloadedVAE(FrozenDict(config))
        for module in (*encoders, vae):
            module.requires_grad_(False)
        return tokenizers, encoders, vae

    def complete_models(self, args: argparse.Namespace, models: Models) -> list[Any]:
        """Load what :meth:`load_models` left unloaded (validation and the saved pipeline need every part); returns
        the modules it loaded (none when everything was), for the caller to place."""
        if not models.unloaded:
            return []
        tokenizers, encoders, vae = self.load_frozen(args, models.unloaded)
        loaded = list(encoders)
        if "text_encoders" in models.unloaded:
            models.tokenizers, models.text_encoders = tokenizers, encoders
        if "vae" in models.unloaded:
            models.vae = vae
            loaded.append(vae)
        models.unloaded = frozenset()
        return loaded

    def check_buckets(self, models: Models, buckets: Any) -> None:
        """Raise ``UsageError`` when a bucket's size is one the denoiser cannot take (in flags). ``buckets.resolutions``
        is ``(k, 2)`` (width, height), or ``(k, 3)`` (width, height, frames) for clips: a video family checks the
        frames against :meth:`frame_rule`."""

    def frame_rule(self, models: Models | None = None) -> Any:
        """The :class:`~hf_arb.video.frames.FrameRule` of the clips this family trains (read from ``models``' VAE
        where given, else :attr:`frame_rule_name`'s), or ``None`` for an image family: every sample is one frame."""
        if not self.frame_rule_name:
            return None
        from hf_arb.video.frames import frame_rule

        return frame_rule(self.frame_rule_name)

    def latent_patch(self, args: argparse.Namespace) -> tuple[int, int, int]:
        """``(spatial, frame_step, patch_t)``: pixels per latent token side (VAE factor x patch), frames per latent
        frame, latent frames per token, read from the checkpoint's configs before any weight loads (a clip run's
        ``--video_token_budget``). A family that does not say refuses the flag."""
        from hf_arb.checks import UsageError

        raise UsageError(f"--video_token_budget: the {self.title} family does not read its latent patch yet; use "
                         "--max_pixels_per_batch (pixels x frames per batch) instead.")

    def startup_lines(self, models: Models, buckets: Any) -> str:
        """Family-specific lines of the startup report (flow families: each bucket's shift); ``""`` for none."""
        return ""

    def vae_dtype(self, args: argparse.Namespace, weight_dtype: Any) -> Any:
        """The dtype the frozen VAE runs in (SDXL's VAE overflows in fp16 and stays float32)."""
        return weight_dtype

    def prepare_denoiser(self, args: argparse.Namespace, models: Models, denoiser: Any) -> None:
        """After ``accelerator.prepare``: record what the loss needs from the unwrapped denoiser in ``models.extra``."""

    def guidance(self, options: Any, count: int, device: Any) -> Any:
        """The denoiser's guidance input for ``count`` images (``(count,)`` float32 on ``device``), or None where the
        denoiser takes none; ``options``: :attr:`Models.options`. The loss, ``--packing``'s included, asks this."""
        return None

    # ------------------------------------------------------------------------------------------ training
    def encode_text(self, models: Models, encoders: list[Any], captions: list[str], device: Any) -> tuple[Any, Any]:
        """Required. Captions → ``(hidden states (B, S, D), pooled (B, P) or None)`` as the family's pipeline builds
        them, through ``encoders`` (the trained ones carry gradients)."""
        raise NotImplementedError

    def training_loss(self, args: argparse.Namespace, models: Models, denoiser: Any, batch: dict[str, Any],
                      text: Any, generator: Any, dtype: Any) -> Any:
        """Required. The loss of one micro-batch (``pixel_values`` or cached ``latent_stats``, ``captions`` and the
        crop conditioning); every random draw comes from ``generator``; ``text`` encodes captions (memoised)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ LoRA
    def lora_targets(self, args: argparse.Namespace) -> list[str]:
        """Required. The denoiser's module names LoRA adapts (upstream's defaults, or the run's flags)."""
        raise NotImplementedError

    def lora_text_encoders(self, models: Models) -> list[Any]:
        """The text encoders ``--train_text_encoder`` adapts (default: all)."""
        return list(models.text_encoders)

    def lora_file_class(self, args: argparse.Namespace | None = None) -> Any:
        """The diffusers class whose ``save_lora_weights`` writes (and ``lora_state_dict`` reads) the run's LoRA file:
        the pipeline class, or a LoRA loader mixin where the pipeline has none (HunyuanVideo 1.5)."""
        return self.pipeline_class(args)

    def load_lora_into(self, pipe: Any, folder: str) -> None:
        """Load a saved LoRA folder into a stock pipeline as users will (default ``pipe.load_lora_weights``)."""
        pipe.load_lora_weights(folder)

    # ------------------------------------------------------------------------------------------ outputs
    def register_checkpoint_hooks(self, accelerator: Any, models: Models, unwrap: Any) -> None:
        """Required. Save the trained denoiser in diffusers format inside accelerate checkpoints and load it back."""
        raise NotImplementedError

    def pipeline_class(self, args: argparse.Namespace | None = None) -> Any:
        """The diffusers pipeline class the outputs load with (``args``: the run's flags, where they change it)."""
        import diffusers

        return getattr(diffusers, self.pipeline_class_name)

    def build_pipeline(self, args: argparse.Namespace, models: Models, denoiser: Any, dtype: Any, *,
                       final: bool = False) -> Any:
        """Required. The inference pipeline around ``denoiser``: for validation it reuses the loaded parts; the
        ``final`` one loads the frozen parts fresh (float32), plus the replacement VAE if one was given."""
        raise NotImplementedError

    def save_pipeline(self, args: argparse.Namespace, pipe: Any, output_dir: str) -> None:
        """Write the final pipeline so that stock diffusers loads it."""
        pipe.save_pretrained(output_dir)

    def card_lines(self, args: argparse.Namespace) -> list[str]:
        """Family-specific paragraphs of the model card (markdown lines)."""
        return []

    def usage(self, args: argparse.Namespace, repo_id: str) -> tuple[str, list[str]]:
        """The model card's loading code: ``(import name, lines that load pipe)``, plain diffusers, no hf_arb.
        The lines may import more and define a helper (:meth:`load_code` runs them after the diffusers import)."""
        cls = self.pipeline_class_name
        if getattr(args, "lora", False):
            return cls, [f'pipe = {cls}.from_pretrained("{args.pretrained_model_name_or_path}")',
                         f'pipe.load_lora_weights("{repo_id}")']
        return cls, [f'pipe = {cls}.from_pretrained("{repo_id}")']

    def generation_args(self, args: argparse.Namespace, shape: tuple[int, ...]) -> list[str]:
        """The keyword arguments of the model card's generation call at ``shape`` (width, height[, frames]; a video
        family adds its frame count), as source text:
        the input images of the run's reference columns (a file per column, ``before.jpg`` for ``before``; see
        :attr:`image_argument`), the prompt, ``height`` and ``width``. Families whose pipeline rescales the output
        add what keeps the requested size (Kontext: ``max_area``)."""
        refs = [f"Image.open({json.dumps(column + '.jpg')})"
                for column in getattr(args, "reference_image_column", None) or []]
        image = []
        if refs and self.image_argument == "one":
            image = [f"image={refs[0]}"]
        elif refs and self.image_argument == "list":
            image = [f"image=[{', '.join(refs)}]"]
        return [*image, 'prompt="a photo"', f"height={shape[1]}", f"width={shape[0]}"]

    def load_code(self, args: argparse.Namespace, repo_id: str) -> list[str]:
        """The lines that load the output in plain diffusers (no hf_arb): the diffusers import, then
        :meth:`usage`'s lines. The run's last line prints them (:meth:`saved_message`)."""
        cls, load = self.usage(args, repo_id)
        return [f"from diffusers import {cls}", *load]

    def card_code(self, args: argparse.Namespace, repo_id: str, shape: tuple[int, int]) -> list[str]:
        """The model card's "Use" code, plain diffusers (no hf_arb), runnable as printed on a GPU or a CPU:
        :meth:`load_code`, the device line (:attr:`inference_dtype` on a GPU, float32 on a CPU), and one generation
        at ``shape`` (width, height; a trained bucket) with :meth:`generation_args`."""
        call = self.generation_args(args, shape)
        pil = ["from PIL import Image"] if any("Image.open(" in a for a in call) else []
        load = self.load_code(args, repo_id)
        return ["import torch", load[0], *pil, "", *load[1:],
                f'device, dtype = ("cuda", torch.{self.inference_dtype}) if torch.cuda.is_available() '
                'else ("cpu", torch.float32)',
                "pipe = pipe.to(device, dtype)",
                *self.generation_lines(", ".join(call))]

    def generation_lines(self, call: str) -> list[str]:
        """The model card's generation line(s) for the call's keyword arguments ``call`` (source text); a video
        family's write a video file instead."""
        return [f"image = pipe({call}).images[0]  # a trained bucket shape"]

    def validation_kwargs(self, args: argparse.Namespace) -> dict[str, Any]:
        """The family's own keywords for its validation pipeline calls (:meth:`generate`), read from the run's flags;
        none by default (LTX-Video: ``frame_rate``, the ``--target_fps`` its rotary positions trained at)."""
        return {}

    def generate(self, pipe: Any, shape: tuple[int, ...], **kwargs: Any) -> Any:
        """One validation sample of ``pipe`` at ``shape`` (width, height[, frames]); ``kwargs``: the prompt, the
        generator and the run's pipeline keywords. An image (PIL) from ``.images``; a video family (a
        :attr:`frame_rule_name`) asks for ``num_frames`` (the bucket's frames, 1 for a 2-D bucket) and returns the
        pipeline's ``.frames[0]`` (:mod:`hf_arb.train.videos` writes it as an MP4 and draws its frame strip)."""
        if self.frame_rule_name:
            kwargs["num_frames"] = int(shape[2]) if len(shape) > 2 else 1
        out = pipe(height=shape[1], width=shape[0], **kwargs)
        return out.frames[0] if hasattr(out, "frames") else out.images[0]

    def saved_message(self, args: argparse.Namespace, output_dir: str) -> str:
        """What the run prints last: where the output is and the code that loads it (:meth:`load_code`). One line
        (statements joined by ``; ``) where every statement is simple; otherwise the code on the following lines,
        as the model card shows it, fenced like the card's block (```` ```python ```` … ```` ``` ````)."""
        code = self.load_code(args, output_dir)
        head = f"Saved to {output_dir}: load it with"
        if all(line.strip() and not line[0].isspace() and not line.rstrip().endswith(":") for line in code):
            return f"{head} " + "; ".join(code)
        return f"{head}:\n```python\n" + "\n".join(code) + "\n```"


def read_class_name(config: Path) -> str | None:
    """``_class_name`` of a diffusers config file, or None when it is absent or unreadable."""
    try:
        return json.loads(config.read_text()).get("_class_name") if config.is_file() else None
    except (OSError, ValueError):
        return None


_REGISTERED: dict[str, type[Family]] = {}  # registered by plugins / tests: asked first
_BUILTIN: dict[str, type[Family]] = {}  # filled from BUILTIN_MODULES on first use


def register_family(cls: type[Family], *, builtin: bool = False) -> type[Family]:
    """Register a :class:`Family` subclass (usable as a class decorator). A registered name replaces a built-in
    one of the same name; :func:`detect_family` asks registered families before the built-ins."""
    if not (isinstance(cls, type) and issubclass(cls, Family)) or not cls.name:
        raise TypeError(f"register_family needs a Family subclass with a `name`, got {cls!r}.")
    (_BUILTIN if builtin else _REGISTERED)[cls.name] = cls
    return cls


def builtin_family(cls: type[Family]) -> type[Family]:
    """Class decorator of the families in :data:`BUILTIN_MODULES` (asked after the registered ones)."""
    return register_family(cls, builtin=True)


def unregister_family(name: str) -> None:
    """Forget a family registered with :func:`register_family` (tests clean up with it)."""
    _REGISTERED.pop(name, None)


def _builtins() -> dict[str, type[Family]]:
    """The built-in families in :data:`BUILTIN_MODULES` order (each module registers itself on import)."""
    for module in BUILTIN_MODULES:
        importlib.import_module(module)  # cached after the first call
    order = {m: i for i, m in enumerate(BUILTIN_MODULES)}
    return dict(sorted(_BUILTIN.items(), key=lambda kv: order.get(kv[1].__module__, len(order))))


def family_names() -> list[str]:
    """Every family the script can train: registered ones first, then the built-ins."""
    return [*_REGISTERED, *(n for n in _builtins() if n not in _REGISTERED)]


def get_family(name: str) -> Family:
    """The adapter of family ``name`` (a new instance)."""
    cls = _REGISTERED.get(name) or _builtins().get(name)
    if cls is None:
        raise ValueError(f"Unknown model family {name!r}; known: {', '.join(family_names())}.")
    return cls()


def claiming_families(path: str) -> list[str]:
    """The most specific built-in families whose :meth:`Family.detect` says yes for ``path``: of a family and its
    subclass (Flux.1 and Flux.1 Kontext) only the subclass; the fallback, which claims everything, left out. One,
    or none for the fallback: two would make detection depend on the order of :data:`BUILTIN_MODULES`, which the
    tests rule out."""
    *specific, _fallback = [c for n, c in _builtins().items() if n not in _REGISTERED]
    claims = [cls for cls in specific if cls.detect(path)]
    return [c.name for c in claims if not any(o is not c and issubclass(o, c) for o in claims)]


def detect_family(path: str) -> str:
    """The family of a local diffusers folder or a Hub id: the first registered family whose :meth:`Family.detect`
    says yes, else the built-in one that claims it (:func:`claiming_families`), else the fallback, the last
    built-in (SD 1.x/2.x)."""
    for cls in _REGISTERED.values():
        if cls.detect(path):
            return cls.name
    claims = claiming_families(path)
    return claims[0] if claims else [n for n in _builtins() if n not in _REGISTERED][-1]
