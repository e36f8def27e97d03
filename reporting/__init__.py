"""Reporting: the reproduction report and the benchmarks page, built from result files
(:mod:`reporting.reproduction`; ``python report.py``). It imports neither the simulator's
training package nor the serving and delivery planes: it reads files."""
