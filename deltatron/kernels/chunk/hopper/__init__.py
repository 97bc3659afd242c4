"""Hopper (sm_90) Gluon stages of the chunk algorithm, with the portable stages' names. Imported only where they run."""
