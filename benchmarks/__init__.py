"""deltatron's benchmark harness (harness.py) and the pieces it is built from: the configurations and the floor
model (configs.py), the timers (timing.py) and the tables, plot and BENCHMARKS.md (report.py). Not part of the
installed package: run from a checkout (`python benchmarks/run.py`, or `deltatron bench` in a checkout)."""
