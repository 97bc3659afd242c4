"""Hopper (sm_90) Gluon stages of the chunk algorithm (DESIGN.md §5), with the portable stages' names: walk, reverse.
Imported only where they run (plan.gluon_available)."""
