"""Benchmark reporting for flash_qla (kept out of the wheel).

``python -m flash_qla.bench`` (shipped) times the library and writes one JSON line per matrix row; the peers'
benchmark scripts write the same schema. This package turns a card's files into BENCHMARKS.md:

* :mod:`benchmarks.cards`: read one card's result folder (ours.jsonl and the peers' files);
* :mod:`benchmarks.comparison`: join rows, ratios against each peer, geometric means;
* :mod:`benchmarks.roofline`: the floor no implementation can beat;
* :mod:`benchmarks.plots`: PNG figures (needs matplotlib, the ``bench`` extra);
* :mod:`benchmarks.report`: ``python -m benchmarks.report bench/results/h100 bench/results/h200``;
* :mod:`benchmarks.merge_runs`: one file of per-row medians from several runs.
"""
