"""LoRA adapters the diffusers way: ``peft.LoraConfig`` + ``add_adapter``, saved as ``pytorch_lora_weights``.

The training script's LoRA mode uses these helpers; they follow diffusers' ``train_text_to_image_lora*.py``:

* :func:`add_lora` freezes a model, casts its frozen weights to the training dtype, adds a LoRA adapter
  (``init_lora_weights="gaussian"``, ``lora_alpha`` defaulting to the rank, as upstream) and keeps the adapter's
  trainable parameters in float32 (mixed precision trains fp32 LoRA weights on a half-precision base);
* :func:`save_lora` writes the adapters with the pipeline class's ``save_lora_weights``
  (``get_peft_model_state_dict`` → ``convert_state_dict_to_diffusers``) together with each adapter's
  ``LoraConfig`` as ``lora_adapter_metadata`` (as diffusers' own scripts save it), so that plain diffusers loads
  them with ``pipe.load_lora_weights(folder)`` at the trained strength (``lora_alpha / r``);
* :func:`load_lora` puts such a file back into the adapters of a training model (checkpoint resume);
* :func:`save_kohya_lora` writes the same adapters in kohya's key names (``--output_kohya_format``).

Example:
    ```py
    >>> from diffusers import StableDiffusionPipeline
    >>> from hf_arb.train.lora import UNET_TARGET_MODULES, add_lora, save_lora
    >>> pipe = StableDiffusionPipeline.from_pretrained("tiny-sd")
    >>> params = add_lora(pipe.unet, rank=4, target_modules=UNET_TARGET_MODULES)
    >>> save_lora(StableDiffusionPipeline, "out", pipe.unet)  # out/pytorch_lora_weights.safetensors
    ```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["UNET_TARGET_MODULES", "TEXT_ENCODER_TARGET_MODULES", "LORA_WEIGHTS_NAME", "KOHYA_WEIGHTS_NAME", "add_lora",
           "lora_layers", "save_lora", "adapter_metadata", "load_lora", "save_kohya_lora"]

#: Attention projections of diffusers' UNet blocks, the modules diffusers' LoRA scripts adapt.
UNET_TARGET_MODULES: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")
#: Attention projections of transformers' CLIP text encoders (train_text_to_image_lora_sdxl.py's targets).
TEXT_ENCODER_TARGET_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "out_proj")
#: The file ``save_lora_weights`` writes and ``load_lora_weights`` reads by default.
LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"

#: ``save_lora_weights`` keyword per text encoder position (SD has one, SDXL two).
_TEXT_ENCODER_KWARGS = ("text_encoder_lora_layers", "text_encoder_2_lora_layers")
_TEXT_ENCODER_PREFIXES = ("text_encoder.", "text_encoder_2.")


def add_lora(model: Any, *, rank: int, target_modules: tuple[str, ...] | list[str], alpha: float | None = None,
             dropout: float = 0.0, dtype: torch.dtype = torch.float32, use_dora: bool = False
             ) -> list[torch.nn.Parameter]:
    """Freeze ``model``, cast it to ``dtype``, add a LoRA adapter; return the (float32) trainable parameters.

    Args:
        model: a diffusers model or transformers ``PreTrainedModel`` (both have ``add_adapter``).
        rank: LoRA rank ``r``.
        target_modules: names of the linear layers to adapt.
        alpha: ``lora_alpha`` (default: ``rank``, i.e. scale 1, as diffusers' text-to-image LoRA scripts).
        dropout: LoRA dropout probability.
        dtype: dtype of the frozen base weights (the mixed-precision dtype; a quantized model keeps its own);
            adapter weights stay float32.
        use_dora: train DoRA (weight-decomposed) adapters, peft's ``use_dora``.
    """
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}.")
    model.requires_grad_(False)
    # (diffusers warns on every dtype cast, a no-op one too; a quantized model refuses any: QLoRA keeps its dtypes)
    if model.dtype != dtype and not getattr(model, "is_quantized", False):
        model.to(dtype=dtype)
    config = LoraConfig(r=rank, lora_alpha=rank if alpha is None else alpha, lora_dropout=dropout,
                        init_lora_weights="gaussian", target_modules=list(target_modules), use_dora=use_dora)
    model.add_adapter(config)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"No module of {type(model).__name__} matches the LoRA target modules {list(target_modules)}.")
    cast_training_params(model, dtype=torch.float32)
    return [p for p in model.parameters() if p.requires_grad]


def lora_layers(model: Any, *, convert: bool = True) -> dict[str, torch.Tensor]:
    """The model's adapter weights in diffusers' serialisation format (``convert=False``: peft's key names, which
    the SD3 / Flux LoRA loaders take, as diffusers' dreambooth_lora_sd3/flux scripts save them)."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    return convert_state_dict_to_diffusers(state) if convert else state


def save_lora(pipeline_cls: Any, folder: str | Path, unet: Any, text_encoders: list[Any] | None = None, *,
              denoiser: str = "unet") -> Path:
    """Write ``folder/pytorch_lora_weights.safetensors`` with ``pipeline_cls.save_lora_weights``.

    Args:
        pipeline_cls: ``StableDiffusionPipeline`` or ``StableDiffusionXLPipeline`` (its LoRA loader format).
        unet: the UNet carrying the adapter.
        text_encoders: text encoders carrying adapters, in pipeline order (``text_encoder``, ``text_encoder_2``).
        denoiser: ``"unet"``, or ``"transformer"`` for SD3 / Flux (``unet`` is then the transformer).
    """
    convert = denoiser == "unet"  # SD3 / Flux: peft's key names, as diffusers' dreambooth_lora_sd3/flux scripts
    kwargs: dict[str, Any] = {f"{denoiser}_lora_layers": lora_layers(unet, convert=convert),
                              f"{denoiser}_lora_adapter_metadata": adapter_metadata(unet)}
    for name, te in zip(_TEXT_ENCODER_KWARGS, text_encoders or []):
        kwargs[name] = lora_layers(te, convert=convert)
        kwargs[name.replace("_layers", "_adapter_metadata")] = adapter_metadata(te)
    pipeline_cls.save_lora_weights(str(folder), **kwargs)
    return Path(folder) / LORA_WEIGHTS_NAME


def adapter_metadata(model: Any) -> dict[str, Any]:
    """The model's adapter configuration (``LoraConfig.to_dict()``): ``save_lora_weights`` stores it in the file's
    ``lora_adapter_metadata`` and ``load_lora_weights`` rebuilds the adapter from it (rank, ``lora_alpha``, DoRA)."""
    return model.peft_config["default"].to_dict()


def load_lora(pipeline_cls: Any, folder: str | Path, unet: Any, text_encoders: list[Any] | None = None, *,
              denoiser: str = "unet") -> None:
    """Load a :func:`save_lora` file into the adapters of ``unet`` (and ``text_encoders``), exactly.

    ``denoiser``: the weights' prefix, ``"unet"`` or ``"transformer"`` (SD3 / Flux).

    Raises:
        ValueError: the file lacks weights for a model's adapter, or has weights no adapter takes.
    """
    from diffusers.utils import convert_state_dict_to_peft, convert_unet_state_dict_to_peft
    from peft.utils import set_peft_model_state_dict

    state = pipeline_cls.lora_state_dict(str(folder))
    state = state[0] if isinstance(state, tuple) else state
    parts: list[tuple[str, Any, Any]] = [(f"{denoiser}.", unet, convert_unet_state_dict_to_peft)]
    parts += [(p, te, convert_state_dict_to_peft) for p, te in zip(_TEXT_ENCODER_PREFIXES, text_encoders or [])]
    for prefix, model, convert in parts:
        sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if not sub:
            raise ValueError(f"{Path(folder) / LORA_WEIGHTS_NAME} has no '{prefix}*' LoRA weights.")
        peft_keys = any(".lora_A." in k or ".lora_B." in k for k in sub)  # saved unconverted (SD3 / Flux)
        result = set_peft_model_state_dict(model, sub if peft_keys else convert(sub), adapter_name="default")
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise ValueError(f"LoRA weights for '{prefix}' do not fit the adapter: unexpected keys {unexpected[:5]}.")


#: ``--output_kohya_format``'s second file, beside :data:`LORA_WEIGHTS_NAME` (train_dreambooth_lora_sdxl.py's name)
KOHYA_WEIGHTS_NAME = "pytorch_lora_weights_kohya.safetensors"


def save_kohya_lora(folder: str | Path, alpha: float) -> Path:
    """``--output_kohya_format``: the saved LoRA file also in kohya's key names (``lora_unet_*``, ``lora_te1_*``,
    ``lora_te2_*``) for AUTOMATIC1111, ComfyUI and kohya's tools, converted as train_dreambooth_lora_sdxl.py does
    (``convert_all_state_dict_to_peft`` → ``convert_state_dict_to_kohya``). diffusers writes each module's rank as its
    ``.alpha``, which is the trained strength only when ``lora_alpha`` equals the rank; here every ``.alpha`` is the
    adapters' ``alpha``, so the file loads at the strength it trained with.

    Returns:
        the path of the written file.
    """
    from diffusers.utils.state_dict_utils import convert_all_state_dict_to_peft, convert_state_dict_to_kohya
    from safetensors.torch import load_file, save_file

    weights = load_file(str(Path(folder) / LORA_WEIGHTS_NAME))
    kohya = convert_state_dict_to_kohya(convert_all_state_dict_to_peft(weights))
    kohya = {k: torch.tensor(float(alpha)) if k.endswith(".alpha") else v.contiguous() for k, v in kohya.items()}
    path = Path(folder) / KOHYA_WEIGHTS_NAME
    save_file(kohya, str(path))
    return path
