"""Benchmarks: ``python -m torchpar.bench <suite> [options]``.

Each suite is a module ``torchpar.bench.<suite>`` exposing ``main(argv)``; every suite
measures torchpar beside its peer in the same run and prints the ratio.
"""
