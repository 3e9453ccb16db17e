"""Reproducible benchmarks for flash_qla.

``python -m flash_qla.bench`` times the forward and backward on the standard matrix (``matrix.json``), with
inputs drawn as :mod:`flash_qla.bench.inputs` says, and writes one JSON line per row in the schema the peer
libraries' benchmark scripts use. Reports and plots are made outside the package (the repository's
``benchmarks`` folder). Nothing here is imported by ``import flash_qla``.
"""
