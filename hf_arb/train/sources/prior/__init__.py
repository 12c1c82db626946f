"""``prior/``: prior preservation's data source, a concept of its own (``--with_prior_preservation``, and a
``--dataset_config`` file's regularization datasets).

- :mod:`~hf_arb.train.sources.prior.pairs` — :class:`PriorSource`: instance batches paired with class images of their
  bucket (:class:`PriorPairs`, :func:`prior_pairs`);
- :mod:`~hf_arb.train.sources.prior.class_images` — the class images: the folder, completed by generation, as a
  dataset.
"""

from .pairs import PriorPairs, PriorSource, prior_pairs, prior_report

__all__ = ["PriorPairs", "PriorSource", "prior_pairs", "prior_report"]
