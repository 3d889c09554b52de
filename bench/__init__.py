"""The benchmark suite: ``python -m bench list`` / ``python -m bench run NAME...`` (bench/README.md).

Each benchmark is a module of this package that drives the production code and writes one record,
``<out>/<name>.json``; ``bench/suite.py`` declares every benchmark and its figures, ``bench/common.py`` holds what
they share.
"""
