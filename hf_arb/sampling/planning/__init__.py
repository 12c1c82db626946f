"""The epoch plan as pure functions: which rows form every step's batch on every rank, from (bucket ids, batch
sizes, world size, seed, epoch, options), and what that plan does with the rows. No sampler state lives here.

- :mod:`~hf_arb.sampling.planning.plan` — :func:`plan_epoch`, input validation, :func:`merge_small_buckets`;
- :mod:`~hf_arb.sampling.planning.layout` — the epoch layouts (synchronised and independent) behind one interface;
- :mod:`~hf_arb.sampling.planning.sync` — the synchronised layout, every step computed directly (``O(buckets)``);
- :mod:`~hf_arb.sampling.planning.batch_sizes` — a batch size per bucket (pixel budget, mapping), the loss weights;
- :mod:`~hf_arb.sampling.planning.ragged` — the plan with a batch size per bucket (:func:`plan_epoch_ragged`);
- :mod:`~hf_arb.sampling.planning.feistel` — counter-based keyed permutations of ``[0, n)``;
- :mod:`~hf_arb.sampling.planning.index` — the bucket-grouped row index (4 bytes per row, shareable file);
- :mod:`~hf_arb.sampling.planning.report` — :class:`PlanReport`, what an epoch uses, drops and repeats;
- :mod:`~hf_arb.sampling.planning.shares` — several datasets in one plan: exact shares per epoch, the slot row map.

Imports nothing of :mod:`hf_arb.sampling` outside this folder.
"""
