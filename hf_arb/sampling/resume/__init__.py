"""Where a resumable batch sampler stands and how it resumes: the one step cursor every step-planned sampler holds
(:class:`~hf_arb.sampling.sampler.BucketBatchSampler`, :class:`~hf_arb.sampling.tiered.sampler.TieredBatchSampler`,
:class:`~hf_arb.packing.PackBatchSampler`), what its first accelerate pass after a restore does, and the state.

- :mod:`~hf_arb.sampling.resume.cursor` — :class:`StepCursor`: epoch, steps handed out, where passes start;
- :mod:`~hf_arb.sampling.resume.restore` — the first pass after a restore (accelerate's public objects only);
- :mod:`~hf_arb.sampling.resume.state` — :class:`ResumableBatchSampler`, the bucket sampler's state and its checks.

Imports nothing of :mod:`hf_arb.sampling` outside this folder.
"""
