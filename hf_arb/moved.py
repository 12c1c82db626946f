"""Module paths of release 0.1 that moved into the stage folders (and, in 0.2, the flat ``hf_arb.sampling`` modules
that moved into its concept subfolders), kept working for one release.

``import hf_arb.tiny`` (and ``from hf_arb.tiny import save_tiny_sd``) still works: a finder on ``sys.meta_path``
answers each old path in :data:`MOVED` with the module at its new path — the very same module object, so
``hf_arb.tiny.save_tiny_sd is hf_arb.testing.tiny.save_tiny_sd`` — and warns once with a
``DeprecationWarning`` naming the new path. docs/api.md lists every moved path. Nothing here patches another
library: the finder only answers names under ``hf_arb.``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: old module path -> new module path (both importable; the old one for release 0.2 only)
MOVED: dict[str, str] = {
    "hf_arb.assignment": "hf_arb.buckets.assignment",
    "hf_arb.presets": "hf_arb.buckets.presets",
    "hf_arb.preset_sources": "hf_arb.buckets.preset_sources",
    "hf_arb.matching": "hf_arb.buckets.matching",
    "hf_arb.schema": "hf_arb.buckets.schema",
    "hf_arb.fit": "hf_arb.buckets.fit",
    "hf_arb.geometry": "hf_arb.images.geometry",
    "hf_arb.imaging": "hf_arb.images.fitting",
    "hf_arb.data": "hf_arb.images.dataset",
    "hf_arb.batch": "hf_arb.images.collate",
    "hf_arb.bad_images": "hf_arb.images.bad_images",
    "hf_arb.sizes": "hf_arb.images.sizes",
    "hf_arb.image_values": "hf_arb.images.values",
    "hf_arb.arrow_batch": "hf_arb.annotate.arrow_batch",
    "hf_arb.bucket_core": "hf_arb.annotate.core",
    "hf_arb.annotation_summary": "hf_arb.annotate.summary",
    "hf_arb.hub": "hf_arb.annotate.hub",
    "hf_arb.plot": "hf_arb.annotate.plot",
    "hf_arb.report": "hf_arb.annotate.report",
    "hf_arb.report_html": "hf_arb.annotate.report_html",
    "hf_arb.engines": "hf_arb.annotate.engines",
    "hf_arb.engines.ray": "hf_arb.annotate.engines.ray",
    "hf_arb.engines.spark": "hf_arb.annotate.engines.spark",
    "hf_arb.engines.cli": "hf_arb.cli.engines",
    "hf_arb.shift": "hf_arb.families.shift",
    "hf_arb.conditioning": "hf_arb.families.conditioning",
    "hf_arb.pipeline_sd_resolution": "hf_arb.families.sd_pipeline",
    "hf_arb.pack_layout": "hf_arb.packing.layout",
    "hf_arb.packed": "hf_arb.packing.model",
    "hf_arb.packed_attention": "hf_arb.packing.attention",
    "hf_arb.packed_data": "hf_arb.packing.dataset",
    "hf_arb.packed_loss": "hf_arb.packing.loss",
    "hf_arb.sampling.packs": "hf_arb.packing.sampler",
    "hf_arb.families.packed": "hf_arb.packing.family",
    "hf_arb.latents": "hf_arb.train.cache.latents",
    "hf_arb.latent_dataset": "hf_arb.train.cache.latent_dataset",
    "hf_arb.checkpointing": "hf_arb.train.checkpointing",
    "hf_arb.lora": "hf_arb.train.lora",
    "hf_arb.train.data": "hf_arb.train.sources.dataset",
    "hf_arb.train.streaming": "hf_arb.train.sources.stream",
    "hf_arb.train.loaders": "hf_arb.train.sources.loaders",
    "hf_arb.train.tiers": "hf_arb.train.sources.tiers",
    "hf_arb.train.latents": "hf_arb.train.cache.latents",
    "hf_arb.train.latent_dataset": "hf_arb.train.cache.latent_dataset",
    "hf_arb.train.cache_keys": "hf_arb.train.cache.cache_keys",
    "hf_arb.train.caches": "hf_arb.train.cache.caches",
    "hf_arb.train.args": "hf_arb.train.flags.args",
    "hf_arb.train.arg_checks": "hf_arb.train.flags.arg_checks",
    "hf_arb.annotate_cli": "hf_arb.cli.annotate",
    "hf_arb.cli_buckets": "hf_arb.cli.buckets",
    "hf_arb.cli_report": "hf_arb.cli.report",
    "hf_arb.tiny": "hf_arb.testing.tiny",
    "hf_arb.tiny_flow": "hf_arb.testing.tiny_flow",
    "hf_arb.tiny_text": "hf_arb.testing.tiny_text",
    # release 0.2: sampling/ split into concept subfolders (planning/, tiered/, streaming/, resume/)
    "hf_arb.sampling.plan": "hf_arb.sampling.planning.plan",
    "hf_arb.sampling.layout": "hf_arb.sampling.planning.layout",
    "hf_arb.sampling.sync": "hf_arb.sampling.planning.sync",
    "hf_arb.sampling.ragged": "hf_arb.sampling.planning.ragged",
    "hf_arb.sampling.feistel": "hf_arb.sampling.planning.feistel",
    "hf_arb.sampling.index": "hf_arb.sampling.planning.index",
    "hf_arb.sampling.report": "hf_arb.sampling.planning.report",
    "hf_arb.sampling.batch_sizes": "hf_arb.sampling.planning.batch_sizes",
    "hf_arb.sampling.tiers": "hf_arb.sampling.tiered.sampler",
    "hf_arb.sampling.tier_plan": "hf_arb.sampling.tiered.plan",
    "hf_arb.sampling.tier_random": "hf_arb.sampling.tiered.draw",
    "hf_arb.sampling.tier_files": "hf_arb.sampling.tiered.files",
    "hf_arb.sampling.tier_report": "hf_arb.sampling.tiered.report",
    "hf_arb.sampling.tier_schedule": "hf_arb.sampling.tiered.schedule",
    "hf_arb.sampling.tier_state": "hf_arb.sampling.tiered.state",
    "hf_arb.sampling.tier_stream": "hf_arb.sampling.tiered.stream",
    "hf_arb.sampling.tier_stream_random": "hf_arb.sampling.tiered.stream_draw",
    "hf_arb.sampling.stream": "hf_arb.sampling.streaming.stream",
    "hf_arb.sampling.stream_buffer": "hf_arb.sampling.streaming.buffer",
    "hf_arb.sampling.stream_collate": "hf_arb.sampling.streaming.collate",
    "hf_arb.sampling.stream_plan": "hf_arb.sampling.streaming.plan",
    "hf_arb.sampling.cursor": "hf_arb.sampling.resume.cursor",
    "hf_arb.sampling.restore": "hf_arb.sampling.resume.restore",
    "hf_arb.sampling.state": "hf_arb.sampling.resume.state",
    "hf_arb.sampling.plan_views": "hf_arb.sampling.sampler",
}


class MovedModuleLoader(importlib.abc.Loader):
    """Loads an old path as the module at its new path (the same object, not a copy)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new} (the old path works for release 0.2 only); "
                      f"import {self.new} instead.", DeprecationWarning, stacklevel=3)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:  # already executed at its new path
        return None


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Answers only the names in :data:`MOVED`; every other import goes on to Python's own finders."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, MovedModuleLoader(new), is_package=new.endswith("engines"))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``import hf_arb`` calls this)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
