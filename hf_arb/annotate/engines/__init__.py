"""Run the bucket annotation on cluster engines: :mod:`hf_arb.annotate.engines.ray` (Ray Data) and
:mod:`hf_arb.annotate.engines.spark` (PySpark). Both map the same pure Arrow function,
:func:`hf_arb.annotate.arrow_batch.annotate_batch`, that ``hf_arb.add_bucket_columns`` uses with ``datasets``; install
them with ``pip install "hf_arb[ray]"`` or ``pip install "hf_arb[spark]"``.
"""
