"""``hf-arb encode OUT -- <training flags>``: encode a run's latents and prompt embeddings once into a sharded
``datasets`` dataset (:mod:`hf_arb.train.encoded`), resume an interrupted encode, push it to the Hub.

The flags after ``--`` are the training script's (``train_text_to_image_arb.py``): the encode runs that run's own
plan (bucket table, crops and flips, variants) with its model, so training with the same flags plus
``--encoded_dataset OUT`` reads exactly what ``--cache_latents --cache_text_embeddings`` would have computed.

Several processes: ``accelerate launch -m hf_arb.cli encode OUT -- ...`` (each rank its share of the shards);
``--engine ray``: Ray Data actors with the same per-batch function."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from .buckets import UsageError, positive_int


def add_encode_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output", help="the folder the encoded dataset is written to (kept shards are reused)")
    p.add_argument("--shard-size", type=positive_int, default=1000,
                   help="(image, bucket, variant) entries per Parquet shard (default: 1000)")
    p.add_argument("--prompt-shard-size", type=positive_int, default=10000,
                   help="captions per prompts shard (default: 10000)")
    p.add_argument("--num-processes", type=positive_int, default=None,
                   help="the processes the run will train on (its plan; default: this launch's)")
    p.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="local (one process, or each rank of an accelerate launch) or ray (Ray Data actors)")
    p.add_argument("--from-cache", default=None, metavar="DIR",
                   help="convert the per-file latent cache DIR (--cache_latents --latent_cache_dir DIR of a run with "
                        "these flags) instead of running the VAE; a missing or damaged entry refuses it")
    p.add_argument("--push-to-hub", default=None, metavar="REPO_ID",
                   help="upload the finished dataset as this Hub dataset repository")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: a private repository")
    p.set_defaults(train_args=[])  # hf_arb.cli.app.main hands it what follows "--": the training script's flags


def run_encode(args: argparse.Namespace) -> int:
    from hf_arb.checks import UsageError as RunUsageError

    try:
        return _run_encode(args)
    except RunUsageError as e:  # the training floor's refusals: one "hf-arb encode: error:" line, exit status 2
        raise UsageError(str(e)) from None


def _run_encode(args: argparse.Namespace) -> int:
    from hf_arb.train.encoded.encode import encode_dataset, encode_with_ray, push_encoded
    from hf_arb.train.flags.args import parse_args

    flags = list(args.train_args)
    if not flags:
        raise UsageError("give the training flags after --: hf-arb encode OUT -- --pretrained_model_name_or_path "
                         "MODEL --train_data_dir DIR --resolution 512 ...")
    if any(f.split("=")[0] == "--encoded_dataset" for f in flags):
        raise UsageError("--encoded_dataset among the training flags: hf-arb encode reads the images; drop it.")
    cached = "--latent_cache_variants" in flags and "--cache_latents" not in flags  # the variants of a cached run
    train = parse_args([*flags, *(["--cache_latents"] if cached else []),
                        *([] if "--output_dir" in flags else ["--output_dir", args.output])])
    if args.from_cache is not None:
        if args.engine == "ray":
            raise UsageError("--from-cache reads the cache in one process: drop --engine ray.")
        from hf_arb.train.encoded.from_cache import convert_cache

        info = convert_cache(train, args.output, args.from_cache, num_processes=args.num_processes,
                             shard_size=args.shard_size, prompt_shard_size=args.prompt_shard_size)
    elif args.engine == "ray":
        info = encode_with_ray(train, args.output, num_processes=args.num_processes or 1,
                               shard_size=args.shard_size, prompt_shard_size=args.prompt_shard_size)
    else:
        info = encode_dataset(train, args.output, num_processes=args.num_processes, shard_size=args.shard_size,
                              prompt_shard_size=args.prompt_shard_size)
    if info is None:  # not the main process of an accelerate launch
        return 0
    print(json.dumps({k: info[k] for k in ("entries", "captions") if k in info}
                     | {"bad_entries": len(info.get("bad_entries", [])), "output": args.output}), file=sys.stdout)
    if args.push_to_hub:
        commit = push_encoded(args.output, args.push_to_hub, private=args.private or None)
        print(f"pushed to {args.push_to_hub} ({getattr(commit, 'oid', commit)})")
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "encode": ("encode a run's latents and prompt embeddings into a sharded dataset (train with --encoded_dataset)",
               add_encode_arguments, run_encode),
}
