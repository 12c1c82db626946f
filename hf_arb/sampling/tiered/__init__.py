"""Several resolution tiers in one resumable plan: every row's bucket in every tier, which tier trains at every step
(the schedules), the samplers over them (map-style and streaming) and their state and report.

- :mod:`~hf_arb.sampling.tiered.plan` — :class:`Tiers`, each row's bucket in every tier (pure functions);
- :mod:`~hf_arb.sampling.tiered.schedule` — the resolution schedules (progressive, curriculum, mix, random);
- :mod:`~hf_arb.sampling.tiered.draw` — the ``random`` schedule's per-row-group tier draw in ``O(groups)``;
- :mod:`~hf_arb.sampling.tiered.files` — the node-shared files (tier columns, row groups);
- :mod:`~hf_arb.sampling.tiered.sampler` — :class:`TieredBatchSampler` (its cursor:
  :mod:`~hf_arb.sampling.resume.cursor`);
- :mod:`~hf_arb.sampling.tiered.state` — its resume state;
- :mod:`~hf_arb.sampling.tiered.report` — :class:`TierReport`, what an epoch trains per tier and bucket;
- :mod:`~hf_arb.sampling.tiered.stream` — :class:`TieredStream`, the same from a streaming dataset;
- :mod:`~hf_arb.sampling.tiered.stream_draw` — the ``random`` schedule from a stream.

Built on :mod:`~hf_arb.sampling.planning`, :mod:`~hf_arb.sampling.streaming` and :mod:`~hf_arb.sampling.resume`.
"""
