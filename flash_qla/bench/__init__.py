"""Reproducible benchmarks for flash_qla.

* ``python -m flash_qla.bench``: time the forward and backward on the standard matrix (inputs as in
  ``../shared/bench/inputs.md``), writing one JSON line per row in the peers' schema;
* ``python -m flash_qla.bench.report``: turn those lines, plus the peers' timings, into BENCHMARKS.md
  tables and PNG plots.

Nothing here is imported by ``import flash_qla``; plotting needs the ``bench`` extra (matplotlib).
"""
